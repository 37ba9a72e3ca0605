"""Fine-tuning methods (dp_adam_bench/finetune): which tensors train, that the engines' per-example gradients of the
adapters match the loop over batches of size one, that the noise dimension is the trainable count, that a tensor
which never moves stops the run, and that the CLI names a bad method in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dp_adam_bench as dab
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.finetune import apply, parse
from dp_adam_bench.finetune.moved import NotTraining

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

VOCAB, T = 50, 10


def tiny_gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_bert_classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, labels: bool = False):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(1, VOCAB, (n, T), generator=g)
        self.y = torch.randint(0, 2, (n,), generator=g) if labels else self.x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def lm_loss(out, y):
    logits, target = out.logits[:, :-1], y[:, 1:]
    ce = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    return ce.view(target.shape).mean(1)


def cls_loss(out, y):
    return nn.functional.cross_entropy(out.logits, y, reduction="none")


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_each_method_opens_its_own_tensors_only():
    m = apply(tiny_gpt2(), "lora").model
    assert trainable(m) and all("lora_" in n for n in trainable(m))
    m = apply(tiny_gpt2(), "top1").model
    assert trainable(m) == {
        n for n, _ in m.named_parameters() if n.startswith(("transformer.h.1.", "transformer.ln_f."))
    }
    m = apply(tiny_gpt2(), "head").model
    assert trainable(m) == {"lm_head.weight"}
    out = apply(tiny_gpt2(), "prefix")
    assert trainable(out.model) and all("prompt_encoder" in n for n in trainable(out.model))
    # a classifier made for the task trains with every method, as peft's modules_to_save does
    m = apply(tiny_bert_classifier(), "lora").model
    assert {n for n in trainable(m) if "lora_" not in n} == {"classifier.weight", "classifier.bias"}
    m = apply(tiny_bert_classifier(), "top1").model
    names = trainable(m)
    assert any(n.startswith("bert.encoder.layer.1.") for n in names)
    assert not any(n.startswith("bert.encoder.layer.0.") for n in names)
    assert {"classifier.weight", "bert.pooler.dense.weight"} <= names


def test_summary_counts_and_lora_settings():
    out = apply(tiny_gpt2(), "lora", {"r": 2, "alpha": 4})
    s = out.summary
    assert s["method"] == "lora" and s["r"] == 2 and s["alpha"] == 4.0 and s["targets"] == ["c_attn"]
    # two blocks, each c_attn: A (2 x 16) and B (48 x 2)
    assert s["trainable_params"] == 2 * (2 * 16 + 48 * 2)
    assert s["trainable_params"] + s["frozen_params"] == sum(p.numel() for p in out.model.parameters())


@pytest.mark.parametrize("method", ["lora", "prefix", "top1"])
@pytest.mark.parametrize("clipping", ["bk", "ghost", "hooks"])
def test_per_example_norms_of_the_trainable_set_match_the_size_one_loop(method, clipping):
    """The engine's per-example gradient norms over the method's trainable tensors against autograd on each example
    alone (LoRA's B = 0 at the start gives A a zero gradient, so B is randomised first: a closed gate hides a missed
    use)."""
    from dp_adam_bench.engine.engines import build_engine

    model = apply(tiny_gpt2(), method, {"dropout": 0.0} if method == "lora" else {}).model  # no random masks
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    data = Tokens(6)
    batch = {"input_ids": data.x[:6], "labels": data.x[:6]}

    def loss_per_example(forward, b):
        return lm_loss(forward(input_ids=b["input_ids"]), b["labels"])

    engine = build_engine(clipping, model, loss_per_example)
    got = engine.clipped_sum(batch, None, None).norms
    params = [p for p in model.parameters() if p.requires_grad]
    want = []
    for i in range(6):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(loss_per_example(model, one).sum(), params, allow_unused=True)
        want.append(torch.sqrt(sum((g**2).sum() for g in grads if g is not None)))
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    torch.testing.assert_close(got.detach().cpu(), torch.stack(want).detach().cpu(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method", ["lora", "prefix", "top1", "head"])
def test_a_private_run_noises_the_trainable_set_and_moves_every_tensor(method):
    model = tiny_gpt2()
    private = dab.make_private(
        model,
        Tokens(),
        lm_loss,
        optimizer="adam",
        sigma=1.0,
        batch_size=16,
        steps=4,
        lr=1e-3,
        finetune=method,
    )
    while not private.done:
        private.step()
    n = private.run.finetune["trainable_params"]
    assert private.backend.numel_per_trial == n
    assert sum(p.numel() for p in private.params) == n
    assert private.moved_check.result == {"step": 3, "tensors": len(private.params), "unmoved": []}
    assert private.self_check and all(private.self_check.get(k, True) for k in ("passed",))


def test_an_adapter_the_optimizer_does_not_hold_stops_the_run():
    """A bug the check was not written around: the user replaces the LoRA weights after make_private (as a reload
    of an adapter would): the optimizer updates the old tensors, the forward pass reads the new ones, which never
    move, even with noise."""
    model = tiny_gpt2()
    private = dab.make_private(
        model,
        Tokens(),
        lm_loss,
        optimizer="adam",
        sigma=1.0,
        batch_size=16,
        steps=5,
        lr=1e-3,
        finetune="lora",
    )
    layer = private.model.transformer.h[0].attn.c_attn
    layer.lora_A["default"].weight = nn.Parameter(layer.lora_A["default"].weight.detach().clone())
    private.step()
    private.step()
    with pytest.raises(
        NotTraining, match=r"1 of 4 trainable tensors did not move in the first 3 steps .*lora_A"
    ):
        private.step()


def test_a_noiseless_run_whose_loss_skips_a_trainable_tensor_stops():
    model = tiny_gpt2()
    model.extra = nn.Linear(3, 3)  # trainable, never read by the forward pass

    private = dab.make_private(
        model,
        Tokens(),
        lm_loss,
        optimizer="sgd",
        noise="none",
        clip=None,
        batch_size=16,
        steps=3,
        lr=0.1,
        self_check=False,
    )
    private.step()
    private.step()
    with pytest.raises(NotTraining, match=r"extra\.weight, extra\.bias"):
        private.step()


def test_the_check_can_be_turned_off_and_survives_a_checkpoint():
    model = tiny_gpt2()
    private = dab.make_private(
        model, Tokens(), lm_loss, optimizer="sgd", sigma=1.0, batch_size=16, steps=4, lr=0.1, finetune="lora"
    )
    private.step()
    state = private.state_dict()
    assert state["moved_check"]["result"] is None and len(state["moved_check"]["start"]) == 4
    resumed = dab.make_private(
        tiny_gpt2(),
        Tokens(),
        lm_loss,
        optimizer="sgd",
        sigma=1.0,
        batch_size=16,
        steps=4,
        lr=0.1,
        finetune="lora",
    )
    resumed.load_state_dict(state)
    assert resumed.moved_check.start == private.moved_check.start
    while not resumed.done:
        resumed.step()
    assert resumed.moved_check.result["unmoved"] == []


def test_bad_methods_and_settings_are_one_line_errors():
    assert parse(None) == (None, None) and parse("top3") == ("top", 3) and parse("lora") == ("lora", None)
    for bad, match in [
        ("top0", r"top<k> needs k >= 1"),
        (
            "bogus",
            r"task.finetune='bogus' is not a known fine-tuning method; valid: full, head, top<k>, lora",
        ),
        (3, r"task.finetune=3; valid"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse(bad)
    with pytest.raises(ConfigError, match=r"task.finetune_args.r=0 \(lora\) must be an integer >= 1"):
        apply(tiny_gpt2(), "lora", {"r": 0})
    with pytest.raises(ConfigError, match=r"task.finetune_args.rank is not a setting of task.finetune=lora"):
        apply(tiny_gpt2(), "lora", {"rank": 4})
    with pytest.raises(ConfigError, match=r"has 2 blocks \(transformer.h\)"):
        apply(tiny_gpt2(), "top3")
    with pytest.raises(ConfigError, match=r"peft cannot prefix-tune BertForSequenceClassification"):
        apply(tiny_bert_classifier(), "prefix")
    with pytest.raises(ConfigError, match=r"finetune='nope'"):
        dab.make_private(
            tiny_gpt2(), Tokens(), lm_loss, sigma=1.0, batch_size=16, steps=2, lr=1e-3, finetune="nope"
        )


def test_the_run_id_names_the_method_and_keeps_old_runs_ids():
    from dp_adam_bench.tracking.run_store import run_id

    base = {
        "task": {"name": "e2e_gpt2"},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "noise": {"kind": "none"},
    }
    with_null = {**base, "task": {"name": "e2e_gpt2", "finetune": None, "finetune_args": {}}}
    lora = {**base, "task": {"name": "e2e_gpt2", "finetune": "lora", "finetune_args": {}}}
    lora_r8 = {**base, "task": {"name": "e2e_gpt2", "finetune": "lora", "finetune_args": {"r": 8}}}
    assert run_id(with_null) == run_id(base)
    assert len({run_id(base), run_id(lora), run_id(lora_r8)}) == 3


def test_the_cli_refuses_a_bad_method_in_one_line():
    from dp_adam_bench.config import validate
    from dp_adam_bench.train import run_config

    from helpers import compose_cfg

    cfg = run_config(compose_cfg(["task=e2e_gpt2", "task.finetune=top0"]))
    with pytest.raises(ConfigError, match=r"^task.finetune='top0': top<k> needs k >= 1"):
        validate(cfg)


def test_e2e_forward_with_a_prefix_matches_peft():
    """e2e_gpt2's target-position forward, which calls the transformer itself, gives the prefix-tuned model's logits
    as peft's own forward does (prefix keys and values before the sequence, positions after the prefix)."""
    from dp_adam_bench.tasks.e2e_gpt2 import GPT2AtTargets

    model = apply(GPT2AtTargets(tiny_gpt2()), "prefix", {"length": 3, "mid_dim": 8}).model
    model.eval()
    ids = torch.randint(1, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    pos = torch.arange(7).expand(2, -1)
    targets = torch.tensor([[2, 3, 6], [0, 4, 5]])
    got = model(input_ids=ids, attention_mask=mask, position_ids=pos, target_positions=targets)
    full = model.lm(input_ids=ids, attention_mask=mask).logits
    want = torch.gather(full, 1, targets.unsqueeze(-1).expand(-1, -1, VOCAB))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["full", "lora", "prefix", "rgp", "top1"])
