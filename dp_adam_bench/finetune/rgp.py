"""RGP, reparametrized gradient perturbation: Da Yu, Huishuai Zhang, Wei Chen, Jian Yin, Tie-Yan Liu, "Large Scale
Private Learning via Low-rank Reparametrization", ICML 2021 (PMLR 139:12208-12218), arXiv 2106.09352.

Sources, and how sure each fact is
----------------------------------
Only the abstract of the stored full text could be read in this session (the search returned the beginning of
the page each time). It says: "we reparametrize each weight matrix with two gradient-carrier matrices of small
dimension and a residual weight matrix. [...] such reparametrization keeps the forward/backward process unchanged
while enabling us to compute the projected gradient without computing the gradient itself. [...] RGP perturbs the
gradients on gradient-carrier matrices and reconstructs an update for the original weight from the noisy
gradients. Importantly, we use historical updates to find the gradient-carrier matrices". The rest comes from
(a) the authors' released code (github.com/dayu11/Differentially-Private-Deep-Learning: ``language/bert/bert_code/
fairseq/lrk_utils.py``, ``modules/multihead_attention.py``, ``trainer.py``, ``language/README.md``;
``vision/RGP/models/resnet_cifar.py``, ``cifar_train.py``), read through the code index, and (b) the paper's
Section 3 as remembered: the equation and algorithm numbers below (Eq. 1, Eq. 2, Eq. 3, Algorithms 1 and 2) are
NOT checked against the text. The reconstruction's sign is checked by algebra instead (below, and in the tests).

1. Reparametrization (Eq. 1): a weight W (p x d = d_out x d_in) becomes W -> L R + W~.stop_gradient(), with the
   gradient carriers L (p x r) and R (r x d), and the residual weight W~ = W - L R, which collects no gradient. The
   forward and backward signals are unchanged. Which weights: the authors' BERT code reparametrizes the attention
   in/out projections and the two feed-forward layers of every transformer block; "we do not reparametrize the
   classification layer because it is already low-rank" (their comment), which trains by DP-SGD directly, its
   per-example gradient clipped together with the carriers'. Everything else (embeddings, LayerNorm, every bias)
   is frozen there (``trainer.py`` collects the carriers and the classification head alone).
2. Carriers (Algorithm 2, "decomposition via power method", as in ``weight_decomposition``): R0 ~ N(0, 1) of shape
   (d x r); K times: L = Delta R, orthonormalize L's columns; R = Delta^T L, orthonormalize R's columns; R <- R^T.
   So L^T L = I and R R^T = I. Delta is the historical update. Algorithm 1 (remembered): Delta_t = W_t - W_0 *
   1{t > T_warm-up}, i.e. the weight itself during a warm-up and the update accumulated since the start after it;
   the vision code does that (with both weights normalised, W_t/|W_t| - W_0/|W_0|), the BERT code decomposes the
   current weight W_t at every step (a warm-up as long as the run). A fresh Gaussian start each step, K = 1 in both.
3. Per-example carrier gradients (Eq. 2): dL_i = (dW_i) R^T and dR_i = L^T (dW_i); for a linear layer with input
   x and output gradient e, dL_i = e (R x)^T and dR_i = (L^T e) x^T, the gradients of the two small linear layers
   R then L: no per-example dW_i is formed. Clipping: each example's concatenation of all carriers' gradients (and
   the head's) to norm C; noise N(0, sigma^2 C^2) on the sum, divided by the batch size.
4. Reconstruction (Eq. 3): dW~ = (dL) R + L (dR) - L L^T (dL) R. With P_L = L L^T and P_R = R^T R this is
   P_L G + G P_R - P_L G P_R, the orthogonal projection of G = dW onto {L A + B R} (orthonormal carriers), and G
   itself when G = L M R. The minus sign is the one that makes it a projection: with a plus the common part
   P_L G P_R is counted three times. (The released BERT code computes ``m1 + m2`` with m2 = L L^T (dL) R, and the
   vision code uses (dL) R alone; we follow the projection.) An off-the-shelf optimizer then updates W with dW~.
5. Privacy: one Gaussian mechanism per step on the clipped carrier (and head) gradients, sensitivity C, the same
   sampling and accountant as DP-SGD; the reconstruction, the optimizer and the power iteration on the historical
   update (a function of the released updates, of the public starting weights and of a data-independent Gaussian
   start) are post-processing. The noise dimension is the number of carrier (and head) coordinates.
6. Defaults for the language experiments: rank r = 1 (``language/README.md``: ``--rank 1`` for every GLUE task)
   and K = 1 power iteration (``weight_decomposition(W, rank, iter=1)``); the vision code uses r = 16.

What this module does
---------------------
* :class:`RGPLinear` replaces an ``nn.Linear`` or GPT-2's ``Conv1D`` by ``residual`` (an ``nn.Linear`` holding W~
  and the original bias, frozen), ``carrier_R`` (``nn.Linear(d_in, r)``, weight R) and ``carrier_L``
  (``nn.Linear(r, d_out)``, weight L); ``forward(x) = residual(x) + carrier_L(carrier_R(x))``. Every clipping
  engine handles ``nn.Linear``, so the per-example carrier gradients of Eq. 2 need no engine code.
* :func:`reparametrize` (``task.finetune=rgp``): targets, by default, every ``nn.Linear`` / ``Conv1D`` inside the
  transformer blocks (the model's longest ``nn.ModuleList`` of one block class, as :mod:`.blocks`); a model without
  blocks: every ``nn.Linear`` but its output head (a task head by name, else the last ``nn.Linear``); never
  ``nn.MultiheadAttention.out_proj`` (the attention reads its weight without calling it), and a weight tied to
  another parameter is refused. Trainable afterwards, following the authors' code: the carriers and the output
  head (a head made for the task, :data:`~dp_adam_bench.finetune.TASK_HEADS`, or a block-less model's last
  ``nn.Linear``); every bias, norm, embedding, the pooler and a pretrained LM head are frozen (name a layer in
  ``targets`` to reparametrize it). ``task.finetune_args``: ``rank`` (1), ``power_iters`` (1),
  ``targets`` (module-name suffixes) and ``warmup_steps`` (null: Delta_t = W_t at every step, the released language
  code; an integer T: W_t up to step T, W_t - W_0 after it, Algorithm 1). The first carriers are the power iteration
  on the starting weights W_0 with the start ``power_start(seed=0, step=1)``.
* :class:`RGPVariant` wraps the optimizer variant: it rebuilds each weight's noisy gradient with Eq. 3, lets the
  wrapped variant update [weights W, other trained tensors] in place, then chooses the next carriers by the power
  iteration on the historical update (start seeded from (seed, step, layer)), and writes W~ = W - L R.

State: the variant's state is ``{"weight": [W per layer], "inner": <the wrapped variant's state over [W...,
others...]>, "step": t}`` plus ``"origin": [W_0 per layer]`` with ``warmup_steps``: tensors, lists and ints only
(checkpoints load it with ``weights_only``). The weights W live there (one copy of every target weight, as the
authors' code caches W beside W~), not in the model: the model holds W~ and the carriers, and the checkpoint's
parameters are the carriers and the head. :meth:`RGPVariant.restore` writes a state into the model (W~ = W - L R
with the carriers as loaded, the expression the update itself uses, so a resumed run continues bit for bit on the
CPU); the session calls it when it loads a checkpoint, and :meth:`RGPVariant.scale` (which the session calls once
per step, before the forward pass) and ``update`` call it for any state the model was not written from.

Not from the paper: the authors scale the classification head's per-example gradient by 1/10 (BERT) or 1/100
(vision) before clipping; not done here (no per-tensor gradient scale in the engines). BERT's separate query /
key / value layers each get rank r, where fairseq's fused in-projection (GPT-2's ``c_attn`` likewise) gets r in all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.finetune.common import Finetuned, int_arg, is_task_head, refuse_unknown
from dp_adam_bench.optim.base import Releases, StepContext, Variant

#: the language experiments' rank (language/README.md: ``--rank 1``) and power iterations (``iter=1``)
DEFAULT_RANK = 1
DEFAULT_POWER_ITERS = 1
ARGS = ("rank", "power_iters", "targets", "warmup_steps")
#: the seed of the first carriers' power-iteration start (chosen in reparametrize, before any run seed is known)
FIRST_SEED = 0


# --- the paper's linear algebra --------------------------------------------------------------------------------------
def power_start(d_in: int, rank: int, seed: int, step: int, layer: int, *, dtype=torch.float32, device=None):
    """The power iteration's Gaussian start R0 (d_in x r, N(0, 1)) for the carriers used at ``step`` of layer number
    ``layer``: drawn on the CPU from a generator seeded from (seed, step, layer), so that it is the same on every
    device, on every data-parallel rank and in a resumed run."""
    entropy = [int(seed) % 2**63, int(step), int(layer)]
    key = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))
    start = torch.randn(int(d_in), int(rank), generator=torch.Generator().manual_seed(key))
    return start.to(dtype=dtype, device=device)


def orthonormalize(m: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``m``'s (Gram-Schmidt's result for full column rank: QR with the signs that make
    R's diagonal positive). Householder QR keeps the columns orthonormal when ``m`` is rank-deficient, where
    Gram-Schmidt would divide by zero."""
    q, r = torch.linalg.qr(m)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return q * signs


