"""Task names -> builder functions. Adding a task: one module here, one line below, one YAML in configs/task/."""

from __future__ import annotations

import importlib

TASKS: dict[str, str] = {
    "logistic_1d": "dp_adam_bench.tasks.logistic_1d:Logistic1D",
    "cifar10_cnn": "dp_adam_bench.tasks.cifar10_cnn:Cifar10CNN",
    "quadratic_2d": "dp_adam_bench.tasks.quadratic_2d:Quadratic2D",
    "snli_bert": "dp_adam_bench.tasks.snli_bert:SnliBert",
    "arxiv_mlm": "dp_adam_bench.tasks.arxiv_mlm:ArxivMLM",
    "e2e_gpt2": "dp_adam_bench.tasks.e2e_gpt2:E2EGpt2",
}


def build_task(cfg, *, trials: int, seed: int):
    name = cfg.name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg, trials=trials, seed=seed)
