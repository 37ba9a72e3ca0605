"""Task names -> task classes. Adding a task: one module here, one line below, one YAML in configs/task/.

Entries are ``"module:Class"`` paths imported on first use (the language tasks import transformers).
"""

from __future__ import annotations

from dp_adam_bench.registry import Registry

TASKS = Registry("task", "task.name")
TASKS.register("logistic_1d", "dp_adam_bench.tasks.logistic_1d:Logistic1D")
TASKS.register("cifar10_cnn", "dp_adam_bench.tasks.cifar10_cnn:Cifar10CNN")
TASKS.register("quadratic_2d", "dp_adam_bench.tasks.quadratic_2d:Quadratic2D")
TASKS.register("snli_bert", "dp_adam_bench.tasks.snli_bert:SnliBert")
TASKS.register("arxiv_mlm", "dp_adam_bench.tasks.arxiv_mlm:ArxivMLM")
TASKS.register("e2e_gpt2", "dp_adam_bench.tasks.e2e_gpt2:E2EGpt2")
TASKS.register("glue_sst2", "dp_adam_bench.tasks.glue:GlueTask")
TASKS.register("dialog", "dp_adam_bench.tasks.dialog:DialogGpt2")


def build_task(cfg, *, trials: int, seed: int):
    return TASKS.build(cfg.name, cfg, trials=trials, seed=seed)