def test_decoding_reads_what_training_fit(method):
    """The model e2e_gpt2 decodes its BLEU from (``generate``, peft's for LoRA and prefix-tuning) is the one its
    training forward fits: greedy decoding through ``generate`` equals greedy decoding through the target-position
    forward, token for token, once the method's weights have moved. peft 0.21.2 under transformers 5 failed this
    for prefix-tuning (generate replaced the prefix's keys and values by its own cache and decoded the untouched
    model), which left every prefix cell of li_e2e_methods at one ROUGE-L whatever its training."""
    from dp_adam_bench.tasks.e2e_gpt2 import GPT2AtTargets

    args = {"length": 3, "mid_dim": 8} if method == "prefix" else None
    model = (
        GPT2AtTargets(tiny_gpt2())
        if method == "full"
        else apply(GPT2AtTargets(tiny_gpt2()), method, args).model
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(2.0 * torch.randn_like(p))
    model.eval()
    prompt = torch.randint(1, VOCAB, (1, 5))
    ours = prompt
    for _ in range(6):
        t = ours.shape[1]
        logits = model(
            input_ids=ours,
            attention_mask=torch.ones_like(ours),
            position_ids=torch.arange(t).unsqueeze(0),
            target_positions=torch.tensor([[t - 1]]),
        )
        ours = torch.cat([ours, logits[:, -1].argmax(-1, keepdim=True)], 1)
    got = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        num_beams=1,
        do_sample=False,
        max_new_tokens=6,
        min_new_tokens=6,
        pad_token_id=0,
        use_cache=True,
    )
    assert got[0, 5:].tolist() == ours[0, 5:].tolist()


