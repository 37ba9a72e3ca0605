"""Where the time of one training step goes: torch.profiler (CPU) on the step that ``bench_engines.py`` times.

For one (model, batch size, mode) the step of :func:`bench_engines.build_step` is built with
``torch.profiler.record_function`` labels around its phases, run ``--warmup`` times unprofiled, then ``--steps``
times (default 3) under the profiler. Written to ``<out-dir>/<model>_B<b>_<mode>.txt`` (``stp`` with an engine
other than bk: ``..._stp-<engine>.txt``), with a JSON sidecar of the per-phase seconds:

* a one-line ``Summary:`` (the largest phases; against the non-private step's phases when a profile of it is
  already in ``<out-dir>``: where the extra time of the DP step goes);
* the per-phase breakdown: self CPU time of the main thread per step, attributed to the innermost phase label:
  ``forward``, ``backward``, ``per_example_grads`` (Opacus hooks' grad samplers / functorch's vmap), ``norms``
  (per-example norms: Opacus ghost's norm samplers, bk's per-layer rules), ``clipped_sum`` (Opacus ghost's second
  backward, bk's weighted sums), ``norms_and_clipped_sum`` (the materialising engines' norms and einsum),
  ``engine_other``, ``accumulate``, ``scale`` (stp), ``noise`` (noise and 1/B, unscaling for stp), ``optimizer``,
  ``zero_grad``; with each phase's top operators;
* the precision breakdown: per phase, the self time of matmuls and convolutions, of casts and copies, and of the
  rest, by the dtype of each operator's first input (``--precision bf16``: where bf16 autocast leaves fp32 work);
* the top operators by self CPU time over the profiled steps (``key_averages``).

The engine-internal phases are labelled from here, without touching the library: Opacus' grad / norm sampler
tables, the bk engine's per-layer rules and the ghost engine's hook switch are wrapped in this process only.
Backward work not under a finer label is ``backward`` (autograd nodes run on the calling thread on CPU).

    .venv/bin/python benchmarks/profile_step.py --model gpt2_small --batch-size 8 --mode ghost
    .venv/bin/python benchmarks/profile_step.py --model bert_tiny_mlm --batch-size 256 --mode stp --engine hooks
    .venv/bin/python benchmarks/profile_step.py --quick --model cnn5 --batch-size 16 --mode bk --out-dir /tmp/p
    .venv/bin/python benchmarks/profile_step.py --model bert_base --batch-size 8 --mode bk --precision bf16

``benchmarks/run_all.py`` runs it for every (model, B, mode) that misses its target (non-private first, as the
reference). Threads: ``BENCH_THREADS`` (default 2), as in bench_engines.py; one torch job at a time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import bench_engines as be  # noqa: E402

OUT_DIR = BENCH_DIR / "profiles"
PHASES = (
    "forward",
    "backward",
    "per_example_grads",
    "norms",
    "norms_and_clipped_sum",
    "clipped_sum",
    "engine_other",
    "accumulate",
    "scale",
    "noise",
    "optimizer",
    "zero_grad",
    "unlabelled",
)
CONTAINER = "clip_engine"  # the label around engine.clipped_sum: work not under a finer label is split below


def profile_name(model: str, b: int, mode: str, engine: str | None = None, precision: str = "fp32") -> str:
    """File stem of a profile: ``<model>_B<b>_<mode>``, ``..._stp-<engine>`` for stp off the default engine,
    ``..._bf16`` under bf16 autocast."""
    if mode == "stp" and engine and engine != be.DEFAULT_STP_ENGINE:
        mode = f"stp-{engine}"
    return f"{model}_B{b}_{mode}" + ("" if precision == "fp32" else f"_{precision}")


# --------------------------------------------------------------------------------------------- instrumentation


def _labelled(fn, label, name):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with label(name):
            return fn(*args, **kwargs)

    return wrapped


class Patches:
    """Attribute and dict-entry replacements, undone by :meth:`undo` (so that profiling in a process that goes on,
    e.g. a test, leaves Opacus and the library as they were)."""

    def __init__(self):
        self._undo: list = []

    def setattr(self, obj, name: str, value) -> None:
        had = name in vars(obj) if hasattr(obj, "__dict__") else True
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def wrap_table(self, table: dict, label, name: str) -> None:
        old = dict(table)
        for k, fn in old.items():
            table[k] = _labelled(fn, label, name)

        def restore():
            table.clear()
            table.update(old)

        self._undo.append(restore)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def instrument(step: be.Step, label, patches: Patches) -> list[str]:
    """Label the engine-internal phases of ``step`` through ``patches``; returns what was wrapped."""
    engine = step.engine_obj
    if engine is None:
        return []
    P = be.PHASE_PREFIX  # noqa: N806
    done = []
    name = step.engine
    if name in ("hooks", "ghost"):
        from opacus.grad_sample import grad_sample_module as gsm_mod
        from opacus.grad_sample import grad_sample_module_fast_gradient_clipping as fgc_mod

        # in ghost mode the grad samplers only serve layers without a norm sampler: they compute norms there
        what = P + ("per_example_grads" if name == "hooks" else "norms")
        patches.wrap_table(gsm_mod.GradSampleModule.GRAD_SAMPLERS, label, what)
        for mod in (gsm_mod, fgc_mod):
            fn = getattr(mod, "ft_compute_per_sample_gradient", None)
            if fn is not None:
                patches.setattr(mod, "ft_compute_per_sample_gradient", _labelled(fn, label, what))
        done.append(f"Opacus grad samplers -> {what[len(P) :]}")
    if name == "ghost":
        from opacus.grad_sample import grad_sample_module_fast_gradient_clipping as fgc_mod

        patches.wrap_table(fgc_mod.GradSampleModuleFastGradientClipping.NORM_SAMPLERS, label, P + "norms")
        # GhostEngine runs its second backward (the clipped sum) between gsm.disable_hooks() and enable_hooks()
        gsm, open_ranges = engine.gsm, []
        disable, enable = gsm.disable_hooks, gsm.enable_hooks

        def disable_hooks():
            rf = label(P + "clipped_sum")
            rf.__enter__()
            open_ranges.append(rf)
            return disable()

        def enable_hooks():
            out = enable()
            while open_ranges:
                open_ranges.pop().__exit__(None, None, None)
            return out

        patches.setattr(gsm, "disable_hooks", disable_hooks)
        patches.setattr(gsm, "enable_hooks", enable_hooks)
        done.append("Opacus ghost norm samplers -> norms; second backward -> clipped_sum")
    if name in ("hooks", "functorch"):
        from dp_adam_bench.engine import grads

        if name == "functorch":
            fn = engine.per_example_grads
            patches.setattr(engine, "per_example_grads", _labelled(fn, label, P + "per_example_grads"))
            done.append("functorch vmap(grad) -> per_example_grads")
        fn = grads._sum_materialised  # GradEngine.clipped_sum looks it up in the module at every call
        patches.setattr(grads, "_sum_materialised", _labelled(fn, label, P + "norms_and_clipped_sum"))
        done.append("grads._sum_materialised -> norms_and_clipped_sum")
    if name == "bk":
        import dataclasses

        for layer in engine.layers:
            fn = layer.rule.compute

            def wrapped(*args, _fn=fn, **kwargs):
                with label(P + "norms"):
                    sq, finish = _fn(*args, **kwargs)

                def fin(c, _finish=finish):
                    with label(P + "clipped_sum"):
                        return _finish(c)

                return sq, fin

            # bk calls layer.rule.compute at every step (engine/bk_rules/)
            patches.setattr(layer, "rule", dataclasses.replace(layer.rule, compute=wrapped))
        done.append("bk per-layer rules -> norms, their finishers -> clipped_sum")
    return done


# --------------------------------------------------------------------------------------------- attribution


def _phase_of(ev) -> str:
    """The innermost phase label enclosing event ``ev`` (itself included); inside the engine container,
    autograd work is ``backward`` and the rest ``engine_other``."""
    in_autograd = False
    e = ev
    while e is not None:
        name = e.name
        if name.startswith(be.PHASE_PREFIX):
            phase = name[len(be.PHASE_PREFIX) :]
            if phase == CONTAINER:
                return "backward" if in_autograd else "engine_other"
            return phase
        if name.startswith("autograd::engine::evaluate_function"):
            in_autograd = True
        e = e.cpu_parent
    return "unlabelled"


def attribute(events, n_steps: int) -> tuple[dict[str, float], dict[str, list[tuple[str, float]]]]:
    """(seconds per step per phase, top operators per phase as (name, s/step)) from profiler events."""
    per_phase: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in events:
        s = ev.self_cpu_time_total / 1e6 / n_steps
        if s <= 0:
            continue
        phase = _phase_of(ev)
        per_phase[phase] += s
        if not ev.name.startswith(be.PHASE_PREFIX):
            ops[phase][ev.name] += s
    top = {p: sorted(d.items(), key=lambda kv: -kv[1])[:3] for p, d in ops.items()}
    return dict(per_phase), top


#: operators by what they do, for the precision breakdown (the rest is "other")
OP_KINDS = {
    "matmul / conv": (
        "aten::mm",
        "aten::bmm",
        "aten::addmm",
        "aten::baddbmm",
        "aten::convolution",
        "aten::_convolution",
        "aten::mkldnn_convolution",
        "aten::convolution_backward",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    "cast / copy": ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous"),
}


def _kind(name: str) -> str:
    return next((k for k, names in OP_KINDS.items() if name in names), "other")


def precision_breakdown(events, n_steps: int) -> dict[tuple[str, str, str], float]:
    """Self CPU seconds per step by (phase, operator kind, the dtype of its first tensor input): which kernels
    run in bf16 and which in fp32, and what the casts between them cost (needs ``record_shapes=True``)."""
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    for ev in events:
        s = ev.self_cpu_time_total / 1e6 / n_steps
        if s <= 0 or ev.name.startswith(be.PHASE_PREFIX):
            continue
        dtypes = [d for d in (getattr(ev, "input_dtypes", None) or []) if d and d != "Scalar"]
        dtype = dtypes[0].replace("c10::", "") if dtypes else "-"
        out[(_phase_of(ev), _kind(ev.name), dtype)] += s
    return dict(out)


def _precision_table(breakdown: dict[tuple[str, str, str], float]) -> list[str]:
    lines = [
        "Precision breakdown: self CPU seconds per step by phase, operator kind and the dtype of the operator's "
        "first tensor input (aten::to / _to_copy: the dtype cast from; copy_: the destination's)",
        "",
        "| phase | kind | input dtype | s/step |",
        "|---|---|---|---|",
    ]
    order = {p: i for i, p in enumerate(PHASES)}
    for (phase, kind, dtype), s in sorted(
        breakdown.items(), key=lambda kv: (order.get(kv[0][0], len(order)), -kv[1])
    ):
        if s >= 1e-4:
            lines.append(f"| {phase} | {kind} | {dtype} | {s:.4g} |")
    return lines


def summary(label: str, phases: dict[str, float], base: dict | None, top_op: tuple[str, float] | None) -> str:
    total = sum(phases.values())
    if total <= 0:
        return f"{label}: nothing recorded"
    parts = sorted(phases.items(), key=lambda kv: -kv[1])
    op = f"; top operator {top_op[0]} {100 * top_op[1] / total:.0f} % of self CPU" if top_op else ""
    if base:
        b_phases = base["phases_s"]
        b_total = sum(b_phases.values())
        extra = {p: phases.get(p, 0.0) - b_phases.get(p, 0.0) for p in set(phases) | set(b_phases)}
        big = [kv for kv in sorted(extra.items(), key=lambda kv: -kv[1]) if kv[1] > 0.02 * total][:3]
        where = ", ".join(f"{p} +{s:.3g} s" for p, s in big) or "spread thin"
        return (
            f"{label}: {total:.3g} s/step profiled vs non-private {b_total:.3g} s ({total / b_total:.2f}x); "
            f"the extra {total - b_total:.3g} s: {where}{op}"
        )
    shares = ", ".join(f"{p} {100 * s / total:.0f} %" for p, s in parts[:3])
    return f"{label}: {total:.3g} s/step profiled: {shares}{op}"


# --------------------------------------------------------------------------------------------- main


@dataclass
class Profiled:
    """One configuration's step after its profiled run: the step, what was instrumented, the wall times of the
    unprofiled warm-up and the profiled steps, and the profiler."""

    step: be.Step
    wrapped: list[str]
    warm: list[float]
    walls: list[float]
    prof: object


def profile(
    model: str,
    b: int,
    mode: str,
    engine: str | None = None,
    physical_batch_size: int = 256,
    warmup: int = 1,
    steps: int = 3,
    quick: bool = False,
    out_dir: Path = OUT_DIR,
    top: int = 25,
    precision: str = "fp32",
) -> Path:
    """Profile one configuration and write its text file (and JSON sidecar); returns the text file's path.
    ``precision``: ``bf16`` runs the model's forward and backward under bf16 autocast, as train.precision=bf16."""
    import torch

    engine = _engine_of(mode, engine)
    threads = be._threads()
    torch.set_num_threads(threads)
    spec = {
        "model": model,
        "batch_size": b,
        "mode": mode,
        "engine": engine,
        "physical_batch_size": physical_batch_size,
        "quick": quick,
        "precision": precision,
    }
    run = _profiled_run(spec, warmup, steps)
    phases, top_ops = attribute(run.prof.events(), steps)
    stem = profile_name(model, b, mode, engine, precision)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_file = out_dir / f"{profile_name(model, b, 'nonprivate', precision=precision)}.json"
    base = _comparable_base(base_file, mode, threads, quick)
    averages = run.prof.key_averages()
    what = (
        f"{mode}"
        + (f" ({engine})" if engine and engine != mode else "")
        + (f", {precision} autocast" if precision != "fp32" else "")
    )
    line = summary(f"{model} B={b} {what}", phases, base, _top_op(averages, steps))
    info = {
        "model": model,
        "batch_size": b,
        "mode": mode,
        "engine": run.step.engine,
        "physical_batch_size": run.step.physical_batch_size,
        "seq_len": run.step.seq_len,
        "params": run.step.params,
        "threads": threads,
        "quick": quick,
        "precision": precision,
        "warmup": warmup,
        "steps": steps,
        "wall_unprofiled_s": run.warm,
        "wall_profiled_s": run.walls,
        "phases_s": phases,
        "summary": line,
        "cpu": be.cpu_name(),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        **be.versions(),
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = _heading(info, run, what) + _phase_table(phases, top_ops, base)
    lines += ["", *_precision_table(precision_breakdown(run.prof.events(), steps))]
    lines += [
        "",
        f"Top {top} operators by self CPU time, all {steps} profiled steps:",
        "",
        averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60),
    ]
    path = out_dir / f"{stem}.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _engine_of(mode: str, engine: str | None) -> str:
    """The engine a mode runs: none without privacy, the mode itself for a flat engine, stp's chosen one (or its
    default)."""
    if mode == "nonprivate":
        return ""
    if mode != "stp":
        return mode
    return engine or be.DEFAULT_STP_ENGINE


