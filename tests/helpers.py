"""Shared test helpers: compose a config the way the CLI does."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_dir
from torch import nn

from dp_adam_bench.engine.seeds import RunSeeds
from dp_adam_bench.paths import CONFIG_DIR

from tiny_task import TinyTask

CE = nn.CrossEntropyLoss(reduction="none")

#: Pins a trainer run to the CPU, for the few tests whose claim holds on the CPU only: bit-identical resume after a
#: kill (promised on CPU, engine.trainer.resolve_device), a CPU-only behaviour, or equality with a run the test makes
#: on the CPU. Every other trainer run uses train.device=auto, so on a CUDA machine it runs on the GPU.
ON_CPU = "train.device=cpu"

TINY_1D = ["task.n_train=60", "task.n_test=500", "task.trials=3", "train.log_every=20"]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def tiny_poisson(experiment: str, steps: int, *extra: str) -> list[str]:
    """Overrides of a short private run of the tiny task (tests/tiny_task.py): DP-Adam, independent noise,
    Poisson batches of expected size 16 in micro-batches of 5, W&B off."""
    return [
        "task.name=tiny",
        f"experiment_name={experiment}",
        "optimizer=adam",
        "optimizer.lr=0.01",
        "noise=independent",
        "privacy.sigma=1.0",
        "privacy.clip=0.5",
        "train.sampler=poisson",
        "train.batch_size=16",
        f"train.steps={steps}",
        "train.physical_batch_size=5",
        "logger.wandb.mode=disabled",
        *extra,
    ]


def two_private_steps(experiment: str, *extra: str, batch: int = 8, physical: int = 5) -> list[str]:
    """Overrides of two DP-Adam steps (lr 1e-3, independent noise, sigma 1, C 1) on Poisson batches of expected
    size ``batch`` in micro-batches of ``physical``, W&B off: the language tasks' end-to-end runs."""
    return [
        f"experiment_name={experiment}",
        "optimizer=adam",
        "optimizer.lr=0.001",
        "noise=independent",
        "privacy.sigma=1.0",
        "privacy.clip=1.0",
        "train.sampler=poisson",
        f"train.batch_size={batch}",
        "train.steps=2",
        f"train.physical_batch_size={physical}",
        "logger.wandb.mode=disabled",
        *extra,
    ]


def wordpiece_tokenizer(folder, vocab):
    """An uncased BERT WordPiece tokenizer over ``vocab`` (a list of tokens, specials first), saved in ``folder``."""
    from pathlib import Path

    from transformers import AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "BertTokenizer", "do_lower_case": true}'
    )
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == len(vocab)
    return tok


def first_abstracts(path, n: int):
    """Write the first ``n`` abstracts of the offline arXiv file to ``path`` (gzipped JSON lines); returns ``path``."""
    import gzip

    from dp_adam_bench.paths import shared_data_dir

    with gzip.open(shared_data_dir() / "arxiv_abstracts" / "arxiv_abstracts.jsonl.gz", "rt") as f:
        lines = [next(f) for _ in range(n)]
    with gzip.open(path, "wt") as f:
        f.writelines(lines)
    return path


def tiny_data():
    """The tiny task (tests/tiny_task.py) and its training set as a TensorDataset."""
    task = TinyTask({}, trials=1, seed=0)
    return task, torch.utils.data.TensorDataset(task.x, task.y)


def tiny_model(seed: int = 0) -> nn.Module:
    """The model the CLI trainer builds for the tiny task (same seed stream)."""
    torch.manual_seed(RunSeeds.derive(seed, secure=False).model)
    return TinyTask({}, trials=1, seed=seed).build_model()


def release_in_micro_batch_order(task, model, idx: torch.Tensor, ordered: bool, physical: int = 3, clip=0.05):
    """(the clipped sum the backend releases for the logical batch ``idx``, the padded width summed over its
    micro-batches), split in the task's ``micro_batch_order`` when ``ordered``, else in sampling order. A sum of
    clipped per-example gradients must not depend on the order."""
    from dp_adam_bench.engine.backends import ModelBackend
    from dp_adam_bench.engine.distributed import DistContext

    class Counting:  # the task, recording the padded width of each micro-batch
        def __init__(self):
            self.widths = []
            self.loss_per_example = task.loss_per_example
            if ordered:
                self.micro_batch_order = task.micro_batch_order

        def get_batch(self, i):
            batch = task.get_batch(i)
            self.widths.append(batch["input_ids"].shape[1])
            return batch

    class Summed:  # a privatizer that releases the clipped sum as it is
        def __init__(self):
            self.clip = clip

        def release_sum(self, summed, scale):
            return summed

    counting = Counting()
    backend = ModelBackend(counting, model, "bk", physical, DistContext(), torch.device("cpu"))
    try:
        return backend.release(idx, Summed(), None), sum(counting.widths)
    finally:
        backend.engine.close()