def test_lora_is_checked_again_once_training_has_opened_its_zero_factor():
    """LoRA's B = 0 at the start closes A's gradient: the start check verifies A only by perturbing the weights; the
    watch checks the engine again on the weights training reached (B moved), and leaves nothing unverified."""
    private = dab.make_private(
        tiny_gpt2(),
        Tokens(),
        lm_loss,
        optimizer="adam",
        sigma=1.0,
        batch_size=16,
        steps=4,
        lr=1e-3,
        finetune="lora",
        engine_watch_every=2,
    )
    while not private.done:
        private.step()
    d = private.watch.describe()
    assert d["at_steps"] == [0, 2] and d["never_verified"] == [] and d["failed"] is None
    assert d["max_rel_error"] < 1e-4


def test_the_paper_plan_counts_what_each_method_trains():
    """GPT-2 124M (untied head, as e2e_gpt2 trains it), built on the meta device: LoRA r = 4 on the 12 c_attn
    (768 -> 2304) trains 12 x 4 x (768 + 2304); top2 trains two blocks and ln_f."""
    from dp_adam_bench.paper_plan import model_shape

    def trainable(method):
        return model_shape({"task": {"name": "e2e_gpt2", "finetune": method}}).trainable

    assert trainable(None) == 124_439_808 + 50_257 * 768
    assert trainable("lora") == 12 * 4 * (768 + 2304)
    block = 2 * 768 * 2 + (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    assert trainable("top2") == 2 * block + 2 * 768


def test_moved_check_counts_only_steps_that_can_move_a_tensor():
    """A noiseless step on an empty batch updates nothing: it does not count toward the check's steps, and a run
    whose every step was one is recorded as not checked instead of stopped."""
    from dp_adam_bench.finetune.moved import MovedCheck

    w = torch.zeros(3)
    check = MovedCheck(lambda: [("w", w)], after=2)
    check.after_step(1, 10, counts=False)
    check.after_step(2, 10, counts=False)
    assert check.result is None  # nothing counted yet: an unmoved w is no evidence
    check.after_step(3, 10, counts=True)
    with pytest.raises(NotTraining, match="1 of 1 trainable tensors did not move in the first 4 steps"):
        check.after_step(4, 10, counts=True)

    idle = MovedCheck(lambda: [("w", w)], after=3)
    idle.after_step(1, 2, counts=False)
    idle.after_step(2, 2, counts=False)  # the run's last step, none counted
    assert idle.result["not_checked"] == "no step drew an example"
    resumed = MovedCheck(lambda: [("w", w)], after=2)
    resumed.load_state_dict({**check.state_dict(), "result": None})
    assert resumed.counted == 2