def decompose(
    delta: torch.Tensor, rank: int, iters: int, start: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 2: K = ``iters`` power iterations on ``delta`` (d_out x d_in) from ``start`` (d_in x r); returns L
    (d_out x r, orthonormal columns) and R (r x d_in, orthonormal rows)."""
    if start.shape != (delta.shape[1], rank):
        raise ValueError(f"power_start of shape {tuple(start.shape)}, expected {(delta.shape[1], rank)}")
    right = start
    for _ in range(int(iters)):
        left = orthonormalize(delta @ right)
        right = orthonormalize(delta.T @ left)
    return left, right.T.contiguous()


def reconstruct(grad_L: torch.Tensor, grad_R: torch.Tensor, L: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Eq. 3: dW~ = (dL) R + L (dR) - L L^T (dL) R, computed as (dL) R + L (dR - (L^T dL) R) (the same product,
    with an r x r middle factor)."""
    return grad_L @ R + L @ (grad_R - (L.T @ grad_L) @ R)


# --- the reparametrized layer ---------------------------------------------------------------------------------------
def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2: y = x W + b, W of shape (d_in, d_out)), without importing transformers."""
    t = type(m)
    return t.__name__ == "Conv1D" and t.__module__.startswith("transformers")


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def linear_weight(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W as d_out x d_in, bias) of an ``nn.Linear`` or a ``Conv1D`` (whose stored weight is W^T)."""
    w = m.weight.detach()
    return (w.T if is_conv1d(m) else w), (None if m.bias is None else m.bias.detach())