def _profiled_run(spec: dict, warmup: int, steps: int) -> Profiled:
    """The step built and instrumented, ``warmup`` steps unprofiled, then ``steps`` under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    step = be.build_step(spec, label=record_function)
    patches = Patches()
    try:
        wrapped = instrument(step, record_function, patches)
        warm = _timed(step, warmup)
        # input shapes and dtypes recorded: which kernels run in which precision, and the casts between them
        with torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            walls = _timed(step, steps)
    finally:
        patches.undo()
        if step.close is not None:
            step.close()
    return Profiled(step, wrapped, warm, walls, prof)


def _timed(step: be.Step, n: int) -> list[float]:
    """Wall seconds of each of ``n`` steps."""
    walls = []
    for _ in range(n):
        t0 = time.perf_counter()
        step.run()
        walls.append(time.perf_counter() - t0)
    return walls


def _comparable_base(base_file: Path, mode: str, threads: int, quick: bool) -> dict | None:
    """The non-private profile of the same model and B, if there is one made with the same threads and sizes."""
    if mode == "nonprivate" or not base_file.is_file():
        return None
    base = json.loads(base_file.read_text())
    if base.get("threads") != threads or bool(base.get("quick")) != quick:
        return None  # not comparable
    return base


def _top_op(averages, steps: int) -> tuple[str, float] | None:
    """The operator (not a phase label) with the most self CPU time, and its seconds per step."""
    op_rows = sorted(
        (e for e in averages if not e.key.startswith(be.PHASE_PREFIX)), key=lambda e: -e.self_cpu_time_total
    )
    return (op_rows[0].key, op_rows[0].self_cpu_time_total / 1e6 / steps) if op_rows else None


def _heading(info: dict, run: Profiled, what: str) -> list[str]:
    """The profile's first lines: what ran, its summary, the machine and versions, the wall times."""
    step = run.step
    return [
        f"Profile of one training step: {info['model']} ({step.description}), B={info['batch_size']}, mode {what}",
        f"Summary: {info['summary']}",
        "",
        f"physical batch {step.physical_batch_size}; {step.params:,} trainable parameters; threads "
        f"{info['threads']}; cpu {info['cpu']}; torch {info['torch_version']}, opacus {info['opacus_version']}, "
        f"transformers {info['transformers_version']}; {info['date']}"
        + ("; QUICK (tiny shapes, not representative)" if info["quick"] else ""),
        f"wall per step: unprofiled (warm-up) {', '.join(f'{w:.3g}' for w in run.warm) or '-'} s; "
        f"profiled median {statistics.median(run.walls):.3g} s over {info['steps']} steps (profiler overhead "
        "included)",
        "instrumented: " + ("; ".join(run.wrapped) if run.wrapped else "phase labels of the step only"),
        "",
    ]


