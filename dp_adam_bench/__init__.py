"""dp-adam-bench: a research harness for differentially private adaptive optimizers.

Reproduces Tang & Lecuyer (DP-AdamBC), Ganesh, McMahan & Thakurta (private Adam variants with correlated noise)
and Li et al. (ghost clipping, GPT-2 on E2E), and runs new task x optimizer x noise-mechanism comparisons.
"""

__version__ = "0.1.0"

from dp_adam_bench.hub import apply_default as _hub_offline_unless_opted_in  # noqa: E402

_hub_offline_unless_opted_in()  # before any datasets / transformers import (dp_adam_bench.hub says why)
