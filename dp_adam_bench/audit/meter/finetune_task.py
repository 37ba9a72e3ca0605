"""The meter's and the audit's model task for the fine-tuning methods (``task.finetune``: full, head, top<k>, LoRA,
prefix, RGP): a model whose structure every method accepts, trained through ``trainer.prepare`` (the method applied
before the engine is built, as in a user's run), with canaries of known ownership.

Two model families:

* ``blocks`` (full, head, top<k>, LoRA, RGP): y = classifier(x) + sum_l (q_proj_l(x) + v_proj_l(x)) over two
  "blocks" (an ``nn.ModuleList``: what top<k> and RGP look for; ``q_proj`` / ``v_proj``: LoRA's default targets for
  models that name them so; ``classifier``: a head made for the task, which trains under every method). Every layer
  reads the input x directly and the model is linear in x, so example i's input feature 1 + i belongs to it alone in
  every tensor that reads x (a weight's column, LoRA's A, RGP's R, a buffer over the input): the audit's canary
  coordinates, whatever the method makes of the layers. The blocks act side by side, not in a chain, so that this
  ownership holds at every step, not only at the start.
* ``gpt2`` (prefix-tuning, which peft applies only to a Hugging Face model with past key values; every other method
  too): a tiny GPT-2 language model (2 layers, width 16, no dropout) on sequences [BOS, 2 + i, 1]: example i owns
  token 2 + i (a row of the token embedding and of the LM head).

The per-example loss is weighted per example (``weights``), so that most gradients are far above C (clipped to C)
and some near or below it: in the blocks family the weights give full fine-tuning's gradient the norms of
:data:`~dp_adam_bench.audit.meter.task.NORMS`; under another method the trainable part's norm is smaller. The meter
does not rely on them: it predicts each release from per-example gradients computed by autograd one example at a
time (:mod:`~dp_adam_bench.audit.meter.oracle`), whatever the method. No dropout anywhere (the oracle must see the
forward pass the engine saw). ``data_seed``: 0 is the run's data; another seed assigns the examples' own features
(tokens) by a permutation: the same model and method on other private data (the replay's twin, replay.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from dp_adam_bench.audit.meter.model_task import MODEL_NORM
from dp_adam_bench.audit.meter.task import SHARED, example_norms
from dp_adam_bench.errors import ConfigError

FAMILIES = ("blocks", "gpt2")
#: the blocks family's number of blocks (top<k> takes k <= BLOCKS)
BLOCKS = 2
#: the GPT-2 family's loss weight: gradients far above C (a language model's per-example gradient norm is O(1))
GPT2_SCALE = MODEL_NORM


def family_for(method: str | None) -> str:
    """The default family of ``method``: prefix-tuning needs a Hugging Face model (gpt2), the others take blocks."""
    return "gpt2" if method == "prefix" else "blocks"


class _Block(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.q_proj = nn.Linear(features, 2)
        self.v_proj = nn.Linear(features, 2)

    def forward(self, x):
        return self.q_proj(x) + self.v_proj(x)


class CanaryBlocks(nn.Module):
    """y = classifier(x) + sum over blocks of q_proj(x) + v_proj(x): linear in x, every layer reading x itself."""

    def __init__(self, features: int, blocks: int = BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(features) for _ in range(int(blocks)))
        self.classifier = nn.Linear(features, 2)

    def forward(self, x):
        y = self.classifier(x)
        for block in self.blocks:
            y = y + block(x)
        return y


def tiny_gpt2(vocab: int) -> nn.Module:
    """A GPT-2 language model small enough for a meter run (2 layers, width 16, 2 heads, no dropout)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=int(vocab),
        n_positions=32,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class FinetuneMeterTask:
    """``n`` canaries for a fine-tuning method (module docstring). ``shared``: the blocks family's weight of the
    feature every example shares (0: each canary owns its input outright, the audit's); ``included``: the audit's
    inclusion flags (an excluded example is the null example, a zero input with a zero loss: zero-out adjacency, for
    the gradient and for anything computed from the inputs); ``data_seed``: 0 the run's data, another seed a
    permutation of which example owns which feature or token."""

    name = "meter_finetune"

    def __init__(
        self,
        n: int,
        clip: float,
        family: str = "blocks",
        shared: float = SHARED,
        included: np.ndarray | None = None,
        data_seed: int = 0,
    ):
        if family not in FAMILIES:
            raise ConfigError(f"meter model family={family!r}; valid: {', '.join(FAMILIES)}")
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 10):
            raise ConfigError(f"meter examples n={n!r} must be an integer >= 10")
        if not (math.isfinite(clip) and clip > 0):
            raise ConfigError(f"privacy.clip={clip!r} must be a finite number > 0 for the meter")
        self.n, self.family, self.clip = int(n), family, float(clip)
        self.shared = float(shared)
        self.features = 1 + self.n  # blocks: the shared feature 0, then one feature per example
        self.vocab = 2 + self.n  # gpt2: BOS 0, the shared token 1, then one token per example
        own = np.arange(self.n)
        if data_seed:
            own = np.random.default_rng([int(data_seed), 57]).permutation(self.n)
        self.own = torch.as_tensor(own, dtype=torch.long)
        # full fine-tuning of the blocks: 2 BLOCKS + 1 layers read x, each weight's gradient e_0 x^T (norm a) and
        # each bias's e_0: ||g||^2 = L (a^2 + 1) = (MODEL_NORM C)^2
        layers = 2 * BLOCKS + 1
        self.a = math.sqrt((MODEL_NORM * self.clip) ** 2 / layers - 1.0)
        norms = np.minimum(example_norms(self.n), MODEL_NORM) / MODEL_NORM
        scale = 1.0 if family == "blocks" else GPT2_SCALE
        self.weights = torch.as_tensor(norms * scale, dtype=torch.float64)
        self.included = None if included is None else torch.as_tensor(np.asarray(included, dtype=bool))

    @property
    def dataset_size(self) -> int:
        return self.n

    # --- the model ----------------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return CanaryBlocks(self.features) if self.family == "blocks" else tiny_gpt2(self.vocab)

    def canary_axis(self) -> tuple[int, torch.Tensor]:
        """(the size of the axis along which a tensor's slice belongs to one example, each example's index on it):
        the blocks' input features, GPT-2's vocabulary."""
        size = self.features if self.family == "blocks" else self.vocab
        return size, self.own + (1 if self.family == "blocks" else 2)

    # --- the data -----------------------------------------------------------------------------------------------
    def inputs(self, idx: torch.Tensor, *, null_excluded: bool = True) -> torch.Tensor:
        """The examples' inputs; an excluded canary's is the null example (no feature, no own token: [BOS, 1, 1])
        unless ``null_excluded`` is False: it is absent from the data, not only from the gradient, so that what a
        method keeps of its inputs (a statistic) cannot see it either."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        null = (
            ~self.included[idx]
            if null_excluded and self.included is not None
            else torch.zeros(len(idx), dtype=torch.bool)
        )
        if self.family == "gpt2":
            seq = torch.zeros(len(idx), 3, dtype=torch.long)
            seq[:, 1] = torch.where(null, torch.ones_like(idx), 2 + self.own[idx])
            seq[:, 2] = 1
            return seq
        x = torch.zeros(len(idx), self.features, dtype=torch.float32)
        x[:, 0] = self.a * self.shared
        x[torch.arange(len(idx)), 1 + self.own[idx]] = self.a * math.sqrt(1.0 - self.shared**2)
        x[null] = 0.0
        return x

    def keep(self, idx: torch.Tensor) -> torch.Tensor:
        """Each example's loss weight (0 for an excluded canary)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        keep = self.weights[idx]
        if self.included is not None:
            keep = keep * self.included[idx].double()
        return keep.float()

    def get_batch(self, indices) -> dict:
        idx = torch.as_tensor(indices, dtype=torch.long)
        key = "input_ids" if self.family == "gpt2" else "x"
        return {key: self.inputs(idx), "keep": self.keep(idx)}

    def loss_per_example(self, forward, batch):
        return self.unweighted_loss(forward, batch) * batch["keep"]

    def unweighted_loss(self, forward, batch) -> torch.Tensor:
        """Each example's loss before its weight: <e_0, y> (blocks), the mean next-token NLL (gpt2)."""
        if self.family == "blocks":
            return forward(batch["x"])[:, 0]
        ids = batch["input_ids"]
        logits = forward(input_ids=ids).logits[:, :-1]
        target = ids[:, 1:]
        nll = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        )
        return nll.view(target.shape).mean(1)

    def canary_losses(self, model: nn.Module) -> torch.Tensor:
        """Every example's unweighted loss under ``model`` (eval mode, no gradient): the audit's view of a canary
        through the function the method's tensors compute, float64."""
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                idx = torch.arange(self.n)
                key = "input_ids" if self.family == "gpt2" else "x"
                batch = {key: self.inputs(idx, null_excluded=False)}
                device = next(model.parameters()).device
                batch = {k: v.to(device) for k, v in batch.items()}
                return self.unweighted_loss(model, batch).double().cpu()
        finally:
            model.train(training)

    def evaluate(self, model) -> dict:
        """The model's output on a public input (all zeros; BOS), not on any private example."""
        model.eval()
        with torch.no_grad():
            device = next(model.parameters()).device
            if self.family == "blocks":
                out = model(torch.zeros(1, self.features, device=device))[0, 0]
            else:
                out = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device)).logits[0, -1, 1]
        return {"meter_output_at_public_input": float(out)}