def _phase_table(phases: dict[str, float], top_ops: dict, base: dict | None) -> list[str]:
    """Self CPU seconds per step of each phase, its share, the non-private profile's (when comparable) and the
    phase's top operators."""
    total = sum(phases.values())
    lines = [
        "Per-phase breakdown: self CPU time of the main thread, seconds per step (intra-op threads run inside it)",
        "",
        "| phase | s/step | share |"
        + (" non-private s/step |" if base else "")
        + " top operators (s/step) |",
        "|---|---|---|" + ("---|" if base else "") + "---|",
    ]
    for p in PHASES:
        s = phases.get(p, 0.0)
        b_s = base["phases_s"].get(p, 0.0) if base else 0.0
        if s <= 0 and b_s <= 0:
            continue
        ops = ", ".join(f"{n} {v:.3g}" for n, v in top_ops.get(p, []))
        lines.append(
            f"| {p} | {s:.4g} | {100 * s / total:.1f} % |" + (f" {b_s:.4g} |" if base else "") + f" {ops} |"
        )
    lines.append(
        f"| total | {total:.4g} | 100 % |"
        + (f" {sum(base['phases_s'].values()):.4g} |" if base else "")
        + " |"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, choices=sorted(be.MODELS))
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--mode", required=True, choices=be.MODES)
    parser.add_argument(
        "--engine", choices=be.STP_ENGINES, help=f"stp only (default {be.DEFAULT_STP_ENGINE})"
    )
    parser.add_argument("--physical-batch-size", type=int, default=256, help="DP micro-batch size; 0 = whole")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--quick", action="store_true", help="tiny language models, as bench_engines --quick")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--top", type=int, default=25, help="operators listed")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: the model under bf16 autocast"
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("need --batch-size >= 1, --steps >= 1, --warmup >= 0")
    if args.engine and args.mode != "stp":
        parser.error("--engine is for --mode stp (other modes name their engine)")
    if args.mode in be.UNSUPPORTED.get(args.model, {}):
        parser.error(f"{args.model} does not run {args.mode}: {be.UNSUPPORTED[args.model][args.mode]}")
    t0 = time.perf_counter()
    path = profile(
        args.model,
        args.batch_size,
        args.mode,
        args.engine,
        args.physical_batch_size,
        args.warmup,
        args.steps,
        args.quick,
        args.out_dir,
        args.top,
        args.precision,
    )
    print(path.read_text().splitlines()[1])
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
