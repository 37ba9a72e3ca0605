"""The ``grid_bf16`` part (in-process: ``gpu_check.py grid``): the conformance grid's layer cases through bk (auto,
Gram, instantiate) under bf16 autocast, and the engine self-check on the benchmark models (CNN5, BERT-base, GPT-2
small) in fp32 and bf16."""

from __future__ import annotations

import sys

from .paths import TESTS

#: cases of the conformance grid under --quick (the first ones: linear, conv), and the self-check's examples
QUICK_CASES = 4
BK_PATHS = ("bk", "bk:gram", "bk:instantiate")
MODELS = ("cnn5", "bert_base", "gpt2_small")


def cmd_grid(args) -> dict:
    """Conformance cases through bk's paths under bf16 autocast, and the self-check on the benchmark models in fp32
    and bf16.

    A cell's bk (bf16 autocast, the path and IEEE settings the self-check uses) is compared with two references at
    the self-check's bf16 tolerance: the loop under the same bf16 autocast (the self-check's own reference) and the
    fp32 loop (``tests/test_conformance.py``'s oracle). It matches when either agrees. The fp32 loop is the weaker
    reference: bf16 autocast changes the probes' own gradients (on a CPU, a conv1d probe's per-example norms moved
    up to 38 %, bk and the bf16 loop alike), so most cells match only the bf16 loop. A cell that matches only the
    fp32 loop is listed as one where the bf16 self-check would stop a run on a correct engine (on a CPU:
    nn.MultiheadAttention with add_bias_kv and add_zero_attn, the size-one bf16 loop 8 % off bk's batched bf16,
    5.8 % off the fp32 norms where bk is 0.7 % off). Planted bug: bk's clip factors 10 % too large fail every cell
    against both references."""
    from dp_adam_bench.engine.self_check import BF16_TOLERANCE

    tc = _conformance_suite(args.device)

    def autocast():
        import torch

        return torch.autocast(tc.DEVICE.type, dtype=torch.bfloat16)

    rows, bad, false_alarms = [], [], []
    for case in _cases(tc, args.quick):
        oracle = tc.oracle(case, "f32-ce")
        for engine in BK_PATHS:
            row, wrong = _grid_cell(tc, case, engine, oracle, autocast, BF16_TOLERANCE)
            rows.append(row)
            if wrong is not None:
                bad.append(wrong)
            elif row.get("error_vs_bf16_loop", 0.0) > BF16_TOLERANCE:  # a match of the fp32 loop only
                false_alarms.append(f"{case.id} {engine} ({row['error_vs_bf16_loop']:.2g})")
    models, refused = _self_check_models(tc.DEVICE, args.quick, autocast)
    bad += refused
    return {
        "ok": not bad,
        "cells": rows,
        "self_check_false_alarms": false_alarms,
        "models": models,
        "summary": _summary(rows, false_alarms, models, bad, BF16_TOLERANCE),
    }


def _conformance_suite(device: str):
    """``tests/test_conformance.py`` (its cases, oracle and builders), refused if it picked another device."""
    sys.path.insert(0, str(TESTS))
    import test_conformance as tc

    if tc.DEVICE.type != device:
        raise SystemExit(f"grid: the conformance suite picked {tc.DEVICE}, not {device}")
    return tc


def _cases(tc, quick: bool) -> list:
    """The grid's defined cases (the first :data:`QUICK_CASES` under --quick), less those needing a missing
    transformers."""
    cases = [c for c in tc.CASES if not c.undefined]
    if quick:
        cases = cases[:QUICK_CASES]
    return [c for c in cases if "transformers" not in c.tags or _has_transformers()]


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _grid_cell(tc, case, engine: str, oracle, autocast, tol: float) -> tuple[dict, str | None]:
    """One (case, bk path) cell under bf16 autocast: its row, and what is wrong with it (None: as expected, a
    match or a refusal where the grid wants one)."""
    import torch

    from dp_adam_bench.engine.self_check import loop_reference
    from dp_adam_bench.errors import ConfigError

    want = "refused" if case.bk_refuses else "match"
    row = {"case": case.id, "engine": engine}
    norms_ref, clip, summed_ref = oracle
    try:
        eng = tc.build(engine, tc.make_model(case, torch.float32), tc.loss_fn("ce"))
    except ConfigError:
        return row | {"outcome": "refused"}, None if want == "refused" else f"{case.id} {engine}: refused"
    batch = tc.make_batch(case, torch.float32)
    try:
        got, per_ex = _bk_and_bf16_loop(eng, batch, clip, autocast)
    except (ConfigError, ValueError) as e:
        row |= {"outcome": "refused", "error": str(e)[:200]}
        return row, None if want == "refused" else f"{case.id} {engine}: refused ({str(e)[:100]})"
    finally:
        eng.close()
    norms, summed = loop_reference([g.float() for g in per_ex], clip)
    row |= {"error_vs_fp32_loop": _rel_error(got, norms_ref, summed_ref)}
    row |= {"error_vs_bf16_loop": _rel_error(got, norms, summed)}
    ok = min(row["error_vs_fp32_loop"], row["error_vs_bf16_loop"]) <= tol
    row["outcome"] = "match" if ok else "mismatch"
    if row["outcome"] == want:
        return row, None
    return row, (f"{case.id} {engine}: {row['outcome']} (vs fp32 loop {row['error_vs_fp32_loop']:.3g}, "
                 f"vs bf16 loop {row['error_vs_bf16_loop']:.3g})")  # fmt: skip


