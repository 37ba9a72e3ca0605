"""The engine watch checks the logical batch's outliers, its longest and shortest example, besides random ones
(``engine/watch.py``, issue 56): a bug that depends on the lengths in a batch (a fold layout kept from a batch of
equal lengths) shows on the batch that has them, and random examples from the population rarely assemble one. A
periodic check waits for the step's batch and runs before its release; the outliers take no generator draws, so a
resumed run draws the random examples an uninterrupted one does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.watch import EngineCheckFailed, EngineWatch
from dp_adam_bench.errors import ConfigError

N = 200
LENGTHS = torch.arange(N) % 17  # each example's size, by its dataset index


def _watch(calls, every=1, sizes=True, fail_on=None):
    """A watch over examples 0..N-1 whose check records its examples (and fails on ``fail_on`` among them)."""

    def check(idx, generator, reason):
        calls.append((reason, idx.tolist()))
        if fail_on is not None and fail_on in idx.tolist():
            raise ConfigError(
                f"engine self-check: example {fail_on} off, stopped before any noise was released"
            )
        return {"max_rel_error": 0.0, "unverified": []}

    return EngineWatch(
        check,
        torch.arange(N),
        3,
        seed=5,
        settings={"every": every},
        sizes=(lambda i: LENGTHS[i]) if sizes else None,
    )


def _batch(seed, b=12):
    return torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:b]


def _extremes(batch):
    return {int(batch[LENGTHS[batch].argmax()]), int(batch[LENGTHS[batch].argmin()])}


def test_a_check_takes_the_noted_batchs_longest_and_shortest():
    calls = []
    watch, twin = _watch(calls), _watch([])
    batch = _batch(0)
    watch.note_batch(batch)
    watch.check(3, "checkpoint")
    ((reason, examples),) = calls
    random = twin.choose().tolist()
    assert examples[:3] == random  # the random draws first, as without a batch
    assert set(examples[3:]) == _extremes(batch) - set(random) and len(examples) == len(set(examples))
    assert LENGTHS[examples].max() == LENGTHS[batch].max() and LENGTHS[examples].min() <= LENGTHS[batch].min()


def test_the_outliers_draw_nothing_from_the_generator():
    """The same random examples, check after check, whether batches are noted or not: a resume (which restores the
    generator, not the last batch) draws what an uninterrupted run draws."""
    noted, plain = [], []
    a, b = _watch(noted), _watch(plain, sizes=False)
    for step in range(1, 6):
        a.note_batch(_batch(step))
        b.note_batch(_batch(step))  # without sizes: random examples only
        a.check(step, "checkpoint")
        b.check(step, "checkpoint")
    assert [e[:3] for _, e in noted] == [e for _, e in plain]
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    restored = _watch([])
    restored.load_state_dict(a.state_dict())
    assert restored.choose().tolist() == a.choose().tolist()


def test_a_periodic_check_waits_for_the_steps_batch_and_is_not_training_time():
    """As session.step drives it: before_step, the batch drawn and noted, the release, after_step. The check due at
    each step runs when the batch is noted, on its outliers; its time is not counted as training."""
    calls = []
    watch = _watch(calls)
    watch.check(0, "start")
    for step in range(0, 4):
        watch.before_step(step)
        made = len(calls)
        batch = _batch(10 + step)
        watch.note_batch(batch)
        if step:  # every = 1: a periodic check at every step but the first (the start's)
            assert len(calls) == made + 1 and calls[-1][0] == "periodic"
            assert _extremes(batch) <= set(calls[-1][1])
        watch.after_step(step + 1, watch.in_step + 0.25)
    assert watch.trained == pytest.approx(4 * 0.25)
    assert [c["step"] for c in watch.checks] == [0, 1, 2, 3]


def test_without_batches_noted_a_periodic_check_runs_before_the_step():
    calls = []
    watch = _watch(calls)
    watch.check(0, "start")
    watch.after_step(1, 0.1)
    watch.before_step(1)
    assert [r for r, _ in calls] == ["start", "periodic"] and len(calls[-1][1]) == 3


def test_a_failure_on_the_batchs_outlier_stops_the_step_before_its_release():
    batch = _batch(3)
    longest = int(batch[LENGTHS[batch].argmax()])
    calls = []
    watch = _watch(calls, fail_on=longest)
    watch.check(0, "start")
    watch.note_batch(_batch(2))  # the session notes its batches
    watch.after_step(1, 0.1)
    watch.before_step(1)
    assert [r for r, _ in calls] == ["start"]  # the due check waits for the step's batch
    with pytest.raises(
        EngineCheckFailed, match=r"engine check at step 1 \(periodic, .*before the release of step 2"
    ):
        watch.note_batch(batch)


# ------------------------------------------------------------------------------------- sizes of a task's examples


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        m = attention_mask[..., None].float()
        return self.head((self.emb(input_ids) * m).sum(1) / m.sum(1))


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def test_example_sizes_count_the_attention_mask_or_the_nonzero_entries():
    import dp_adam_bench as dab

    g = torch.Generator().manual_seed(0)
    lengths = [3, 8, 1, 5, 8, 2, 6, 4] * 4
    data = []
    for n in lengths:
        mask = (torch.arange(8) < n).long()
        data.append(
            {
                "input_ids": torch.randint(1, 11, (8,), generator=g) * mask,
                "attention_mask": mask,
                "labels": n % 3,
            }
        )
    private = dab.make_private(_Tagger(), data, _ce, sigma=1.0, batch_size=8, steps=1, self_check=False)
    idx = torch.tensor([0, 1, 2, 9])
    assert private.backend.example_sizes(idx).tolist() == [3, 8, 1, 8]
    private.close()

    x = torch.zeros(6, 5)  # (input, target) pairs: the non-zero entries of the input and the target
    for i, n in enumerate([1, 4, 2, 5, 0, 3]):
        x[i, :n] = 1.0
    pairs = torch.utils.data.TensorDataset(x, torch.zeros(6, dtype=torch.long))
    private = dab.make_private(
        nn.Linear(5, 2), pairs, _ce, sigma=1.0, batch_size=2, steps=1, self_check=False
    )
    assert private.backend.example_sizes(torch.tensor([0, 1, 3, 4])).tolist() == [1, 4, 5, 0]
    private.close()


def test_make_private_checks_each_batchs_longest_and_shortest_before_its_release(monkeypatch):
    """The user's path with a check at every step: each step after the first draws its batch after a periodic
    check whose examples include that batch's longest and shortest (by its attention mask), before its release."""
    import dp_adam_bench as dab
    from dp_adam_bench.engine.backends import ModelBackend

    events = []
    engine_check = ModelBackend.engine_check

    def checked(self, examples, *args, **kwargs):
        events.append(("check", examples.clone()))
        return engine_check(self, examples, *args, **kwargs)

    monkeypatch.setattr(ModelBackend, "engine_check", checked)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 9, (64,), generator=g)
    data = []
    for n in lengths.tolist():
        mask = (torch.arange(8) < n).long()
        data.append(
            {"input_ids": torch.randint(1, 11, (8,), generator=g) * mask, "attention_mask": mask, "labels": 0}
        )
    private = dab.make_private(_Tagger(), data, _ce, sigma=1.0, batch_size=8, steps=4, engine_watch_every=1)
    observe = private.participation.observe

    def observed(idx):  # the step's batch, recorded as the session counts it (before its release)
        events.append(("batch", private.run.population[idx].clone()))
        return observe(idx)

    private.participation.observe = observed
    while not private.done:
        private.step()
    private.close()
    steps = [k for k, (kind, _) in enumerate(events) if kind == "batch"]
    assert len(steps) == 4
    for k in steps[1:]:
        (kind, examples), batch = events[k - 1], events[k][1]
        assert kind == "check", "a periodic check on the step's batch, before it is counted and released"
        if len(batch):
            mine = lengths[examples[torch.isin(examples, batch)]]
            assert int(mine.max()) == int(lengths[batch].max()) and int(mine.min()) == int(
                lengths[batch].min()
            )
