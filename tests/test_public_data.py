"""Issue 56, "public data only when the user gives it": side information's public examples come from the user's
``public_dataset`` through make_private and DPTrainer, never from the private data; the sampler and the accountant
see the private data alone (N = its size); a public set that shares examples with the private data, by content, is
refused naming how many (engine/public_data.py). The command line's held-out split keeps its index check, and a
content check where the task gives its examples' content."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import dp_adam_bench as dab
from dp_adam_bench.engine.public_data import example_digest
from dp_adam_bench.errors import ConfigError, PrivacyMismatch

CE = nn.CrossEntropyLoss(reduction="none")
#: the issue's first reproduction: N = 2,000 private examples through make_private, with side_info
N, M = 2000, 1000
KW = dict(optimizer="side_info", sigma=1.0, clip=1.0, batch_size=32, steps=3, lr=0.01)


def pairs(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


# --- the digest of an example ---------------------------------------------------------------------------------------
def test_an_examples_digest_sees_values_dtype_shape_and_structure_not_key_order():
    x = torch.arange(6, dtype=torch.float32)
    same = [
        ({"a": x, "b": 1}, {"b": 1, "a": x.clone()}),  # dict key order
        ({"ids": [3, 4, 5]}, {"ids": torch.tensor([3, 4, 5])}),  # a list of ints is the int64 tensor
        ((x, 2), (x.clone(), 2)),
        ([[1.5, 2.0]], np.array([[1.5, 2.0]])),  # nested floats: float64
        (x[::2], x[::2].contiguous()),  # a strided view: its values
    ]
    for a, b in same:
        assert example_digest(a) == example_digest(b), (a, b)
    different = [
        (x, x.double()),  # dtype
        (x, x.view(torch.int32)),  # the same bytes read as another dtype
        (x, x.view(2, 3)),  # shape
        (x, x + torch.tensor([0, 0, 0, 0, 0, 1e-6])),  # one value, by one ulp-ish step
        ((x, 1), (1, x)),  # order of a pair
        ({"a": x}, {"b": x}),  # key name
        ({"ids": [3, 4, 5]}, {"ids": torch.tensor([3, 4, 5], dtype=torch.int32)}),  # int32 against int64
        ({"ids": [1, 2]}, {"ids": [1, 2], "idx": 0}),  # an extra field
        ("ab", ["a", "b"]),
        (torch.tensor([]), torch.tensor([[]])),
        (True, 1),  # bool against int
    ]
    for a, b in different:
        assert example_digest(a) != example_digest(b), (a, b)
    with pytest.raises(TypeError, match="cannot hash a object"):
        example_digest({"x": object()})


# --- make_private: the N = 2,000 --------------------------------------------------------------------------
def test_side_info_without_a_public_set_is_refused_in_one_line():
    """The issue's reproduction: side_info on 2,000 private examples used to hold 1,000 of them out as "public"
    (unclipped, un-noised, unaccounted). Now it needs public_dataset."""
    model = net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ConfigError, match=r"^public_dataset=None with optimizer='side_info'.*pass public_dataset="
    ) as e:
        dab.make_private(model, pairs(N, 0), CE, **KW)
    one_line(e)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_public_set_for_a_variant_that_reads_none_is_refused():
    """Refused, not ignored: a user who passes public data believes it shapes the update."""
    with pytest.raises(
        ConfigError,
        match=r"^public_dataset has 10 examples, but optimizer='adam' reads no public .*side_info",
    ) as e:
        dab.make_private(net(), pairs(64, 0), CE, public_dataset=pairs(10, 1), **dict(KW, optimizer="adam"))
    one_line(e)


def test_a_public_set_of_another_form_is_refused():
    rows = [{"x": torch.randn(6), "labels": torch.tensor(0)} for _ in range(4)]
    with pytest.raises(
        ConfigError,
        match=r"public_dataset item 0 is not like dataset's items \(dicts with the keys x, labels\)",
    ):
        dab.make_private(net(), rows * 16, CE, public_dataset=pairs(4, 1), **dict(KW, batch_size=8))
    with pytest.raises(ConfigError, match=r"public_dataset is empty"):
        dab.make_private(net(), pairs(64, 0), CE, public_dataset=[], **KW)


def test_a_disjoint_public_set_trains_and_the_accountant_counts_the_private_set_alone():
    """N = 2,000 private and 1,000 public: the sampler's population, the participation ledger and the ledger's q are
    the private set's (q = B / 2,000); epsilon is DP-SGD's at that q (dab.epsilons, the accountant alone); every
    private batch holds private indices only and every public batch public ones."""
    private_set, public_set = pairs(N, 0), pairs(M, 1)
    private = dab.make_private(net(), private_set, CE, public_dataset=public_set, **KW)
    seen = []
    real = private.run.task.get_batch
    private.run.task.get_batch = lambda idx: seen.append(idx.clone()) or real(idx)
    while not private.done:
        private.step()
    assert private.plan.sampler.n == N and torch.equal(private.run.population, torch.arange(N))
    assert torch.equal(private.run.public, torch.arange(N, N + M))
    assert private.participation.n == N
    (event,) = private.ledger.to_dict()["events"]
    assert event["q"] == 32 / N and event["count"] == 3
    assert private.epsilon("rdp") == pytest.approx(dab.epsilons(1.0, 32 / N, 3, 1e-5)["rdp"], rel=1e-12)
    assert private.plan.describe()["population"] == N
    public_batches = [b for b in seen if bool((b >= N).any())]
    assert public_batches and all(bool((b >= N).all() and (b < N + M).all()) for b in public_batches)
    assert any(
        bool((b < N).all()) for b in seen
    )  # the private batches (and the engine's checks) read private ones


def test_side_information_is_the_mean_gradient_of_the_users_public_examples():
    """Oracle: each public batch's gradient (ctx.side) is plain autograd's mean gradient over the examples of
    public_dataset at the drawn positions, at the weights of that step: the public examples come from the user's
    set, not from the private data."""
    private_set, public_set = pairs(256, 0), pairs(300, 1)
    model = net()
    private = dab.make_private(
        model, private_set, CE, public_dataset=public_set, **dict(KW, batch_size=16), self_check=False
    )
    reference = net()
    names = [n for n, _ in reference.named_parameters()]
    seen, real = [], private.backend.public_grad

    def spy(pick):
        weights = {n: p.detach().clone() for n, p in zip(names, model.parameters(), strict=True)}
        grads = real(pick)
        seen.append((pick.clone(), weights, [g.detach().clone() for g in grads]))
        return grads

    private.backend.public_grad = spy
    while not private.done:
        private.step()
    assert len(seen) >= 3
    x, y = public_set.tensors
    for pick, weights, grads in seen:
        assert bool((pick >= 256).all())
        rows = pick - 256
        params = {n: w.requires_grad_(True) for n, w in weights.items()}
        loss = CE(torch.func.functional_call(reference, params, (x[rows],)), y[rows]).mean()
        want = torch.autograd.grad(loss, list(params.values()))
        # float32 means of 256 per-example terms summed in another order: relative error <= 256 eps (3e-5)
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g, w.to(g.device), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("how", ["copies", "reordered", "all"])
def test_a_public_set_sharing_examples_with_the_private_data_is_refused_naming_how_many(how):
    """Copies of private examples, in other positions and another order (as a user's public set would hold them),
    are found by content; the whole private set shuffled is all overlap."""
    private_set, fresh = pairs(N, 0), pairs(M, 1)
    x, y = private_set.tensors
    g = torch.Generator().manual_seed(7)
    if how == "all":
        perm = torch.randperm(N, generator=g)
        public, shared = torch.utils.data.TensorDataset(x[perm], y[perm]), N
    else:
        take = torch.tensor([4, 999, 1500]) if how == "copies" else torch.randperm(N, generator=g)[:25]
        px, py = (
            torch.cat([fresh.tensors[0], x[take].clone()]),
            torch.cat([fresh.tensors[1], y[take].clone()]),
        )
        order = torch.randperm(len(px), generator=g) if how == "reordered" else torch.arange(len(px))
        public, shared = torch.utils.data.TensorDataset(px[order], py[order]), len(take)
    with pytest.raises(
        PrivacyMismatch,
        match=rf"^public_dataset: {shared} of its {len(public)} examples have the same content",
    ) as e:
        dab.make_private(net(), private_set, CE, public_dataset=public, **KW)
    one_line(e)


def test_a_data_set_whose_items_are_random_is_warned_and_example_content_identifies_it():
    """A data set that augments in [i] gives another content on each read: the check cannot match it, and says so;
    its example_content(i) is what the check then compares (here, the un-augmented copy of a private example)."""
    base = pairs(64, 0)

    class Augmented(torch.utils.data.Dataset):
        def __init__(self, data, rows=None):
            self.data, self.rows = data, rows

        def __len__(self):
            return len(self.rows) if self.rows is not None else len(self.data)

        def __getitem__(self, i):
            x, y = self.data[self.rows[i] if self.rows is not None else i]
            return x + 0.01 * torch.randn(6), y

    public = Augmented(base, rows=[3, 5])
    with pytest.warns(UserWarning, match="another content on a second read"):
        dab.make_private(net(), Augmented(base), CE, public_dataset=public, **dict(KW, batch_size=8))
    Augmented.example_content = lambda self, i: self.data[self.rows[i] if self.rows is not None else i]
    with pytest.raises(PrivacyMismatch, match="public_dataset: 2 of its 2 examples"):
        dab.make_private(net(), Augmented(base), CE, public_dataset=public, **dict(KW, batch_size=8))


# --- DPTrainer: the 1,500 -----------------------------------------------------------------------------------
def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 50, rng.integers(4, 12)).tolist()} for _ in range(n)]


def _trainer(tmp_path, rows, public=None, **privacy):
    import transformers

    from dp_adam_bench.hf_trainer import DPTrainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, gradient_accumulation_steps=1,
        max_steps=2, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0,
    )  # fmt: skip
    # eps 1e-2: side information divides by the public gradient's root second moment alone (Alg. 9), and the rows of
    # wpe for positions only padding reaches have none: at eps 1e-8 one noisy step moves them by ~1e5, weights whose
    # degenerate gradients bk's fold probe cannot place
    privacy = {
        "optimizer": "side_info", "sigma": 1.0, "self_check": False, "engine_watch_every": "0",
        "optimizer_args": {"eps": 1e-2},
    } | privacy  # fmt: skip
    return DPTrainer(model=_gpt2(), args=args, train_dataset=rows, public_dataset=public, privacy=privacy)


def test_dptrainer_side_info_needs_a_public_set(tmp_path):
    """The issue's second reproduction: 1,500 examples, of which 1,000 used to be held out as public. Refused at
    construction, before anything trains."""
    with pytest.raises(ConfigError, match=r"^public_dataset=None with optimizer='side_info'") as e:
        _trainer(tmp_path, _rows(1500, 0))
    one_line(e)
    with pytest.raises(ConfigError, match=r"^public_dataset has 4 examples, but optimizer='adamw'"):
        _trainer(tmp_path, _rows(1500, 0), public=_rows(4, 1), optimizer="adamw")


def test_dptrainer_trains_on_a_disjoint_public_set_and_accounts_the_training_set(tmp_path, monkeypatch):
    """With 1,000 public rows: N = 1,500 for the sampler and the accountant (epsilon at q = 8 / 1,500), and every
    public batch holds rows of public_dataset, padded as the training rows are."""
    from dp_adam_bench.engine.backends import ModelBackend

    rows, public = _rows(1500, 0), _rows(1000, 1)
    picks, real = [], ModelBackend.public_grad

    def spy(self, pick):
        batch = self.task.get_batch(pick)
        picks.append((pick.clone(), batch["input_ids"], batch["attention_mask"]))
        return real(self, pick)

    monkeypatch.setattr(ModelBackend, "public_grad", spy)
    trainer = _trainer(tmp_path, rows, public)
    trainer.train()
    private = trainer.private
    assert private.plan.sampler.n == 1500 and len(private.run.population) == 1500
    assert private.epsilon("rdp") == pytest.approx(dab.epsilons(1.0, 8 / 1500, 2, 1e-5)["rdp"], rel=1e-12)
    assert picks
    for pick, ids, mask in picks:
        assert bool((pick >= 1500).all())
        for j, row_ids, row_mask in zip((pick - 1500).tolist(), ids, mask, strict=True):
            n = len(public[j]["input_ids"])
            assert row_ids[:n].tolist() == public[j]["input_ids"] and int(row_mask.sum()) == n


def test_dptrainer_refuses_a_public_set_holding_training_rows(tmp_path):
    """Three training rows among 100 public ones, in other positions, as lists in dicts with another key order: the
    same content, found before any step."""
    rows = _rows(1500, 0)
    public = _rows(100, 1)
    for at, i in ((0, 1499), (50, 3), (99, 700)):
        public.insert(at, {"input_ids": list(rows[i]["input_ids"])})
    trainer = _trainer(tmp_path, rows, public)
    with pytest.raises(
        PrivacyMismatch, match=r"^public_dataset: 3 of its 103 examples have the same content"
    ) as e:
        trainer.train()
    one_line(e)
    assert trainer.state.global_step == 0


# --- the command line: its held-out split ----------------------------------------------------------------------------
@pytest.fixture
def tiny(monkeypatch):
    from dp_adam_bench.tasks import registry

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def _cli_run(*extra: str):
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.engine.session import PrivateTraining

    from helpers import compose_cfg, tiny_poisson

    cfg = compose_cfg(
        tiny_poisson(
            "public",
            2,
            "optimizer=side_info",
            "train.side_info.public_examples=10",
            "train.device=cpu",
            *extra,
        )
    )
    run = trainer.build(cfg)
    try:
        return PrivateTraining(run)
    finally:
        run.backend.close()


def test_the_clis_held_out_split_is_checked_by_index(tiny, monkeypatch):
    """A split that leaks private indices into the public side information (planted) is refused before any step."""
    from dp_adam_bench.engine import trainer

    real = trainer.split_public

    def leaky(cfg, n, seed, needed):
        private, public = real(cfg, n, seed, needed)
        return private, (None if public is None else torch.cat([public, private[:3]]))

    monkeypatch.setattr(trainer, "split_public", leaky)
    with pytest.raises(PrivacyMismatch, match=r"3 example\(s\) are both in the public side-information set"):
        _cli_run()


def test_the_clis_held_out_split_is_checked_by_content_where_the_task_gives_it(tiny, monkeypatch):
    """A task that gives its examples' content (example_content) has its held-out public examples compared with
    its private ones by content: a duplicated record on both sides of the split is refused; the same task without
    duplicates runs, and the note says the examples were held out of the training set."""
    from dp_adam_bench.engine.trainer import split_public
    from dp_adam_bench.tasks import registry

    from helpers import compose_cfg, tiny_poisson
    from tiny_task import TinyTask

    class WithContent(TinyTask):
        def example_content(self, i):
            return {"x": self.x[i], "y": self.y[i]}

    class Duplicated(WithContent):
        def __init__(self, cfg, *, trials, seed):
            super().__init__(cfg, trials=trials, seed=seed)
            private, public = split_public(
                compose_cfg(tiny_poisson("p", 2, "train.side_info.public_examples=10")), self.n, 0, True
            )
            self.x[public[:2]] = self.x[private[[0, 7]]]  # two private records duplicated in the public share
            self.y[public[:2]] = self.y[private[[0, 7]]]

    monkeypatch.setitem(registry.TASKS, "tiny", WithContent)
    session = _cli_run()
    assert len(session.run.population) == 54 and len(session.run.public) == 10
    monkeypatch.setitem(registry.TASKS, "tiny", Duplicated)
    with pytest.raises(
        PrivacyMismatch, match=r"the public side-information set: 2 of its 10 examples have the same content"
    ):
        _cli_run()


def test_the_check_reads_no_more_than_every_example_twice(tiny, monkeypatch):
    """Its cost: one read of each private and public example, plus two of one example of each set (the
    repeatability probe)."""
    from dp_adam_bench.api import UserTask

    counts = {"n": 0}
    real = UserTask.example_content

    def counting(self, i):
        counts["n"] += 1
        return real(self, i)

    monkeypatch.setattr(UserTask, "example_content", counting)
    dab.make_private(net(), pairs(300, 0), CE, public_dataset=pairs(40, 1), **dict(KW, batch_size=16))
    assert counts["n"] == 300 + 40 + 4
