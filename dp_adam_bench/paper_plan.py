"""``dp-adam-bench sweep <experiment> --profile paper --plan``: what each paper table costs, before anything runs.

Per table: the runs, the steps and examples per step of each, epsilon under every accountant, the trainable
parameters, an estimate of the peak memory per GPU and of the GPU-hours. Nothing is loaded from the hub: the
training-set sizes are the published ones (:data:`PAPER_EXAMPLES`), the models are built from their published
configurations on the ``meta`` device (shapes only), with the task modules' own surgery.

Estimates, stated as such:

* FLOPs of a training step: ``6 x (forward FLOPs per token / 2) x tokens`` for the trained part and ``2 x`` for the
  frozen part below it, i.e. forward 2 FLOPs per parameter per token plus a backward of twice that where gradients
  flow (Kaplan et al. 2020, "Scaling laws for neural language models", arXiv:2001.08361, §2.1), plus attention
  ``2 n_layer T d`` per token; times the clipping engine's overhead (:data:`CLIPPING_OVERHEAD`: book-keeping adds
  the per-example norms to one backward, Bu et al. 2023, arXiv:2210.00038; ghost clipping runs a second backward,
  Li et al. 2022, arXiv:2110.05679 §4). Convolutions: 2 x kernel MACs per output.
* GPU-hours: FLOPs / (device throughput x utilisation), :data:`DEVICE`.
* Peak memory per GPU (one process): float32 weights, gradients, the clipped sum, the optimizer's moments and the
  noise mechanism's buffers for the trained coordinates, plus the activations of one physical micro-batch (the
  ``34 T d + 5 a T^2`` bytes per layer and sequence of Korthikanti et al. 2022, arXiv:2205.05198, eq. 2, doubled
  for float32) and its logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Training examples the paper-profile runs sample from (the data loaders keep these many).
#: CIFAR-10 train: 50,000 (Krizhevsky 2009). SNLI train: 550,152 pairs of which 785 have no gold label and are
#: dropped (Bowman et al. 2015), 549,367. E2E train: 42,061 pairs (Novikova et al. 2017). arXiv abstracts: the
#: preset's train_subset (666 x 2,048, Ganesh et al. §5.2).
PAPER_EXAMPLES = {"cifar10_cnn": 50_000, "snli_bert": 549_367, "e2e_gpt2": 42_061}

#: Device the GPU-hours assume: an NVIDIA A100 (80 GB) in float32 without TF32 (PyTorch's default for matmuls),
#: 19.5 TFLOP/s peak, at 40 % utilisation.
DEVICE = {"name": "A100-80GB fp32", "tflops": 19.5, "utilisation": 0.4, "memory_gb": 80}

#: backward-pass cost of each clipping engine relative to a non-private backward
CLIPPING_OVERHEAD = {"bk": 1.1, "ghost": 2.0, "hooks": 1.5, "functorch": 1.5, "loop": 1.0}


def paper_examples(data: dict) -> int | None:
    """The number of training examples the paper's run samples from (None for tasks without one)."""
    task = data.get("task") or {}
    if task.get("train_subset") is not None:
        return int(task["train_subset"])
    return PAPER_EXAMPLES.get(task.get("name"))


@dataclass
class RunPlan:
    label: str
    steps: int
    batch_size: float
    sampler: str
    sigma: float
    epsilon: dict
    trainable: int
    total: int
    memory_gb: float
    gpu_hours: float
