"""The model-task training loop: Poisson accounting, resume bit-identical after a kill, refusals, budget,
diagnostics."""

import json

import pytest
import torch

from dp_adam_bench.engine.checkpoint import FILENAME, CheckpointError
from dp_adam_bench.tasks import registry
from dp_adam_bench.tracking.run_store import read_metrics
from dp_adam_bench.train import train

from helpers import ON_CPU, compose_cfg, tiny_poisson


@pytest.fixture(autouse=True)
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


BASE = tiny_poisson("eng", 8, "train.log_every=1")


def folder_of(root):
    (f,) = [p for p in (root / "runs" / "eng").iterdir() if p.is_dir()]
    return f


def test_poisson_run_is_accounted_per_step(isolated_dirs):
    s = train(compose_cfg(BASE))
    assert s["steps"] == 8 and s["sampler"] == "poisson" and s["clipping"] == "bk"
    ledger = s["ledger"]
    assert ledger["events"][0]["count"] == 8 and ledger["events"][0]["kind"] == "poisson_gaussian"
    assert s["epsilon"]["rdp"] > s["epsilon"]["pld"] > 0
    assert s["privacy_notes"] == []


@pytest.mark.parametrize("variant", ["adam", "bc", "stp"])
def test_resume_after_kill_is_bit_identical(isolated_dirs, variant):
    extra = [
        f"optimizer={variant}",
        "train.checkpoint_every=2",
        ON_CPU,
    ]  # bit-identical resume: a CPU promise
    if variant == "stp":
        extra.append("train.clipping=functorch")
    full = train(compose_cfg([*BASE, *extra, "experiment_name=full"]))
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*BASE, *extra, "train.stop_after=5"]))
    folder = folder_of(isolated_dirs)
    assert not (folder / "summary.json").exists() and (folder / FILENAME).exists()
    resumed = train(compose_cfg([*BASE, *extra]))  # relaunch: resumes from the step-4 checkpoint
    assert resumed["final_params_sha1"] == full["final_params_sha1"]
    assert resumed["ledger"] == full["ledger"]
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_corrupt_checkpoint_is_refused_not_restarted(isolated_dirs):
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*BASE, "train.checkpoint_every=2", "train.stop_after=3"]))
    folder = folder_of(isolated_dirs)
    (folder / FILENAME).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or unreadable.*delete it"):
        train(compose_cfg([*BASE, "train.checkpoint_every=2"]))


def test_checkpoint_of_another_config_is_refused(isolated_dirs):
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*BASE, "train.checkpoint_every=2", "train.stop_after=3"]))
    folder = folder_of(isolated_dirs)
    payload = torch.load(folder / FILENAME, weights_only=False)
    payload["fingerprint"] = "0" * 40
    torch.save(payload, folder / FILENAME)
    with pytest.raises(CheckpointError, match="different configuration"):
        train(compose_cfg([*BASE, "train.checkpoint_every=2"]))


def test_stp_with_ghost_clipping_fails_clearly(isolated_dirs):
    with pytest.raises(ValueError, match="train.clipping=ghost cannot compute; set train.clipping=bk, hooks"):
        train(compose_cfg([*BASE, "optimizer=stp", "train.clipping=ghost"]))


def test_epsilon_budget_stops_before_the_step_that_would_exceed_it(isolated_dirs):
    from dp_adam_bench.privacy.accounting import epsilon

    budget = epsilon(1.0, 16 / 64, 5, 1e-5, "rdp") + 1e-6
    s = train(compose_cfg([*BASE, f"privacy.epsilon_budget={budget}"]))
    assert s["steps"] == 5 and s["stopped_by_budget"]
    assert s["epsilon"]["rdp"] <= budget
    assert any("privacy.epsilon_budget" in n for n in s["privacy_notes"])


def test_diagnostics_are_logged_under_diag_and_saved(isolated_dirs):
    train(compose_cfg([*BASE, "diagnostics.every=4", "optimizer=adambc"]))
    folder = folder_of(isolated_dirs)
    rows = read_metrics(folder)  # metrics.jsonl with private_diagnostics.jsonl merged back by step
    diag = [r for r in rows if "diag/frac_negative_after_bc" in r]
    assert [r["step"] for r in diag] == [4, 8]
    r = diag[-1]
    assert r["diag/phi"] == pytest.approx((1.0 * 0.5 / 16) ** 2)
    assert r["diag/v_clean_min"] <= r["diag/v_clean_median"] <= r["diag/v_clean_max"]
    assert 0 <= r["diag/frac_negative_after_bc"] <= 1
    assert all(not k.startswith(("v_", "m_")) for k in r)  # nothing clean outside the diag/ namespace
    hist = __import__("numpy").load(folder / "diagnostics" / "step_8.npz")
    assert {"m_clean", "v_private_minus_phi", "update_corrected_v"} <= set(hist.files)


