"""dp-adam-bench: a research harness for differentially private adaptive optimizers.

Reproduces Tang & Lecuyer (DP-AdamBC), Ganesh, McMahan & Thakurta (private Adam variants with correlated noise)
and Li et al. (ghost clipping, GPT-2 on E2E), and runs new task x optimizer x noise-mechanism comparisons.
"""

__version__ = "0.1.0"

from dp_adam_bench.hub import apply_default as _hub_offline_unless_opted_in  # noqa: E402

_hub_offline_unless_opted_in()  # before any datasets / transformers import (dp_adam_bench.hub says why)

# The public API (see the README, "Use it from your own code"), imported on first use so that `import dp_adam_bench`
# stays light (the CLI's help and the privacy tools need no torch model code).
_API = {
    "make_private": "dp_adam_bench.api",
    "DPTrainer": "dp_adam_bench.hf_trainer",
    "PrivacyArguments": "dp_adam_bench.hf_trainer",
    "PrivateTraining": "dp_adam_bench.engine.session",
    "StepResult": "dp_adam_bench.engine.session",
    "TrainingComplete": "dp_adam_bench.engine.session",
    "ConfigError": "dp_adam_bench.errors",
    "fix_model": "dp_adam_bench.engine.fix_model",
    "calibrate_sigma": "dp_adam_bench.privacy.accounting",
    "epsilons": "dp_adam_bench.privacy.accounting",
    "mf_epsilon": "dp_adam_bench.privacy.accounting",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'dp_adam_bench' has no attribute {name!r}")
