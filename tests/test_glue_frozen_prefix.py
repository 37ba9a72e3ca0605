"""The GLUE task on cached frozen layers (task.cache_frozen_prefix, dp_adam_bench/tasks/frozen_prefix.py) and its
public tuning split (task.public_split / public_val / tune), on the tiny fixtures of tests/test_glue_task.py.

Oracles: the full model (every layer run, the lower ones frozen) for the logits and for the per-example gradients of
the trained top, through the loop over batches of size one; the full masked-LM's logits and decoder rows for the
label words; bk against that loop on the cached models; the training file's own rows for the public split."""

import numpy as np
import pytest
import torch
from test_glue_task import SST2_DEV, WORDS, _tsv, fixtures, glue_cfg, roberta  # noqa: F401 (fixtures)

from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.tasks import frozen_prefix
from dp_adam_bench.tasks.glue import GlueTask, LabelWordScores, MeanPooledClassifier, public_rows

from helpers import compose_cfg, two_private_steps

torch.set_num_threads(1)

LAYERS = 2  # tiny_bert_config's


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def big_data(tmp_path_factory, fixtures):  # noqa: F811
    """An SST-2 folder with 40 training sentences (distinct, of varied length) and the fixture's dev."""
    folder = tmp_path_factory.mktemp("glue_big") / "sst2"
    folder.mkdir()
    rng = np.random.default_rng(7)
    sentences: list[str] = []
    while len(sentences) < 40:  # distinct sentences of 2 to 7 words
        s = " ".join(rng.choice(WORDS, size=2 + len(sentences) % 6))
        if s not in sentences:
            sentences.append(s)
    rows = [(str(i % 2), s) for i, s in enumerate(sentences)]
    _tsv(folder / "train.tsv.gz", ["label", "sentence"], rows)
    _tsv(folder / "dev.tsv.gz", ["label", "content"], SST2_DEV)
    return folder.parent, rows


def _top_names(k: int, pooling: str, objective: str = "classifier") -> tuple[str, ...]:
    """Prefixes of the full model's parameters that the cached top trains."""
    top = tuple(f"bert.encoder.layer.{i}." for i in range(LAYERS - k, LAYERS))
    if objective == "infilling":
        return (*top, "cls.")
    return (*top, "classifier.") if pooling == "mean" else (*top, "bert.pooler.", "classifier.")


def _freeze_below(model, keep: tuple[str, ...]) -> list[torch.nn.Parameter]:
    out = []
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(keep))
        if p.requires_grad:
            out.append(p)
    return out