def _bk_and_bf16_loop(eng, batch, clip: float, autocast):
    """bk's clipped sum under bf16 autocast, and the per-example loop's gradients under the same autocast (the
    self-check's reference), both with the probes neutral and IEEE fp32 math."""
    from dp_adam_bench.engine.fp32_exact import ieee_fp32
    from dp_adam_bench.engine.grads import loop_grads
    from dp_adam_bench.engine.probe import neutral

    with neutral(eng.model), ieee_fp32():
        with autocast():
            got = eng.clipped_sum(batch, clip)
        eng._hooks(False)
        try:
            with autocast():
                per_ex = loop_grads(eng.model, eng.loss_per_example, eng.params, batch)
        finally:
            eng._hooks(True)
    return got, per_ex


def _rel_error(got, norms, summed) -> float:
    """The self-check's measure: the larger of the worst relative norm error and the clipped sum's relative error."""
    from dp_adam_bench.engine.self_check import relative_errors

    return max(relative_errors(got, norms.float(), summed))


def _self_check_models(dev, quick: bool, autocast) -> tuple[list[dict], list[str]]:
    """The engine self-check (bk) on each benchmark model in fp32 and bf16: its records, and its refusals."""
    import bench_engines as be
    import torch

    from dp_adam_bench.engine.bk import BKEngine
    from dp_adam_bench.engine.self_check import BF16_TOLERANCE, DEFAULT_TOLERANCE, self_check
    from dp_adam_bench.errors import ConfigError

    models, refused = [], []
    for name in MODELS:
        bm = be.MODELS[name](quick=quick)
        model = bm.model.to(dev).train()
        batch = {k: v.to(dev) for k, v in bm.make_batch(4, torch.Generator().manual_seed(1)).items()}
        for precision in ("fp32", "bf16"):
            eng = BKEngine(model, bm.loss_per_example)
            try:
                tol = BF16_TOLERANCE if precision == "bf16" else DEFAULT_TOLERANCE
                ctx = autocast if precision == "bf16" else None
                rec = self_check(eng, batch, 1.0, tol, ctx) if ctx else self_check(eng, batch, 1.0, tol)
                models.append({"model": name, "precision": precision, "max_rel_error": rec["max_rel_error"]})
            except ConfigError as e:
                models.append({"model": name, "precision": precision, "error": str(e)[:200]})
                refused.append(f"self-check {name} {precision}: {str(e)[:120]}")
            finally:
                eng.close()
        del model
    return models, refused


def _summary(
    rows: list[dict], false_alarms: list[str], models: list[dict], bad: list[str], tol: float
) -> str:
    matched = sum(r["outcome"] == "match" for r in rows)
    worst = max(
        (min(r["error_vs_fp32_loop"], r["error_vs_bf16_loop"]) for r in rows if r["outcome"] == "match"),
        default=float("nan"),
    )
    return (
        f"bf16 grid: {matched} of {len(rows)} (case, bk path) cells match the fp32 or the bf16 loop (worst "
        f"{worst:.2g}, tolerance {tol:g}; the rest refused as expected); the bf16 loop (the "
        f"self-check's reference) off on {len(false_alarms)}: {', '.join(false_alarms[:6]) or '-'}; self-check on "
        + ", ".join(
            f"{m['model']} {m['precision']} {m.get('max_rel_error', float('nan')):.2g}" for m in models
        )
        + (f"; WRONG: {'; '.join(bad[:10])}" if bad else "")
    )
