"""dp-adam-bench: a research harness for differentially private adaptive optimizers.

Reproduces Tang & Lecuyer (DP-AdamBC), Ganesh, McMahan & Thakurta (private Adam variants with correlated noise)
and Li et al. (ghost clipping, GPT-2 on E2E), and runs new task x optimizer x noise-mechanism comparisons.
"""

__version__ = "0.1.0"