def _loop_grads(model, task, batch):
    return build_engine("loop", model, task.loss_per_example).per_example_grads(batch)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_cached_top_is_the_full_model_with_its_lower_layers_frozen(fixtures, k, pooling):  # noqa: F811
    """Logits, losses, per-example gradients of every trained tensor and the dev scores of the top on cached
    features against the full model (dropout 0 in the fixture; eval mode), for 0, 1 and 2 trained blocks."""
    model_dir = str(fixtures / "mlm")
    full_task = GlueTask(glue_cfg(fixtures, model=model_dir, pooling=pooling), trials=1, seed=0)
    cached_task = GlueTask(
        glue_cfg(fixtures, model=model_dir, pooling=pooling, cache_frozen_prefix=True, trained_blocks=k),
        trials=1,
        seed=0,
    )
    torch.manual_seed(3)
    full = full_task.build_model()
    torch.manual_seed(3)  # the same random pooler and classifier
    top = cached_task.build_model()
    assert isinstance(full, MeanPooledClassifier if pooling == "mean" else torch.nn.Module)
    assert isinstance(top, frozen_prefix.TopBlocksClassifier) and len(top.layer) == k
    trained = _freeze_below(full, _top_names(k, pooling))
    assert [p.shape for p in trained] == [p.shape for p in top.parameters()]
    for a, b in zip(trained, top.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    idx = torch.tensor([0, 5, 2, 7, 3])
    x, y = full_task.get_batch(idx), cached_task.get_batch(idx)
    assert "input_ids" not in y and y["hidden_states"].shape[:2] == y["attention_mask"].shape
    full.eval(), top.eval()
    # float32 through 2 small layers: a few ulps of logits of size ~1
    torch.testing.assert_close(cached_task.logits(top, y), full_task.logits(full, x), rtol=1e-5, atol=1e-6)
    for r, g in zip(_loop_grads(full, full_task, x), _loop_grads(top, cached_task, y), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert cached_task.evaluate(top) == pytest.approx(full_task.evaluate(full), rel=1e-5)
    assert "cached outputs of the frozen layers" in cached_task.data_note


@pytest.mark.parametrize("k", [0, 1, 2])
def test_cached_infilling_reads_the_full_masked_lms_label_words(fixtures, k):  # noqa: F811
    """The top blocks and the masked-LM head cut to the label words' rows against the full masked LM: the same
    logits at the mask, and per example the same gradients of the top and of the label words' decoder rows (the
    other rows' gradients are exactly zero in the full model: nothing reads them)."""
    kw = dict(objective="infilling", model=str(fixtures / "mlm"))
    full_task = GlueTask(glue_cfg(fixtures, **kw), trials=1, seed=0)
    cached_task = GlueTask(
        glue_cfg(fixtures, **kw, cache_frozen_prefix=True, trained_blocks=k), trials=1, seed=0
    )
    full, top = full_task.build_model(), cached_task.build_model()
    assert isinstance(full, LabelWordScores) and isinstance(top, frozen_prefix.TopBlocksLabelWords)
    assert top.cls.predictions.decoder.weight.shape == (2, full.config.hidden_size)
    _freeze_below(full, _top_names(k, "", "infilling"))
    trained = [n for n, p in full.named_parameters() if p.requires_grad]
    words = full_task.word_ids
    idx = torch.tensor([1, 4, 6, 0])
    x, y = full_task.get_batch(idx), cached_task.get_batch(idx)
    torch.testing.assert_close(y["mask_position"], x["mask_position"], rtol=0, atol=0)
    full.eval(), top.eval()
    torch.testing.assert_close(cached_task.logits(top, y), full_task.logits(full, x), rtol=1e-5, atol=1e-6)
    ref = dict(zip(trained, _loop_grads(full, full_task, x), strict=True))
    got = dict(zip((n for n, _ in top.named_parameters()), _loop_grads(top, cached_task, y), strict=True))
    rename = {f"layer.{i}.": f"bert.encoder.layer.{LAYERS - k + i}." for i in range(k)}
    for name, g in got.items():
        full_name = next((name.replace(a, b, 1) for a, b in rename.items() if name.startswith(a)), name)
        r = ref.pop(full_name)
        if full_name.startswith("cls.predictions.decoder."):
            others = torch.ones(r.shape[1], dtype=torch.bool)
            others[words] = False
            assert float(r[:, others].abs().max()) == 0.0  # the rows no loss reads
            r = r[:, words]
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    assert not ref  # every trained tensor of the full model was compared


def test_the_label_word_decoder_needs_one_bias_and_keeps_the_rows_in_order(fixtures):  # noqa: F811
    from transformers import BertForMaskedLM

    from dp_adam_bench.tasks import text

    mlm = BertForMaskedLM.from_pretrained(fixtures / "mlm")
    with pytest.raises(
        ValueError, match="keeps a bias beside its decoder's: call text.prepare_bert_for_dp first"
    ):
        frozen_prefix.label_word_decoder(mlm.cls, [5, 3])
    text.prepare_bert_for_dp(mlm)
    full = mlm.cls.predictions.decoder
    w, b = full.weight.detach().clone(), full.bias.detach().clone()
    frozen_prefix.label_word_decoder(mlm.cls, [5, 3])
    dec = mlm.cls.predictions.decoder
    torch.testing.assert_close(dec.weight, w[[5, 3]], rtol=0, atol=0)
    torch.testing.assert_close(dec.bias, b[[5, 3]], rtol=0, atol=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(pooling="mean", trained_blocks=1),
        dict(pooling="cls", trained_blocks=2),
        dict(objective="infilling", trained_blocks=1),
        dict(pooling="mean", trained_blocks=0),
        dict(pooling="mean", trained_blocks=1, finetune="lora"),
    ],
    ids=["mean-top1", "cls-top2", "infilling-top1", "mean-head", "lora-top1"],
)
def test_bk_matches_the_loop_on_the_cached_top(fixtures, kw):  # noqa: F811
    from dp_adam_bench import finetune

    task = GlueTask(
        glue_cfg(fixtures, model=str(fixtures / "mlm"), cache_frozen_prefix=True, **kw), trials=1, seed=0
    )
    torch.manual_seed(0)
    args = {"dropout": 0.0} if kw.get("finetune") == "lora" else {}  # two engines draw two dropout masks
    model = finetune.apply(task.build_model(), kw.get("finetune"), args).model.train()
    with torch.no_grad():  # LoRA's B starts at 0: move it so that A's gradients are not all zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    batch = task.get_batch(torch.arange(8))
    ref = _loop_grads(model, task, batch)
    norms = torch.sqrt(sum(g.reshape(8, -1).pow(2).sum(1) for g in ref))
    clip = float(norms.median())
    f = clip_factors(norms, clip)
    eng = build_engine("bk", model, task.loss_per_example)
    try:
        out = eng.clipped_sum(batch, clip)
    finally:
        eng.close()
    torch.testing.assert_close(out.norms, norms, rtol=1e-4, atol=1e-6)
    for s, g in zip(out.summed, ref, strict=True):
        torch.testing.assert_close(s, torch.einsum("b,b...->...", f, g), rtol=1e-4, atol=2e-5)


def test_roberta_on_cached_layers_is_the_full_roberta(fixtures, roberta):  # noqa: F811
    """RoBERTa's own positions (padding_idx + 1 on) reach the cached layers: classifier (its head on <s>) and
    infilling give the full model's logits."""
    for objective in ("classifier", "infilling"):
        kw = dict(objective=objective, model=str(roberta))
        full_task = GlueTask(glue_cfg(fixtures, **kw), trials=1, seed=0)
        cached_task = GlueTask(glue_cfg(fixtures, **kw, cache_frozen_prefix=True), trials=1, seed=0)
        torch.manual_seed(1)
        full = full_task.build_model().eval()
        torch.manual_seed(1)
        top = cached_task.build_model().eval()
        idx = torch.arange(8)
        torch.testing.assert_close(
            cached_task.logits(top, cached_task.get_batch(idx)),
            full_task.logits(full, full_task.get_batch(idx)),
            rtol=1e-5,
            atol=1e-6,
        )


def test_features_are_read_back_and_keyed_by_the_layers_that_ran(fixtures, tmp_path, monkeypatch):  # noqa: F811
    def cfg(k):
        return glue_cfg(fixtures, model=str(fixtures / "mlm"), cache_frozen_prefix=True, trained_blocks=k)

    first = GlueTask(cfg(1), trials=1, seed=0)
    first.build_model()
    folder = tmp_path / "cache" / "glue_features"
    assert sorted(f.name.split("-")[0] for f in folder.glob("*.npz")) == ["test", "train"]

    def no_compute(*a, **k):
        raise AssertionError("features computed again instead of read from the cache")

    second = GlueTask(cfg(1), trials=1, seed=0)
    with monkeypatch.context() as m:
        m.setattr(frozen_prefix, "prefix_features", no_compute)
        second.build_model()
    np.testing.assert_array_equal(second.train_features.flat, first.train_features.flat)
    third = GlueTask(cfg(0), trials=1, seed=0)  # the same sentences through one more layer: another key
    third.build_model()
    assert len(list(folder.glob("train-*.npz"))) == 2
    assert not np.array_equal(third.train_features.flat, first.train_features.flat)


def test_the_public_split_is_outside_every_private_run_and_tuning_never_reads_dev(
    fixtures,  # noqa: F811
    big_data,
    monkeypatch,
    tmp_path,
):
    data, rows = big_data
    split = public_rows(40, 10, 4, seed=0)
    assert len(split.fit) == 6 and len(split.val) == 4 and len(split.private) == 30
    assert sorted(np.concatenate([split.fit, split.val, split.private]).tolist()) == list(range(40))
    again, other = public_rows(40, 10, 4, seed=0), public_rows(40, 10, 4, seed=1)
    np.testing.assert_array_equal(again.private, split.private)
    assert not np.array_equal(other.private, split.private)

    def rows_of(task_ids):  # the sentences a task holds, by their token ids
        return {tuple(task_ids[i].tolist()) for i in range(len(task_ids))}

    base = dict(model=str(fixtures / "mlm"), data_dir=str(data), public_split=10, public_val=4)
    private = GlueTask(glue_cfg(fixtures, **base), trials=1, seed=0)
    tune = GlueTask(glue_cfg(fixtures, **base, tune=True), trials=1, seed=0)
    whole = GlueTask(glue_cfg(fixtures, model=str(fixtures / "mlm"), data_dir=str(data)), trials=1, seed=0)
    assert (private.dataset_size, private.test_size) == (30, len(SST2_DEV))
    assert (tune.dataset_size, tune.test_size) == (6, 4)
    every = [tuple(whole.train_ids[i].tolist()) for i in range(40)]
    assert rows_of(private.train_ids) == {every[i] for i in split.private}
    assert rows_of(tune.train_ids) == {every[i] for i in split.fit}
    assert rows_of(tune.test_ids) == {every[i] for i in split.val}
    np.testing.assert_array_equal(tune.y_test.numpy(), np.asarray([int(rows[i][0]) for i in split.val]))
    assert "outside the 10-sentence public tuning split" in private.data_note
    assert "scored on 4 held-out training sentences (never dev)" in tune.data_note
    # a tuning run does not open the eval split at all: a folder without dev.tsv (and no shared data) will do
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "no_shared_data"))
    no_dev = data.parent / "no_dev"
    (no_dev / "sst2").mkdir(parents=True, exist_ok=True)
    (no_dev / "sst2" / "train.tsv.gz").write_bytes((data / "sst2" / "train.tsv.gz").read_bytes())
    GlueTask(
        glue_cfg(fixtures, **{**base, "data_dir": str(no_dev)}, tune=True, source="local"), trials=1, seed=0
    )
    with pytest.raises(FileNotFoundError, match="'dev' split"):
        GlueTask(glue_cfg(fixtures, **{**base, "data_dir": str(no_dev)}, source="local"), trials=1, seed=0)
    # train_subset draws among the private sentences only
    sub = GlueTask(glue_cfg(fixtures, **base, train_subset=12), trials=1, seed=0)
    assert sub.dataset_size == 12 and rows_of(sub.train_ids) <= {every[i] for i in split.private}


