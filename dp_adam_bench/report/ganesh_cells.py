"""The cells of Ganesh, McMahan & Thakurta's Fig. 3 (arXiv:2507.01129, §5.2): its rows and columns, which cell a run
belongs to, and the profile setting that decides it. Shared by the table's report (``ganesh_fig3``), the horizon
study's (``ganesh_horizon``) and the figs 4-6 diagnostics, so that none of them imports another."""

from __future__ import annotations

import math

from dp_adam_bench.report.aggregate import get
from dp_adam_bench.sweep import load_preset

#: the paper's columns, in its order
COLUMNS = ("dpsgd_sigma0.134", "bandmf_sigma1_b128", "dpsgd_sigma1")
COLUMN_LABELS = {
    "dpsgd_sigma0.134": "DP-SGD, sigma at BandMF's RMSE",
    "bandmf_sigma1_b128": "DP-BandMF",
    "dpsgd_sigma1": "DP-SGD, sigma at BandMF's epsilon",
}
#: row -> (optimizer name, private?)
ROWS = {
    "nonprivate_sgd": ("sgd", False),
    "nonprivate_adam": ("adam", False),
    "noiseless_precond": ("noiseless_precond", True),
    "stp_noiseless_precond": ("stp_noiseless_precond", True),
    "postprocessing": ("adam", True),
    "ime": ("ime", True),
    "bc": ("bc", True),
    "stp": ("stp", True),
    "dpsgd_momentum": ("sgd", True),
}
ROW_LABELS = {
    "no_finetuning": "no fine-tuning (the initial model)",
    "nonprivate_sgd": "non-private SGD",
    "nonprivate_adam": "non-private Adam",
    "noiseless_precond": "DP-Adam, noiseless preconditioner",
    "stp_noiseless_precond": "scale-then-privatize + noiseless preconditioner",
    "postprocessing": "DP-Adam (post-processing)",
    "ime": "independent moment estimation",
    "bc": "bias correction",
    "stp": "scale-then-privatize",
    "dpsgd_momentum": "DP-SGD (momentum)",
}
#: the DP rows that only use private statistics (the two "noiseless" rows are non-private baselines)
DP_ROWS = ("postprocessing", "ime", "bc", "stp", "dpsgd_momentum")


def column_of(cfg: dict, sigma_low: float, sigma_high: float) -> str | None:
    """The paper column a run belongs to (non-private runs go to the first column, as in the paper)."""
    kind = get(cfg, "noise.kind")
    if kind == "none":
        return COLUMNS[0]
    sigma = float(get(cfg, "privacy.sigma"))
    if kind == "bandmf":
        return COLUMNS[1]
    if kind == "independent":
        if math.isclose(sigma, sigma_low, rel_tol=1e-6):
            return COLUMNS[0]
        if math.isclose(sigma, sigma_high, rel_tol=1e-6):
            return COLUMNS[2]
    return None


def row_of(cfg: dict) -> str | None:
    name, private = get(cfg, "optimizer.name"), get(cfg, "noise.kind") != "none"
    for row, (opt, priv) in ROWS.items():
        if opt == name and priv == private:
            return row
    return None


def profile_setting(profile: str) -> dict:
    """The run settings of ``profile`` in the preset (its top-level ``profiles`` node)."""
    return load_preset("ganesh_fig3", profile)["profiles"][profile]


def cell_locator(setting: dict):
    """config -> (row, column) of the paper's table at the profile ``setting``'s two sigmas."""
    low, high = float(setting["sigma_low"]), float(setting["sigma_high"])
    return lambda cfg: (row_of(cfg), column_of(cfg, low, high))


def steps_of(train_subset, setting: dict) -> int:
    """The number of steps a run of ``train_subset`` abstracts makes at the profile's epochs and batch size."""
    return int(setting["epochs"]) * int(train_subset) // int(setting["batch_size"])


def named(setting: dict) -> str:
    """``lr=0.0006, eps_s1=0.0001`` for a chosen setting {dotted key: value}; keys without a value left out."""
    return ", ".join(f"{k.split('.')[-1]}={v:g}" for k, v in setting.items() if v is not None)