class RGPLinear(nn.Module):
    """W = W~ + L R (Eq. 1) in place of an ``nn.Linear`` or a ``Conv1D``: ``residual`` holds W~ and the bias
    (frozen), ``carrier_R`` holds R (r x d_in) and ``carrier_L`` holds L (d_out x r). The output is x W^T + b.

    ``start``: the power iteration's start (d_in x rank); by default :func:`power_start` with seed 0, step 1 and
    ``index``. ``power_iters`` and ``warmup_steps`` are kept for :class:`RGPVariant`."""

    def __init__(
        self,
        layer: nn.Module,
        rank: int,
        power_iters: int = DEFAULT_POWER_ITERS,
        warmup_steps: int | None = None,
        start: torch.Tensor | None = None,
        index: int = 0,
    ):
        super().__init__()
        if not is_linear(layer):
            raise TypeError(
                f"RGPLinear replaces an nn.Linear or a transformers Conv1D, not {type(layer).__name__}"
            )
        weight, bias = linear_weight(layer)
        d_out, d_in = weight.shape
        if not 1 <= rank <= min(d_in, d_out):
            raise ValueError(f"rank={rank} must be in [1, min(d_in, d_out) = {min(d_in, d_out)}]")
        if int(power_iters) < 1:
            raise ValueError(f"power_iters={power_iters} must be >= 1")
        self.rank, self.power_iters, self.warmup_steps = int(rank), int(power_iters), warmup_steps
        kw = {"device": weight.device, "dtype": weight.dtype}
        self.residual = nn.Linear(d_in, d_out, bias=bias is not None, **kw)
        self.carrier_R = nn.Linear(d_in, self.rank, bias=False, **kw)
        self.carrier_L = nn.Linear(self.rank, d_out, bias=False, **kw)
        self.residual.requires_grad_(False)
        if start is None:
            start = power_start(
                d_in, self.rank, FIRST_SEED, 1, index, dtype=weight.dtype, device=weight.device
            )
        with torch.no_grad():
            if bias is not None:
                self.residual.bias.copy_(bias)
            self.set_carriers(weight, *decompose(weight, self.rank, self.power_iters, start))

    @property
    def in_features(self) -> int:
        return self.residual.in_features

    @property
    def out_features(self) -> int:
        return self.residual.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual(x) + self.carrier_L(self.carrier_R(x))

    def weight(self) -> torch.Tensor:
        """W = W~ + L R (d_out x d_in), a new tensor."""
        return self.residual.weight + self.carrier_L.weight @ self.carrier_R.weight

    @torch.no_grad()
    def set_carriers(self, weight: torch.Tensor, L: torch.Tensor, R: torch.Tensor) -> None:
        """Carriers L, R and W~ = ``weight`` - L R, in place (the carriers are the tensors the engine trains)."""
        self.carrier_L.weight.copy_(L)
        self.carrier_R.weight.copy_(R)
        self.write_residual(weight)

    @torch.no_grad()
    def write_residual(self, weight: torch.Tensor) -> None:
        """W~ = ``weight`` - L R with the carriers as they are: the one expression for it, so that a resumed run
        writes the bits the uninterrupted one wrote."""
        self.residual.weight.copy_(weight - self.carrier_L.weight @ self.carrier_R.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def rgp_layers(model: nn.Module) -> list[tuple[str, RGPLinear]]:
    """The model's reparametrized layers, by qualified name, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RGPLinear)]


# --- task.finetune=rgp ----------------------------------------------------------------------------------------------
def _blocks(model: nn.Module) -> str | None:
    """The dotted name of the transformer blocks: the longest ``nn.ModuleList`` of modules of one class (the rule of
    :func:`dp_adam_bench.finetune.blocks.transformer_blocks`), that class not a linear layer itself (a list of
    ``nn.Linear`` is an MLP's layers); None without one."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1 and not is_linear(m[0]):
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    return None if best is None else best[0]


def _inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _driven_by_parent(model: nn.Module, name: str) -> bool:
    """A linear layer whose parent reads its weight instead of calling it (``nn.MultiheadAttention.out_proj``)."""
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return isinstance(parent, nn.MultiheadAttention)


def _heads(model: nn.Module, blocks: str | None) -> list[str]:
    """The output head's module names: the heads made for the task (by name); a model without transformer blocks
    and without such a head: its last ``nn.Linear``."""
    named = [
        n for n, _ in model.named_modules() if is_task_head(n) and not is_task_head(n.rpartition(".")[0])
    ]
    if named or blocks is not None:
        return named
    last = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return last[-1:]


def _targets(model: nn.Module, suffixes, blocks: str | None, heads: list[str]) -> list[tuple[str, nn.Module]]:
    linear = [(n, m) for n, m in model.named_modules() if n and is_linear(m)]
    if suffixes is None:
        if blocks is not None:
            chosen = [(n, m) for n, m in linear if _inside(n, blocks)]
        else:
            chosen = [(n, m) for n, m in linear if not any(_inside(n, h) for h in heads)]
        return [(n, m) for n, m in chosen if not _driven_by_parent(model, n)]
    if isinstance(suffixes, str):
        suffixes = [suffixes]
    if not isinstance(suffixes, (list, tuple)) or not all(isinstance(s, str) and s for s in suffixes):
        raise ConfigError(
            f"task.finetune_args.targets={suffixes!r} (rgp) must be a list of module-name suffixes"
        )
    modules = dict(model.named_modules())
    chosen = {}
    for s in suffixes:
        hits = [n for n in modules if n and (n == s or n.endswith("." + s))]
        if not hits:
            raise ConfigError(
                f"task.finetune_args.targets: {type(model).__name__} has no module named {s!r} (rgp)"
            )
        for n in hits:
            if not is_linear(modules[n]):
                raise ConfigError(
                    f"task.finetune_args.targets: {n!r} is a {type(modules[n]).__name__}; rgp reparametrizes "
                    "nn.Linear and transformers' Conv1D layers"
                )
            if _driven_by_parent(model, n):
                raise ConfigError(
                    f"task.finetune_args.targets: {n!r} is nn.MultiheadAttention's out_proj, whose weight the "
                    "attention reads without calling the layer; rgp cannot reparametrize it"
                )
            chosen[n] = modules[n]
    return [(n, m) for n, m in linear if n in chosen]


def _refuse_tied(model: nn.Module, targets: list[tuple[str, nn.Module]]) -> None:
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for name, m in targets:
        others = [n for n in owners[id(m.weight)] if not _inside(n, name)]
        if others:
            raise ConfigError(
                f"task.finetune=rgp: the weight of {name!r} is shared with {others[0]!r} (tied); reparametrizing it "
                "would untie them"
            )


def reparametrize(model: nn.Module, args: dict) -> dict:
    """``task.finetune=rgp``: replace the target layers of ``model`` by :class:`RGPLinear` in place, freeze all but
    the carriers and the output head (the module docstring), and return the summary. A one-line ConfigError for a
    bad ``rank`` (< 1, not an integer, above min(d_in, d_out) of a target), ``power_iters``, ``warmup_steps`` or
    ``targets``, and for a model without a layer to reparametrize; the model is untouched then."""
    args = dict(args or {})
    refuse_unknown(args, ARGS, "rgp")
    rank = int_arg(args, "rank", DEFAULT_RANK, "rgp")
    iters = int_arg(args, "power_iters", DEFAULT_POWER_ITERS, "rgp")
    warmup = None if args.get("warmup_steps") is None else int_arg(args, "warmup_steps", 1, "rgp")
    blocks = _blocks(model)
    heads = _heads(model, blocks)
    targets = _targets(model, args.get("targets"), blocks, heads)
    if not targets:
        where = (
            f"inside its transformer blocks ({blocks})" if blocks is not None else "besides its output head"
        )
        raise ConfigError(
            f"task.finetune=rgp: {type(model).__name__} has no nn.Linear or Conv1D layer {where} to reparametrize; "
            "name some with task.finetune_args.targets"
        )
    for name, m in targets:
        d_out, d_in = linear_weight(m)[0].shape
        if rank > min(d_in, d_out):
            raise ConfigError(
                f"task.finetune_args.rank={rank} (rgp) exceeds min(d_in, d_out) = {min(d_in, d_out)} of {name!r} "
                f"({d_out} x {d_in})"
            )
    _refuse_tied(model, targets)
    heads = [h for h in heads if not any(_inside(h, n) for n, _ in targets)]

    model.requires_grad_(False)
    for index, (name, m) in enumerate(targets):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, RGPLinear(m, rank, iters, warmup, index=index))
    for h in heads:
        model.get_submodule(h).requires_grad_(True)

    layers = rgp_layers(model)
    carriers = sum(m.carrier_L.weight.numel() + m.carrier_R.weight.numel() for _, m in layers)
    head_params = sum(p.numel() for h in heads for p in model.get_submodule(h).parameters())
    return {
        "method": "rgp",
        "rank": rank,
        "power_iters": iters,
        "warmup_steps": warmup,
        "history": "weight" if warmup is None else f"weight until step {warmup}, then W_t - W_0",
        "layers": [n for n, _ in layers],
        "carrier_params": carriers,
        "reparametrized_params": sum(m.residual.weight.numel() for _, m in layers),
        "heads": heads,
        "head_params": head_params,
    }


# --- the optimizer wrapper ------------------------------------------------------------------------------------------
def refusal(variant: Variant) -> str | None:
    """Why the variant ``variant`` cannot run under RGP (None: it can). RGP's rebuilt weight gradients carry the
    carriers' noise mapped by Eq. 3, not the privatizer's isotropic sigma C / B noise on those weights, and every
    other release is made in the carriers' space. A variant that reads ``ctx.noise_variance`` for its update is a
    :class:`~dp_adam_bench.optim.adam.SubtractBias` here; a plug-in declares it with ``uses_noise_variance = True``."""
    releases = variant.releases()
    if releases.square_sensitivity is not None:
        return "it releases g^2 besides g (independent moment estimation), in the carriers' space"
    if releases.clean or variant.needs_clean or not variant.private:
        return "it reads the clean (un-noised) gradient, in the carriers' space"
    if variant.needs_side_info:
        return "it reads a public batch's gradient of the carriers, not of the weights"
    from dp_adam_bench.optim.adam import SubtractBias

    if isinstance(variant, SubtractBias) or getattr(variant, "uses_noise_variance", False):
        return (
            "it subtracts the privatizer's noise variance (sigma C / B)^2 from its second moment, which is not the "
            "variance of the noise on a weight rebuilt from the carriers"
        )
    try:
        scaled = variant.scale(variant.init([torch.zeros(1)])) is not None
    except Exception:  # noqa: BLE001 - a variant whose state needs real tensors: judged by its class instead
        scaled = type(variant).scale is not Variant.scale
    if scaled:
        return "it scales per-example gradients per coordinate before clipping (scale-then-privatize)"
    return None


def compatible_variants() -> list[str]:
    """The registered optimizer variants RGP can wrap."""
    from dp_adam_bench.optim.registry import VARIANTS, build_variant

    out = []
    for name in VARIANTS.names():
        try:
            if refusal(build_variant(name, lr=1.0)) is None:
                out.append(name)
        except Exception:  # noqa: BLE001 - a variant that needs more than lr to build is left out of the list
            continue
    return out


@dataclass
class _Layout:
    """Where each layer's carriers and the other trained tensors are in the trained list."""

    left: list[int]
    right: list[int]
    others: list[int]
    tensors: list[torch.Tensor]


class RGPVariant(Variant):
    """The optimizer variant ``inner`` applied to the reparametrized weights (the module docstring): each step, Eq.
    3 rebuilds every weight's noisy gradient from its carriers', ``inner`` updates [the weights W..., the other
    trained tensors...] in place, and the power iteration on the historical update (start seeded from ``seed``, the
    step and the layer) gives the carriers of the next step, with W~ = W - L R. ``params`` (of ``init`` /
    ``update``) are the model's trainable tensors in model order: the carriers and any other trained tensor.

    ``decay_mask`` is over the trained tensors (the trainer sets it on the variant it builds, before wrapping it:
    that mask is taken over); a weight W decays when its carriers do, the others by their own entry. ``lr``,
    ``releases()``, ``private``, ``sigma_factor``, ``needs_fixed_batch``, ... are the wrapped variant's.
    A variant whose update needs the privatizer's isotropic noise on its tensors, or any release other than the
    noisy gradient, is refused in one line (:func:`refusal`)."""

    def __init__(self, inner: Variant, model: nn.Module, seed: int):
        why = refusal(inner)
        if why is not None:
            raise ConfigError(
                f"task.finetune=rgp with optimizer.name={inner.name!r}: {why}; RGP works with "
                f"{', '.join(compatible_variants())}"
            )
        self.inner = inner
        self.model = model
        self.seed = int(seed)
        self.layers = rgp_layers(model)
        if not self.layers:
            raise ConfigError(
                f"RGPVariant: {type(model).__name__} has no RGPLinear layer; call "
                "dp_adam_bench.finetune.rgp.reparametrize(model, args) first"
            )
        # the trainer sets the mask over the trained tensors on the variant it builds, before wrapping it
        self._decay_mask: list[bool] | None = None if inner.decay_mask is None else list(inner.decay_mask)
        self._layout: _Layout | None = None
        self._live: dict | None = None  # the state the model's W~ and carriers were last written from

    # --- the wrapped variant's attributes ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @property
    def decay_mask(self) -> list[bool] | None:
        return self._decay_mask

    @decay_mask.setter
    def decay_mask(self, mask: list[bool] | None) -> None:
        self._decay_mask = None if mask is None else [bool(m) for m in mask]

    private = property(lambda self: self.inner.private)
    needs_clean = property(lambda self: self.inner.needs_clean)
    needs_side_info = property(lambda self: self.inner.needs_side_info)
    sigma_factor = property(lambda self: self.inner.sigma_factor)
    needs_fixed_batch = property(lambda self: self.inner.needs_fixed_batch)
    coupled_decay = property(lambda self: self.inner.coupled_decay)
    weight_decay = property(lambda self: self.inner.weight_decay)
    weight_decay_mode = property(lambda self: self.inner.weight_decay_mode)
    decay_exclude = property(lambda self: self.inner.decay_exclude)

    def __getattr__(self, attr: str):
        # only reached for attributes this class lacks (beta1, eps, ...); never during construction or copying
        if attr.startswith("__") or attr in ("inner", "model", "layers", "_layout", "_live", "_decay_mask"):
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def releases(self) -> Releases:
        return self.inner.releases()

    # --- state --------------------------------------------------------------------------------------------------------
    def _layout_of(self, params: list[torch.Tensor]) -> _Layout:
        where = {id(p): i for i, p in enumerate(params)}
        left, right = [], []
        for name, layer in self.layers:
            i, j = where.get(id(layer.carrier_L.weight)), where.get(id(layer.carrier_R.weight))
            if i is None or j is None:
                raise ValueError(
                    f"RGPVariant: the carriers of {name!r} are not among the {len(params)} trained tensors (are they "
                    "frozen?); the trained tensors must be the model's parameters with requires_grad, in model order"
                )
            left.append(i)
            right.append(j)
        carriers = set(left) | set(right)
        others = [i for i in range(len(params)) if i not in carriers]
        return _Layout(left, right, others, list(params))

    def _check(self, params: list[torch.Tensor]) -> _Layout:
        layout = self._layout
        if (
            layout is None
            or len(layout.tensors) != len(params)
            or any(a is not b for a, b in zip(layout.tensors, params, strict=True))
        ):
            layout = self._layout = self._layout_of(params)
        return layout

    def init(self, params: list[torch.Tensor]) -> dict:
        """The weights W = W~ + L R of every layer, the wrapped variant's state over [W..., others...], the step
        count, and W_0 for the accumulated history (``warmup_steps``)."""
        layout = self._check(params)
        with torch.no_grad():
            weights = [layer.weight().detach().clone() for _, layer in self.layers]
        others = [params[i] for i in layout.others]
        state = {"weight": weights, "inner": self.inner.init(weights + others), "step": 0}
        if any(layer.warmup_steps is not None for _, layer in self.layers):
            state["origin"] = [w.clone() for w in weights]
        self._live = state
        return state

    def restore(self, state: dict) -> None:
        """Write ``state`` into the model: W~ = W - L R for every layer with the carriers as they are (a loaded
        checkpoint's: the session restores the carriers with the parameters). Every later call reads ``state``."""
        with torch.no_grad():
            for (_, layer), weight in zip(self.layers, state["weight"], strict=True):
                layer.write_residual(weight.to(layer.residual.weight.device))
        self._live = state

    def scale(self, state: dict) -> list[torch.Tensor] | None:
        """None (scale-then-privatize variants are refused). The session calls it with the run's state once per
        step, before the forward pass: a state not written into the model yet (a loaded checkpoint) is, here."""
        if state is not self._live and isinstance(state, dict) and "weight" in state:
            self.restore(state)
        return self.inner.scale(state["inner"]) if isinstance(state, dict) and "inner" in state else None

    def _inner_mask(self, layout: _Layout) -> list[bool] | None:
        mask = self._decay_mask
        if mask is None:
            return None
        if len(mask) != len(layout.tensors):
            raise ValueError(
                f"decay_mask has {len(mask)} entries for {len(layout.tensors)} parameter tensors"
            )
        weights = [mask[i] or mask[j] for i, j in zip(layout.left, layout.right, strict=True)]
        return weights + [mask[i] for i in layout.others]

    def update(self, params: list[torch.Tensor], state: dict, ctx: StepContext) -> None:
        layout = self._check(params)
        with torch.no_grad():
            if state is not self._live:
                self.restore(state)
            grads = [
                reconstruct(ctx.noisy[i], ctx.noisy[j], layer.carrier_L.weight, layer.carrier_R.weight)
                for (_, layer), i, j in zip(self.layers, layout.left, layout.right, strict=True)
            ]
            others = [params[i] for i in layout.others]
            inner_ctx = dataclasses.replace(
                ctx,
                noisy=grads + [ctx.noisy[i] for i in layout.others],
                noisy_square=None,
                clean=None,
                side=None,
            )
            self.inner.decay_mask = self._inner_mask(layout)
            self.inner.update(state["weight"] + others, state["inner"], inner_ctx)
            step = int(ctx.step)
            state["step"] = step
            for k, (_, layer) in enumerate(self.layers):
                weight = state["weight"][k]
                accumulated = layer.warmup_steps is not None and step + 1 > layer.warmup_steps
                delta = weight - state["origin"][k] if accumulated else weight
                on = {"dtype": weight.dtype, "device": weight.device}
                start = power_start(weight.shape[1], layer.rank, self.seed, step + 1, k, **on)
                layer.set_carriers(weight, *decompose(delta, layer.rank, layer.power_iters, start))
        self._live = state

    def trained_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what training updates: each reparametrized layer's weight W (``<layer>.weight``; the
        live tensor of the state, or W~ + L R before ``init``) and every other trained tensor (by its parameter
        name). Live tensors: clone them to compare across steps."""
        state = self._live
        if state is not None:
            weights = list(state["weight"])
        else:
            with torch.no_grad():
                weights = [layer.weight().detach() for _, layer in self.layers]
        out = [(f"{name}.weight", w) for (name, _), w in zip(self.layers, weights, strict=True)]
        carriers = {id(layer.carrier_L.weight) for _, layer in self.layers}
        carriers |= {id(layer.carrier_R.weight) for _, layer in self.layers}
        out += [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in carriers]
        return out


def method(model: nn.Module, args: dict) -> Finetuned:
    """``task.finetune=rgp``: the target weights reparametrized with gradient carriers (:func:`reparametrize`), and
    the variant wrapped to rebuild their updates from the carriers' noisy gradients (:class:`RGPVariant`)."""
    summary = reparametrize(model, args)
    return Finetuned(model, summary, wrap_variant=lambda variant, m, seed: RGPVariant(variant, m, seed))
