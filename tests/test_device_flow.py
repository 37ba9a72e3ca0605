"""Tensors the engine creates follow the model's device and dtype (GPU readiness, checked on CPU)."""

import ast
from pathlib import Path

import pytest
import torch

from dp_adam_bench.engine.diagnostics import Diagnostics, summary_stats

PACKAGE = Path(__file__).resolve().parents[1] / "dp_adam_bench"
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "randn", "rand", "linspace", "eye"}
# creations that are meant to live on the CPU: sampler indices and seeds, the host-side accounting
CPU_BY_DESIGN = {"engine/sampling.py", "engine/trainer.py", "engine/bk.py"}


def test_engine_factories_name_a_device():
    """Static: every torch factory call in the engine / privatizer / optimizers / noise mechanisms passes
    ``device=`` (or is a ``*_like`` / ``new_*``), except in the files that build host-side tensors on purpose."""
    bad = []
    for sub in ("engine", "optim", "privacy"):
        for f in sorted((PACKAGE / sub).rglob("*.py")):
            rel = f.relative_to(PACKAGE).as_posix()
            if rel in CPU_BY_DESIGN or "accounting" in rel:
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                    and node.func.attr in FACTORIES
                    and not any(k.arg == "device" for k in node.keywords)
                ):
                    bad.append(f"{rel}:{node.lineno} torch.{node.func.attr}")
    assert not bad, "tensor factories without device=: " + ", ".join(bad)


def test_quantile_levels_follow_the_sample(monkeypatch):
    """Regression: the quantile levels were built on the default device (CPU) whatever the sample's."""
    seen = {}
    real = torch.quantile

    def spy(x, q, *a, **kw):
        seen["q"] = (q.device, q.dtype, x.device, x.dtype)
        return real(x, q, *a, **kw)

    monkeypatch.setattr(torch, "quantile", spy)
    x = torch.rand(100, dtype=torch.float64)
    stats = summary_stats(x, torch.Generator().manual_seed(0))
    assert seen["q"][0] == seen["q"][2] and seen["q"][1] == torch.float64
    assert stats["q1"] <= stats["median"] <= stats["q3"]


def test_diagnostics_keep_float64(tmp_path):
    """A float64 model's clean moments stay float64, and histograms are written from them."""
    from types import SimpleNamespace

    d = Diagnostics(every=1, hist_dir=tmp_path)
    clean = [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    state = {"m": [c * 0.1 for c in clean], "v": [c * c for c in clean], "step": 1}
    out = d.observe(SimpleNamespace(clean=clean, clip=1.0, expected_batch_size=4), state)
    assert d.state["m"][0].dtype == torch.float64 and out["diag/v_clean_max"] >= 0
    assert out["diag/frac_v_negative"] == 0.0  # v = c^2 here
    assert (tmp_path / "step_1.npz").is_file()


def _recording_inputs(model):
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append((args[0].device, args[0].dtype)))
    return seen


def test_the_tiny_task_evaluates_where_the_model_is():
    """The test helpers' task (tests/tiny_task.py) feeds its test set to the model on the model's device and in its
    dtype: the trainer moves the model to train.device (cuda when available) and evaluates it there. On a CPU
    machine, float64 and the ``meta`` device stand in for a GPU."""
    from tiny_task import TinyTask

    task = TinyTask({}, trials=1, seed=0)
    model = task.build_model().to(torch.float64)
    seen = _recording_inputs(model)
    metrics = task.evaluate(model)
    assert seen == [(torch.device("cpu"), torch.float64)]
    assert 0 <= metrics["test_accuracy"] <= 100 and metrics["test_loss"] > 0
    meta = task.build_model().to("meta")
    seen = _recording_inputs(meta)
    try:
        task.evaluate(meta)  # the forward runs on meta tensors; reading a float out of them cannot
    except (NotImplementedError, RuntimeError):
        pass
    assert seen == [(torch.device("meta"), torch.float32)]


def test_diagnostics_norm_quantiles_and_stp_scale():
    """The per-example norm quantiles over C and scale-then-privatize's scale spread, against numpy on known
    inputs: sqrt(v^) above eps_s1 in exactly 3 of 8 coordinates (s = 1 / (sqrt(v^) + eps_s1))."""
    from types import SimpleNamespace

    import numpy as np

    d = Diagnostics(every=1)
    clean = [torch.randn(8, dtype=torch.float64)]
    eps_s1 = 1e-4
    root_v = torch.tensor([0.0, 1e-6, 5e-5, 9e-5, 1.1e-4, 1e-3, 1e-2, 0.0], dtype=torch.float64)
    scale = [1.0 / (root_v + eps_s1)]
    norms = torch.tensor([0.5, 2.0, 3.0, 10.0, 4.0], dtype=torch.float64)
    ctx = SimpleNamespace(clean=clean, clip=2.0, expected_batch_size=5)
    out = d.observe(ctx, {"step": 1}, norms=norms, scale=scale, scale_eps=eps_s1)
    ratio = norms.numpy() / 2.0
    assert out["diag/norm_over_clip_median"] == pytest.approx(np.median(ratio))
    assert out["diag/norm_over_clip_q90"] == pytest.approx(np.quantile(ratio, 0.9))
    assert out["diag/norm_over_clip_max"] == pytest.approx(5.0)
    assert out["diag/stp_frac_sqrtv_above_eps_s1"] == pytest.approx(3 / 8)
    assert out["diag/stp_scale_max"] == pytest.approx(1 / eps_s1)
    assert out["diag/stp_scale_min"] == pytest.approx(1 / (1e-2 + eps_s1))
    # no scale (every other variant) and no norms (a toy task): neither family of keys
    out = Diagnostics(every=1).observe(ctx, {"step": 1})
    assert not any(k.startswith(("diag/stp_", "diag/norm_over_clip")) for k in out)
