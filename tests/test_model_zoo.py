"""Bring your own model: tiny models of the families people fine-tune (``tests/model_zoo.py``, built offline from
their configs) through every clipping engine. Each (family, engine) either matches the loop over batches of size
one (per-example norms and the clipped sum, float64) or is refused in one line, before or at its first batch, with
a ConfigError / ValueError naming what to do: never another exception, never a silent mismatch. The outcomes must
be the table in the README ("Bring your own model"), which this test reads."""

from __future__ import annotations

import re

import model_zoo
import pytest
import torch

from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.fix_model import fix_model
from dp_adam_bench.engine.grads import loop_grads
from dp_adam_bench.engine.self_check import loop_reference, relative_errors
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import REPO_ROOT

ENGINES = ("bk", "ghost", "hooks", "functorch", "loop")
B = 4
CLIP = 0.5


def _readme_table() -> dict[str, dict[str, str]]:
    """``{family: {engine: "exact" | "refused"}}`` from the README's zoo table."""
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("<!-- model-zoo-table -->")
    rows = {}
    for line in text[start:].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        family = re.sub(r"[`*]", "", cells[0]).split()[0]
        outcomes = ["exact" if c.startswith("exact") else "refused" for c in cells[1:]]
        rows[family] = dict(zip(ENGINES, outcomes, strict=True))
    return rows


def _model(name):
    model = model_zoo.build(name)
    if name == "resnet":
        model, _ = fix_model(model, verbose=False)
    return model.double()


def _batch(name, model):
    batch = model_zoo.batch(name, B)
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _outcome(name, engine, reference):
    model = _model(name)
    batch, loss = _batch(name, model), model_zoo.loss_fn(name)
    try:
        e = build_engine(engine, model, loss)
        got = e.clipped_sum(batch, CLIP)
    except (ConfigError, ValueError) as err:
        assert "\n" not in str(err), f"{name}/{engine}: a refusal must be one line"
        return "refused", str(err)
    e.close()
    norm_err, sum_err = relative_errors(got, *loop_reference(reference(model, loss, e.params, batch), CLIP))
    assert norm_err < 1e-9 and sum_err < 1e-9, (
        f"{name}/{engine}: norms {norm_err:.2g}, clipped sum {sum_err:.2g}"
    )
    return "exact", ""


@pytest.mark.parametrize("name", sorted(model_zoo.ZOO))
def test_family_through_every_engine(name):
    cache = {}

    def reference(model, loss, params, batch):  # the size-one loop, once per family (same seed, same weights)
        if "ref" not in cache:
            cache["ref"] = loop_grads(model, loss, params, batch)
        return cache["ref"]

    expected = _readme_table()[name]
    found = {}
    for engine in ENGINES:
        found[engine], why = _outcome(name, engine, reference)
        if found[engine] == "refused":
            assert "use " in why or "clipping" in why, f"{name}/{engine}: the refusal names no fix: {why}"
    assert found == expected, f"{name}: outcomes {found} differ from the README's table {expected}"
    assert found["bk"] == "exact", f"{name}: bk, the default engine, must train every family of the zoo"


def _user_loss(name):
    """The loss a user passes to make_private: ``loss_fn(output, labels)``, one value per example (an
    encoder-decoder's logits are aligned with its labels: make_private feeds its decoder the labels shifted)."""
    kind = model_zoo.ZOO[name][2]

    def loss_fn(output, labels):
        logits = output.logits if hasattr(output, "logits") else output
        if kind not in (model_zoo.lm_loss, model_zoo.seq2seq_loss):
            return torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        if kind is model_zoo.lm_loss:
            logits, labels = logits[:, :-1], labels[:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, reduction="none", ignore_index=-100
        )
        kept = (labels != -100).to(ce.dtype)
        return (ce * kept).sum(1) / kept.sum(1).clamp(min=1)

    return loss_fn


