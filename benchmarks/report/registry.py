"""The benchmarks: one script and one CSV each, with the presets of a full run and the arguments of a quick one.

``run_all.py`` runs them from here and the README lists them from here. A benchmark with ``default=False`` (the
GPU one) is left out of a plain ``run_all.py`` / ``make bench`` and only runs when named (``--only gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent


@dataclass(frozen=True)
class Preset:
    """One named invocation of a benchmark script (arguments after the script name)."""

    name: str
    args: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class Bench:
    script: str
    csv: str
    title: str
    what: str
    quick_args: tuple[str, ...]
    # the invocations of a full run, in order; the first replaces the CSV, the others are merged into it
    presets: tuple[Preset, ...] = (Preset("default", ()),)
    merges: bool = False  # whether the script takes --merge (needed by every preset after the first)
    default: bool = True  # run by a plain run_all.py (False: only with --only NAME)


_LM = ("bert_tiny", "bert_tiny_mlm", "gpt2_small")
#: the engine benchmark of a full run (``--presets NAME ...`` runs some of them, merged into the existing CSV)
ENGINE_PRESETS = (
    Preset(
        "cnn5", ("--stp-engines", "bk", "hooks"), "CNN5 at B = 256 and 2048, every mode, stp via bk and hooks"
    ),
    Preset(
        "bert_tiny",
        ("--models", "bert_tiny", "--batch-sizes", "32", "256", "--stp-engines", "bk", "hooks"),
        "BERT-tiny classifier, T = 128, B = 32 and 256, every mode, stp via bk and hooks",
    ),
    Preset(
        "bert_tiny_mlm",
        ("--models", "bert_tiny_mlm", "--batch-sizes", "32", "256"),
        "BERT-tiny MLM, T = 128, B = 32 and 256, every mode it runs (no functorch), stp via bk",
    ),
    Preset(
        "bert_tiny_mlm_stp_hooks",
        ("--models", "bert_tiny_mlm", "--batch-sizes", "32", "--modes", "stp", "--stp-engines", "hooks"),
        "stp via Opacus hooks for comparison, B = 32 only (at B = 256 the per-example gradients and their scaled "
        "copy take about 17 GB)",
    ),
    Preset(
        "gpt2_small_B8",
        ("--models", "gpt2_small", "--batch-sizes", "8"),
        "GPT-2-small-shaped, T = 128, B = 8 (the issue's target), every mode it runs (no functorch), stp via bk",
    ),
    Preset(
        "gpt2_small_lora_B8",
        (
            "--models",
            "gpt2_small_lora",
            "--batch-sizes",
            "8",
            "--modes",
            "nonprivate",
            "bk",
            "ghost",
            "hooks",
        ),
        "the same GPT-2 with LoRA (task.finetune=lora: r = 4 on c_attn, 147k trainable of 163M), B = 8: a LoRA "
        "step against full fine-tuning (issue 45)",
    ),
    Preset(
        "gpt2_small_B8_stp_hooks",
        ("--models", "gpt2_small", "--batch-sizes", "8", "--modes", "stp", "--stp-engines", "hooks"),
        "stp via Opacus hooks for comparison (about 17 GB peak: 8 x 163M per-example gradients and their scaled "
        "copy)",
    ),
    Preset(
        "gpt2_small_B32",
        ("--models", "gpt2_small", "--batch-sizes", "32", "--modes", "nonprivate", "ghost", "bk", "stp"),
        "GPT-2-small-shaped, B = 32 (issue A), whole batch: non-private, Opacus ghost, bk, stp via bk",
    ),
    Preset(
        "gpt2_small_B32_micro8",
        (
            *("--models", "gpt2_small", "--batch-sizes", "32", "--modes", "hooks"),
            *("--physical-batch-size", "8"),
        ),
        "GPT-2-small-shaped, B = 32 in 4 micro-batches of 8 for Opacus hooks: on the whole batch it would hold "
        "per-example gradients of 32 x 163M floats, about 21 GB, more than this machine's 23 GB with the rest of "
        "the step (bk keeps a per-example gradient only where it is no larger than the layer's inputs and output "
        "gradients, none of GPT-2's at T = 128, so it runs the whole batch)",
    ),
)

BENCHES = {
    "accounting": Bench(
        "bench_accounting.py",
        "results_accounting.csv",
        "Sigma calibration (accounting)",
        "wall time of calibrating sigma for eps = 8, delta = 1e-5 per accountant and setting, with cold caches "
        "(median and min over repeats), and of one epsilon evaluation at the calibrated sigma",
        ("--repeats", "1"),
    ),
    "noise": Bench(
        "bench_noise.py",
        "results_noise.csv",
        "Noise generation per step",
        "median wall time of one step of noise (independent, BandMF b = 128, BLT with 4 buffers) for d = 4.4M "
        "(TinyBERT-sized) and d = 124M (GPT-2-sized), and the peak RSS of a process doing only that",
        ("--warmup", "1", "--repeats", "5"),
    ),
    "fig2": Bench(
        "bench_fig2.py",
        "results_fig2.csv",
        "Fig. 2 table end to end",
        "wall time of the whole Ganesh et al. Fig. 2 table (the 91-run sweep and its report, 30 vectorised trials "
        "per run) in a fresh run store, with W&B disabled and offline",
        ("--quick",),
    ),
    "engines": Bench(
        "bench_engines.py",
        "results_engines.csv",
        "Training step per clipping engine",
        "median wall time and peak RSS of one full training step (forward, per-example clipping, sum, noise, "
        "optimizer update) per clipping engine and for scale-then-privatize, against a non-private "
        "forward/backward/torch.optim.Adam step, each configuration in its own process",
        ("--quick", "--models", "cnn5", *_LM, "--stp-engines", "bk", "hooks"),
        ENGINE_PRESETS,
        merges=True,
    ),
    "checks": Bench(
        "bench_checks.py",
        "results_checks.csv",
        "Engine watch on trained weights",
        "median time of one periodic engine check (probe and self-check on 4 random examples) against one private "
        "training step, the steps between two checks at the 2 % budget, and the measured share of training time "
        "the checks took over a run under the auto schedule (issue 44)",
        ("--quick",),
    ),
    # written only by a real GPU run (`make bench-gpu` on a CUDA machine); bench_gpu.py refuses without CUDA
    "gpu": Bench(
        "bench_gpu.py",
        "results_gpu.csv",
        "GPU training step per mode",
        "median time (ms) and peak GPU memory (GiB) of one full training step on one CUDA GPU per mode: "
        "non-private, bk and ghost (ours), Opacus ghost and Opacus hooks, with their ratios to the non-private "
        "step at the same model, batch size and precision",
        ("--device", "cuda", "--quick"),
        (Preset("default", ("--device", "cuda")),),
        default=False,
    ),
}


def default_benches() -> dict[str, Bench]:
    """The benchmarks of a plain ``run_all.py`` / ``make bench`` (the CPU ones), in order."""
    return {k: b for k, b in BENCHES.items() if b.default}