def test_stp_diagnostics_follow_its_clip_and_scale(isolated_dirs):
    """A scale-then-privatize run logs its scaled per-example norms against C (consistent with the fraction
    clipped the trainer logs on the same step) and its scale's spread, bounded by 1 / eps_s1."""
    train(compose_cfg([*BASE, "diagnostics.every=4", "optimizer=stp", "optimizer.eps_s1=1e-3"]))
    rows = read_metrics(folder_of(isolated_dirs))
    diag = [r for r in rows if "diag/stp_scale_max" in r]
    assert [r["step"] for r in diag] == [4, 8]
    for r in diag:
        assert 0 < r["diag/stp_scale_min"] <= r["diag/stp_scale_median"] <= r["diag/stp_scale_max"] <= 1e3
        assert 0 <= r["diag/stp_frac_sqrtv_above_eps_s1"] <= 1
        assert r["diag/norm_over_clip_median"] <= r["diag/norm_over_clip_q90"] <= r["diag/norm_over_clip_max"]
        assert (r["diag/frac_clipped"] > 0) == (r["diag/norm_over_clip_max"] > 1)


def test_nonprivate_model_run_matches_plain_torch_adam(isolated_dirs):
    # sigma = 0 and no clipping through the whole trainer = torch.optim.Adam on the mean loss of the same batches
    from dp_adam_bench.engine.sampling import SinglePassSampler

    from tiny_task import TinyTask

    s = train(
        compose_cfg(
            [
                *BASE,
                "noise=none",
                "train.sampler=single_pass",
                "train.steps=null",
                "train.epochs=2",
                "train.clipping=hooks",
            ]
        )
    )
    from dp_adam_bench.engine.trainer import resolve_device

    task = TinyTask({"n": 64}, trials=1, seed=0)
    torch.manual_seed(0)
    device = resolve_device("auto")  # where the trainer ran the model: the reference runs there too
    model = task.build_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    for idx in SinglePassSampler(64, 16, epochs=2, seed=0):
        opt.zero_grad()
        batch = {k: v.to(device) for k, v in task.get_batch(idx).items()}
        task.loss_per_example(model, batch).mean().backward()
        opt.step()
    ref = task.evaluate(model)
    assert s["metrics"]["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-5)


def test_side_information_uses_only_held_out_public_examples(isolated_dirs, monkeypatch):
    from dp_adam_bench.engine.trainer import split_public

    from helpers import compose_cfg as cc
    from tiny_task import TinyTask

    seen = []
    original = TinyTask.get_batch

    def recording(self, indices):
        seen.append(indices.clone())
        return original(self, indices)

    monkeypatch.setattr(TinyTask, "get_batch", recording)
    overrides = [
        *BASE,
        "optimizer=side_info",
        "train.side_info.public_examples=10",
        "train.side_info.batch_size=4",
    ]
    s = train(cc(overrides))
    private, public = split_public(cc(overrides), 64, 0, True)
    assert len(public) == 10 and len(private) == 54
    batches = [set(b.tolist()) for b in seen]
    public_batches = [b for b in batches if len(b) <= 4 and b <= set(public.tolist())]
    assert len(public_batches) >= 8  # one public batch per step
    private_batches = [b for b in batches if b not in public_batches]
    assert all(not (b & set(public.tolist())) for b in private_batches)
    assert any("held out as public" in n for n in s["privacy_notes"])


def test_bad_public_split_is_refused(isolated_dirs):
    with pytest.raises(ValueError, match=r"public_examples=64 must be in \(0, 64\)"):
        train(compose_cfg([*BASE, "optimizer=side_info", "train.side_info.public_examples=64"]))


def test_ime_free_model_run_accounts_sigma_over_sqrt2(isolated_dirs):
    s = train(
        compose_cfg(
            [*BASE, "optimizer=ime_free", "train.sampler=single_pass", "train.steps=null", "train.epochs=1"]
        )
    )
    (event,) = s["ledger"]["events"]
    assert event["mu"] == pytest.approx(2**0.5 / 1.0)


def test_sigma_null_is_calibrated_to_the_target_epsilon(isolated_dirs):
    from dp_adam_bench.privacy.accounting import calibrate_sigma

    s = train(
        compose_cfg([*BASE, "privacy.sigma=null", "privacy.target_epsilon=3.0", "privacy.accountant=rdp"])
    )
    n = 64  # TinyTask's training set
    want = calibrate_sigma(3.0, 1e-5, 16 / n, 8, "rdp")
    assert s["sigma"] == pytest.approx(want)
    assert 2.97 <= s["epsilon"]["rdp"] <= 3.0


def test_sigma_null_without_a_target_is_refused(isolated_dirs):
    with pytest.raises(ValueError, match="privacy.sigma=null .* needs privacy.target_epsilon"):
        train(compose_cfg([*BASE, "privacy.sigma=null"]))


def test_eval_at_start_logs_the_untrained_model_as_step_0(isolated_dirs):
    train(compose_cfg([*BASE, "train.eval_at_start=true"]))
    rows = [json.loads(x) for x in (folder_of(isolated_dirs) / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "test_loss" in rows[0]


def test_model_runs_give_freed_host_memory_back_every_few_steps(isolated_dirs, monkeypatch):
    # Poisson batches of varying size fragment glibc's heap (docs/pitfalls.md): the loop trims it every TRIM_EVERY
    from dp_adam_bench.engine import memory

    calls = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(memory, "TRIM_EVERY", 3)
    train(compose_cfg(tiny_poisson("trim", 10, ON_CPU)))  # the host heap is trimmed on CPU runs only
    assert len(calls) == 3  # steps 3, 6, 9


def test_malloc_trim_is_found_on_glibc():
    import platform

    from dp_adam_bench.engine import memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is a glibc function")
    assert memory.release_free_memory() is True