@pytest.mark.parametrize("name", sorted(model_zoo.ZOO))
def test_family_trains_through_make_private_with_bk(name):
    """The user's path: make_private with the default engine, its self-check and probe on, two noisy steps."""
    import dp_adam_bench as dab

    model = _model(name).float()
    data = model_zoo.batch(name, 16, seed=1)
    if model_zoo.ZOO[name][2] is model_zoo.lm_loss:
        data["labels"] = data["labels"].masked_fill(data["attention_mask"] == 0, -100)
    dataset = [{k: v[i] for k, v in data.items()} for i in range(16)]
    before = [p.detach().clone() for p in model.parameters()]
    tied = sorted(id(p) for p in model.parameters())
    private = dab.make_private(
        model, dataset, _user_loss(name), optimizer="adam", sigma=1.0, batch_size=8, steps=2, lr=1e-3, seed=0
    )
    while not private.done:
        private.step()
    assert private.self_check["max_rel_error"] < 1e-3
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert sorted(id(p) for p in model.parameters()) == tied  # tied weights stay tied: nothing untied
    private.close()


#: the zoo's text families, and the layers LoRA adapts where a family's default targets do not exist
TEXT = sorted(n for n, entry in model_zoo.ZOO.items() if entry[2] is not model_zoo.image_loss)
LORA_TARGETS = {"torch_encoder": ["linear1", "linear2"], "logit_scale": ["proj"]}


@pytest.mark.parametrize("name", TEXT)
def test_lora_on_every_text_family_trains_through_make_private_with_bk(name):
    """LoRA (peft; its default targets for the family: q / v projections, GPT-2's c_attn) through make_private
    with bk, the self-check on: every adapter moves and nothing else but the task head trains."""
    import dp_adam_bench as dab

    model = _model(name).float()
    data = model_zoo.batch(name, 16, seed=1)
    if model_zoo.ZOO[name][2] is model_zoo.lm_loss:
        data["labels"] = data["labels"].masked_fill(data["attention_mask"] == 0, -100)
    dataset = [{k: v[i] for k, v in data.items()} for i in range(16)]
    args = {"targets": LORA_TARGETS[name]} if name in LORA_TARGETS else {}
    private = dab.make_private(
        model, dataset, _user_loss(name), optimizer="adam", sigma=1.0, batch_size=8, steps=3, lr=1e-2, seed=0,
        finetune="lora", finetune_args=args,
    )  # fmt: skip
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}
    assert lora, f"{name}: no LoRA adapter was added"
    while not private.done:  # the moved check (3 steps) raises if a trainable tensor did not move
        private.step()
    assert private.self_check["max_rel_error"] < 1e-3
    private.close()


def test_torchvision_resnet_after_fix_model():
    """torchvision's ResNet-18 (BatchNorm: refused as built) after fix_model, through bk, against the loop. Skipped
    where torchvision does not load: its PyPI wheels are built for CUDA torch, not the CPU torch CI installs."""
    try:
        from torchvision.models import resnet18
    except (ImportError, RuntimeError) as err:
        pytest.skip(f"torchvision does not load here: {str(err).splitlines()[0][:80]}")
    torch.manual_seed(0)
    model = resnet18(num_classes=3)
    with pytest.raises(ConfigError, match="BatchNorm2d normalises with statistics of the whole batch"):
        build_engine("bk", model, model_zoo.image_loss)
    model, changes = fix_model(model, verbose=False)
    assert sum("-> GroupNorm" in c for c in changes) == 20
    model = model.double()
    batch = {
        "pixel_values": torch.randn(3, 3, 32, 32, dtype=torch.float64),
        "labels": torch.tensor([0, 2, 1]),
    }
    engine = build_engine("bk", model, model_zoo.image_loss)
    got = engine.clipped_sum(batch, CLIP)
    engine.close()
    ref = loop_grads(model, model_zoo.image_loss, engine.params, batch)
    norms = torch.sqrt(sum(g.reshape(3, -1).square().sum(1) for g in ref))
    torch.testing.assert_close(got.norms, norms, rtol=1e-9, atol=0)