def test_bad_settings_are_one_line(fixtures, big_data):  # noqa: F811
    data, _ = big_data
    model = str(fixtures / "mlm")
    for kw, msg in (
        ({"trained_blocks": 1}, "task.trained_blocks=1 needs task.cache_frozen_prefix=true"),
        ({"cache_frozen_prefix": True, "trained_blocks": 3}, r"task.trained_blocks must be in \[0, 2\]"),
        ({"cache_frozen_prefix": True, "trained_blocks": 1.5}, "task.trained_blocks must be an integer"),
        ({"pooling": "max"}, "task.pooling='max'; valid: cls, mean"),
        (
            {"pooling": "mean", "objective": "infilling"},
            "task.pooling='mean' is for task.objective=classifier",
        ),
        ({"tune": True}, "task.tune=true trains on the public split: set task.public_split"),
        ({"public_split": 10, "public_val": 10}, r"task.public_val must be in \[1, 9\]"),
        ({"public_split": 40}, r"task.public_split must be in \[1, 39\]"),
        ({"public_split": 1}, "task.public_split must be >= 2"),
        (
            {"public_split": 10, "public_val": 4, "train_subset": 31},
            r"task.train_subset must be in \[1, 30\]",
        ),
    ):
        with pytest.raises(ValueError, match=msg) as err:
            GlueTask(glue_cfg(fixtures, model=model, data_dir=str(data), **kw), trials=1, seed=0)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["task.pooling=mean", "task.trained_blocks=1"],
        ["task.objective=infilling", "task.trained_blocks=1"],
        ["task.pooling=mean", "task.trained_blocks=1", "task.finetune=lora"],
        ["task.pooling=mean", "task.trained_blocks=0", "task.finetune=head"],
    ],
    ids=["top1", "infilling", "lora", "head"],
)
def test_two_dp_steps_on_cached_layers_through_train(fixtures, big_data, isolated_dirs, extra):  # noqa: F811
    from dp_adam_bench.train import train

    data, _ = big_data
    cfg = compose_cfg(
        [
            "task=glue_sst2",
            f"task.model={fixtures / 'mlm'}",
            f"task.data_dir={data}",
            "task.max_length=24",
            "task.cache_frozen_prefix=true",
            "task.public_split=10",
            "task.public_val=4",
            *extra,
            *two_private_steps("glue_cached", batch=6, physical=4),
        ]
    )
    s = train(cfg)
    assert s["steps"] == 2 and s["clipping"] == "bk" and s["self_check"]["max_rel_error"] < 1e-3
    assert 0 <= s["metrics"]["test_accuracy"] <= 100 and s["epsilon"]["rdp"] > 0
    assert "outside the 10-sentence public tuning split" in s["data_note"]
    assert s["finetune"]["trainable_params"] > 0


def test_mean_pooling_is_each_sentences_own_mean_of_real_tokens_at_unit_norm():
    """Against the definition, one example at a time: the mean of its real tokens (padding excluded), divided by its
    L2 norm; padding another example longer changes nothing."""
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    h = torch.randn(3, 8, 4)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    got = frozen_prefix.mean_pooled(h, mask)
    for i, n in enumerate(lengths):
        m = h[i, :n].mean(0)
        torch.testing.assert_close(got[i], m / m.norm(), rtol=1e-6, atol=1e-7)
    wider = torch.cat([h, torch.randn(3, 4, 4)], 1)
    torch.testing.assert_close(
        frozen_prefix.mean_pooled(wider, torch.cat([mask, torch.zeros(3, 4, dtype=torch.long)], 1)), got
    )
