"""The public API: private training of your own model, in your own loop, with any variant and noise mechanism.

>>> import dp_adam_bench as dab
>>> private = dab.make_private(model, dataset, loss_fn, optimizer="adambc", noise="bandmf",
...                            noise_args={"bands": 4}, clip=1.0, sigma=1.0, batch_size=64, epochs=3, lr=1e-3)
>>> while not private.done:
...     private.step()
>>> private.epsilon()          # {"rdp": ..., "prv": ..., "pld": ..., "gdp_clt": ...}
>>> private.guarantee()        # {"accountant": "rdp", "epsilon": ..., "target_accountant": ..., ...}

:func:`make_private` turns its arguments into the same configuration the command line builds
(``python -m dp_adam_bench.train task=... optimizer=... noise=...``), validates it with the same checks, and builds
the same :class:`~dp_adam_bench.engine.session.PrivateTraining` the CLI trainer drives: there is no second path.
So it refuses what the CLI refuses (correlated noise with Poisson sampling, a batch larger than the data set, a NaN
sigma, ...) with the same :class:`~dp_adam_bench.errors.ConfigError`.

Your objects:

* ``model`` — an ``nn.Module`` (on CPU or CUDA); trained in place. Its per-example loss must depend on that example
  only (no BatchNorm: use GroupNorm or LayerNorm).
* ``dataset`` — anything with ``len()`` and ``[i]`` returning either ``(input, target)`` pairs or dicts of tensors.
  Batches are collated with ``torch.utils.data.default_collate``.
* ``loss_fn(output, target)`` — one loss per example, shape ``(batch,)`` (e.g.
  ``nn.CrossEntropyLoss(reduction="none")``). For pairs, ``output = model(input)``; for dicts,
  ``output = model(**inputs)`` with every key but ``target_key`` as input and ``target = batch[target_key]``. An
  encoder-decoder (T5, BART: ``config.is_encoder_decoder``) given the tokenizer's batch (``input_ids``,
  ``attention_mask``, ``labels``) gets ``decoder_input_ids`` built from the labels as its own forward would
  (:mod:`dp_adam_bench.engine.seq2seq`), and ``loss_fn`` the labels, aligned with the logits.

Sampling follows the accountant: Poisson sampling with ``noise="independent"`` (DP-SGD's accountants), cyclic
fixed-size batches (``sampler="single_pass"``) for correlated noise, accounted as one Gaussian mechanism without
amplification (Choquette-Choo et al. 2023, arXiv 2211.06530), or cyclic Poisson sampling with BandMF, accounted
as amplified BandMF (Choquette-Choo et al. 2023, arXiv 2306.08153). The gradient is divided by the *expected* batch
size.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from dp_adam_bench.engine.backends import refuse_half_precision
from dp_adam_bench.engine.seq2seq import with_decoder_inputs
from dp_adam_bench.engine.session import PrivateTraining
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import CONFIG_DIR
from dp_adam_bench.tasks.base import ModelTask

__all__ = ["make_private", "PrivateTraining", "ConfigError"]


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _load_group(group: str, name: str, field: str) -> dict:
    options = _group_options(group)
    if name not in options:
        raise ConfigError(f"{field}={name!r} is not known; valid: {', '.join(options)}")
    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml"))


def _root_config() -> dict:
    root = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"))
    for key in ("defaults", "hydra"):
        root.pop(key, None)
    return root


class UserTask(ModelTask):
    """Your model, data set and loss as the engine's task interface (:class:`~dp_adam_bench.tasks.base.ModelTask`).

    ``public``: side information's public examples (make_private's ``public_dataset``), served after the private
    ones: index ``i < N`` is ``dataset[i]``, index ``N + j`` is ``public[j]``. ``dataset_size`` is N, so the
    sampler, the accountant and every check of the private data see ``dataset`` alone
    (:func:`~dp_adam_bench.engine.trainer.population_and_public`)."""

    name = "custom"
    #: the public set's name in the overlap check's messages (engine/public_data.py)
    public_name = "public_dataset"

    def __init__(
        self,
        model: nn.Module,
        dataset,
        loss_fn: Callable,
        target_key: str,
        evaluate: Callable | None,
        public=None,
    ):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._n = _size_of(dataset, "dataset")
        if not callable(loss_fn):
            raise ConfigError(
                f"loss_fn must be callable (output, target) -> per-example losses, got {loss_fn!r}"
            )
        reduction = getattr(loss_fn, "reduction", "none")
        if reduction != "none":
            raise ConfigError(
                f"loss_fn.reduction={reduction!r}: DP needs one loss per example; use reduction='none'"
            )
        self.model, self.dataset, self.loss_fn = model, dataset, loss_fn
        self.target_key, self._evaluate = target_key, evaluate
        first = dataset[0]
        if isinstance(first, Mapping):
            if target_key not in first:
                raise ConfigError(
                    f"target_key={target_key!r} is not a key of the dataset's items ({', '.join(map(str, first))})"
                )
            self.pairs = False
        elif isinstance(first, (tuple, list)) and len(first) == 2:
            self.pairs = True
        else:
            raise ConfigError(
                f"dataset items must be (input, target) pairs or dicts of tensors; item 0 is {type(first).__name__}"
            )
        self.public = public
        #: the number of public examples (0 without a public set: nothing is ever cut from ``dataset``)
        self.public_size = 0 if public is None else _size_of(public, "public_dataset")
        if public is not None:
            self._check_like_dataset(public[0], first)

    def _check_like_dataset(self, item, first) -> None:
        """The public examples have the private ones' form: pairs, or dicts with the same keys."""
        if self.pairs:
            ok, form = isinstance(item, (tuple, list)) and len(item) == 2, "(input, target) pairs"
        else:
            ok = isinstance(item, Mapping) and set(item) == set(first)
            form = f"dicts with the keys {', '.join(map(str, first))}"
        if not ok:
            got = ", ".join(map(str, item)) if isinstance(item, Mapping) else type(item).__name__
            raise ConfigError(f"public_dataset item 0 is not like dataset's items ({form}); it is {got}")

    @property
    def dataset_size(self) -> int:
        return self._n

    def build_model(self) -> nn.Module:
        return self.model

    def _source(self, i: int):
        """(the data set, its index) of example ``i``: ``dataset`` below N, ``public`` from N on."""
        return (self.dataset, i) if i < self._n else (self.public, i - self._n)

    def example_content(self, i: int):
        """What identifies example ``i`` for the public / private overlap check
        (:func:`~dp_adam_bench.engine.public_data.check_disjoint`): the data set's own ``example_content(j)`` where
        it has one (an example before random augmentation, a row before collation), else its ``[j]``."""
        data, j = self._source(int(i))
        own = getattr(data, "example_content", None)
        return own(j) if callable(own) else data[j]

    def get_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        from torch.utils.data import default_collate

        batch = default_collate([data[j] for data, j in (self._source(int(i)) for i in indices)])
        if self.pairs:
            return {"inputs": batch[0], "targets": batch[1]}
        return dict(batch)

    def loss_per_example(self, forward, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.pairs:
            output, target = forward(batch["inputs"]), batch["targets"]
        else:
            target = batch[self.target_key]
            inputs = {k: v for k, v in batch.items() if k != self.target_key}
            # an encoder-decoder fed the tokenizer's batch: its decoder reads the labels shifted (engine/seq2seq.py)
            output = forward(**with_decoder_inputs(self.model, inputs, target))
        losses = self.loss_fn(output, target)
        n = len(target)
        if not isinstance(losses, torch.Tensor) or losses.shape != (n,):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(
                f"loss_fn returned {shape} for a batch of {n}: it must return one loss per example, shape ({n},) "
                "(reduce any per-token or per-pixel losses within each example)"
            )
        return losses

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return dict(self._evaluate(model)) if self._evaluate is not None else {}


def _size_of(dataset, name: str) -> int:
    """``len(dataset)``, refused unless a map-style data set with at least one example."""
    try:
        n = len(dataset)
    except TypeError as err:
        raise ConfigError(
            f"{name} must have len() and [i] (a map-style Dataset); got {type(dataset).__name__}"
        ) from err
    if n < 1:
        raise ConfigError(f"{name} is empty")
    return n


def _errors_in_api_terms(fn):
    """``fn`` whose ConfigErrors name its arguments, not the CLI fields they set (:func:`in_api_terms`): one error,
    not a chain (the same cause, the message in the function's terms)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            raise type(err)(in_api_terms(str(err))) from err.__cause__

    return wrapper


# longer than 80 lines only by its signature and docstring (every argument of the public API, documented); the
# body is the named steps below
@_errors_in_api_terms
def make_private(
    model: nn.Module,
    dataset,
    loss_fn: Callable,
    *,
    optimizer: str = "adambc",
    noise: str = "independent",
    clip: float | None = 1.0,
    sigma: float | None = None,
    target_epsilon: float | None = None,
    epsilon_budget: float | None = None,
    delta: float = 1e-5,
    batch_size: float,
    steps: int | None = None,
    epochs: float | None = None,
    sampler: str | None = None,
    accountant: str = "rdp",
    lr: float | None = None,
    lr_schedule: str = "constant",
    lr_warmup_steps: int = 0,
    optimizer_args: Mapping[str, Any] | None = None,
    weight_decay: float | None = None,
    weight_decay_mask: Callable[[str, nn.Parameter], bool] | None = None,
    noise_args: Mapping[str, Any] | None = None,
    clipping: str = "bk",
    physical_batch_size: int | None = None,
    precision: str = "fp32",
    target_key: str = "labels",
    evaluate: Callable[[nn.Module], Mapping[str, float]] | None = None,
    seed: int = 0,
    secure_rng: bool = False,
    self_check: bool = True,
    engine_watch_every: int | str = "auto",
    post_processing_check: int | str = "auto",
    finetune: str | None = None,
    finetune_args: Mapping[str, Any] | None = None,
    public_dataset=None,
) -> PrivateTraining:
    """Make ``model`` train privately on ``dataset``: returns a :class:`PrivateTraining` whose ``step()`` draws the
    batch the accountant assumes, clips each example's gradient (``clipping``: ``bk``, ``ghost``, ``hooks``,
    ``functorch`` or ``loop``), adds the mechanism's noise and updates the model with the variant.

    Privacy: give ``sigma`` (noise multiplier), or ``target_epsilon`` with ``sigma=None`` to calibrate sigma over
    the whole schedule (Poisson), or ``target_epsilon`` with ``sigma`` and ``steps=None`` to train until it.
    ``epsilon_budget`` stops a Poisson run before the step that would exceed it. ``noise="none"`` trains without
    noise or clipping (a non-private baseline).

    Schedule: ``steps`` (Poisson, cyclic Poisson) or ``epochs`` (those: ``round(epochs * N / batch_size)``
    steps; fixed-size samplers: full passes). ``sampler`` defaults to ``poisson`` for independent noise and
    ``single_pass`` for correlated noise (``dpmf_sqrt``, ``bandmf``, ``blt``); ``cyclic_poisson`` gives BandMF
    amplification by sampling (Choquette-Choo et al. 2023, arXiv 2306.08153), ``balls_in_bins`` and ``shuffle``
    are the others (the README's "What the engine guarantees" says how each is accounted).

    ``optimizer``: a variant of ``configs/optimizer/`` (``sgd``, ``adam``, ``adambc``, ``bc``, ``ime``, ``stp``,
    ...) with its defaults, ``lr`` and ``optimizer_args`` overriding them; ``noise``: ``none``, ``independent``,
    ``dpmf_sqrt``, ``bandmf`` (``noise_args={"bands": b}``), ``blt`` (``{"buffers": k}``).

    ``public_dataset``: public data, for ``optimizer="side_info"`` alone (Ganesh, McMahan & Thakurta 2025, Alg. 9:
    the second moment from the gradient of a public batch), and required by it; refused for any other variant,
    which would ignore it. Items of the same form as ``dataset``'s. Its examples reach every update unclipped and
    un-noised and cost no privacy, so they must be public: none of them is ever cut from ``dataset`` (N, the
    sampler's population and the accountant's, is ``len(dataset)``), each step draws
    ``train.side_info.batch_size`` (256) of them with replacement, and a public example whose content equals a
    private one's (the same fields, dtypes, shapes and values, in any order or position) refuses the run with
    :class:`~dp_adam_bench.errors.PrivacyMismatch` naming how many. What that comparison cannot see (near-duplicates,
    the same text tokenized differently): :func:`~dp_adam_bench.engine.public_data.example_digest`. A data set may
    define ``example_content(i)``, what identifies its example ``i`` for it (an image before random augmentation).

    ``lr_schedule``: ``constant`` or ``linear`` (``lr_warmup_steps`` of linear warm-up, then linear decay towards 0
    at the last step; :mod:`dp_adam_bench.optim.schedule`).

    ``weight_decay``: lambda (overrides the variant's default: 0, or 0.01 for ``adamw`` / ``adamw_bc``), coupled
    (L2, as ``torch.optim.Adam(weight_decay=...)``) or decoupled (as ``torch.optim.AdamW``) per
    ``optimizer_args['weight_decay_mode']``; data-independent, so post-processing. ``weight_decay_mask(name,
    parameter) -> bool`` says which of ``model.named_parameters()`` decay; by default all but biases and
    normalisation weights (Hugging Face Trainer's rule, :mod:`dp_adam_bench.optim.decay`; every one with
    ``optimizer_args={'decay_exclude': 'none'}``).

    ``private.guarantee()`` names the accountant of each privacy number: the epsilon reported (``accountant``, the
    argument), and the accountant that met ``target_epsilon`` or enforces ``epsilon_budget`` (``exact_gaussian``
    for a non-amplified release, whose epsilon is computed exactly: e.g. BandMF on single-pass batches calibrated
    to epsilon = 4 shows a larger epsilon under ``rdp``, a looser bound on the same release).

    ``precision``: ``fp32`` (the default) or ``bf16``: the forward and backward under bf16 autocast, while the
    parameters, the per-example norms, clip factors and clipped sum, the noise and the optimizer state stay fp32
    (``clipping="bk"`` only; the CLI's ``train.precision=bf16``). Keep the model itself in fp32: a model whose
    trainable parameters are bf16 or fp16 is refused, since its optimizer state, noise and updates would be kept
    in half precision (updates below the parameters' resolution are lost) and its norms computed in it.

    ``private.step()`` returns a :class:`~dp_adam_bench.engine.session.StepResult`: the step, the batch size and,
    as diagnostics (computed on the private batch, not released by the mechanism), each example's gradient norm
    before clipping (``result.norms``), the fraction clipped (``result.frac_clipped``) and the batch's mean loss
    from the step's own forward (``result.loss_nonprivate``, a 0-dim tensor; None with the loop and functorch
    engines); and the plan's sampling rate ``result.q`` (public; None for fixed-size batches).

    ``evaluate(model) -> dict`` is optional: your own metrics, which ``private.evaluate()`` returns (the model in
    eval mode, without gradients).
    ``self_check``: before the first step, the engine's per-example norms and clipped sum for a few of your
    examples are compared with the loop over batches of size one on your model; a mismatch refuses the run before
    any noise is released (``private.self_check`` holds the measured error). ``False`` skips it.
    ``engine_watch_every``: the engine probe (and the self-check, when on) again on the weights training reaches
    and random examples (:mod:`dp_adam_bench.engine.watch`): ``"auto"`` within 2 % of the measured step time, an
    integer N every N steps, 0 only after :meth:`~PrivateTraining.load_state_dict`. A failure raises
    :class:`~dp_adam_bench.engine.watch.EngineCheckFailed` from ``step()`` before its release.
    ``post_processing_check``: steps replayed with another private batch behind the same noisy release, everything
    the step emits compared bit for bit (:mod:`dp_adam_bench.engine.post_processing`): ``"auto"`` at the first step,
    after a resume and within 2 % of the training time, an integer N every N steps, 0 the first step and after a
    resume only, ``"off"`` never. A difference raises
    :class:`~dp_adam_bench.engine.post_processing.PostProcessingLeak` before the next release. What you log or share
    after a step should come from ``private.add_emitter(name, row)`` (compared at checked steps) and
    ``private.emit_row(name, result)``.
    ``finetune``: which parameters train (:mod:`dp_adam_bench.finetune`): None (as ``model`` has them),
    ``"full"``, ``"head"``, ``"top<k>"`` (the last k transformer blocks), ``"lora"`` and ``"prefix"`` (from peft),
    ``"rgp"`` (Yu et al. 2021); ``finetune_args`` their settings (``{"r": 8}`` for LoRA). Applied to ``model`` in
    place (prefix-tuning wraps it: train ``private.model``); frozen parameters never enter clipping or noise. After
    ``train.moved_check`` (3) steps every trainable tensor must have moved, or ``step()`` raises
    :class:`~dp_adam_bench.finetune.moved.NotTraining` naming those that did not.
    Seeds: ``seed`` fixes the sampler, the noise and dropout (this re-seeds torch's global generator);
    ``secure_rng=True`` draws them from the OS CSPRNG instead (for real private data; not reproducible).

    Bad arguments raise :class:`~dp_adam_bench.errors.ConfigError` in one line naming the argument as given here
    (``clip=None``, ``clipping=ghost``, ``optimizer_args['beta1']``), not the CLI field it sets.
    """
    cfg = _config_with_groups(optimizer, noise, seed)
    cfg["task"].update(finetune=finetune, finetune_args=dict(finetune_args or {}))
    _set_optimizer_args(cfg["optimizer"], optimizer_args, lr, weight_decay, weight_decay_mask)
    _merge(cfg["noise"], dict(noise_args or {}), "noise_args")
    cfg["privacy"].update(
        clip=clip,
        sigma=sigma,
        target_epsilon=target_epsilon,
        epsilon_budget=epsilon_budget,
        delta=delta,
        accountant=accountant,
        secure_rng=secure_rng,
    )
    sampler = _sampler_for(cfg["noise"], sampler, precision)
    task = UserTask(model, dataset, loss_fn, target_key, evaluate, public_dataset)
    _refuse_public_mismatch(cfg["optimizer"]["name"], task.public_size)
    refuse_half_precision(model, "pass precision='bf16'")
    train = cfg["train"]
    train.update(
        sampler=sampler,
        batch_size=batch_size,
        clipping=clipping,
        distributed="off",
        lr_schedule=lr_schedule,
        lr_warmup_steps=lr_warmup_steps,
        precision=precision,
    )
    train["device"] = _device_on_cpu_or_cuda(model)
    _set_engine_checks(train, self_check, engine_watch_every, physical_batch_size)
    train["post_processing_check"] = _post_processing_settings(post_processing_check)
    _set_length(train, sampler, steps, epochs, batch_size, task.dataset_size)
    run = _prepared_run(cfg, task)
    if weight_decay_mask is not None:
        _set_decay_mask(run, model, weight_decay_mask)
    _warn_if_shuffled(run.plan)
    return PrivateTraining(run)


def _config_with_groups(optimizer: str, noise: str, seed: int) -> dict:
    """The root config (``configs/config.yaml``) with the variant's and the mechanism's groups, the default privacy
    and logger groups, and the seed."""
    cfg = _root_config()
    cfg["task"] = {"name": UserTask.name}
    cfg["optimizer"] = _load_group("optimizer", optimizer, "optimizer")
    cfg["noise"] = _load_group("noise", noise, "noise")
    cfg["privacy"] = _load_group("privacy", "default", "privacy")
    cfg["logger"] = _load_group("logger", "default", "logger")
    cfg["seed"] = seed
    return cfg


def _set_optimizer_args(optimizer: dict, optimizer_args, lr, weight_decay, weight_decay_mask) -> None:
    """``optimizer_args``, ``lr`` and ``weight_decay`` over the variant's defaults; ``weight_decay_mask`` must be a
    callable (it is applied once the model's parameters are known)."""
    _merge(
        optimizer,
        dict(optimizer_args or {})
        | ({"lr": lr} if lr is not None else {})
        | ({"weight_decay": weight_decay} if weight_decay is not None else {}),
        "optimizer_args",
    )
    if weight_decay_mask is not None and not callable(weight_decay_mask):
        raise ConfigError(
            f"weight_decay_mask={weight_decay_mask!r} must be a callable (name, parameter) -> bool, or None"
        )


def _refuse_public_mismatch(optimizer: str, public_size: int) -> None:
    """Before anything touches the model (``finetune`` changes it in place): a side-information variant needs
    ``public_dataset``, any other refuses one (:func:`~dp_adam_bench.engine.public_data.refuse_public_mismatch`)."""
    from dp_adam_bench.engine.public_data import refuse_public_mismatch
    from dp_adam_bench.optim.registry import VARIANTS

    refuse_public_mismatch(optimizer, VARIANTS.get(optimizer).needs_side_info, public_size)


def _sampler_for(noise: dict, sampler: str | None, precision: str) -> str:
    """``sampler``, by default the one the mechanism is accounted with (single_pass for correlated noise, else
    poisson); an unknown sampler or precision is refused here, before the sampler picks steps or epochs."""
    from dp_adam_bench.config import PRECISIONS
    from dp_adam_bench.engine.samplers import SAMPLERS
    from dp_adam_bench.privacy.noise_factory import NOISE

    correlated = NOISE.get(noise["kind"]).correlated
    sampler = sampler or ("single_pass" if correlated else "poisson")
    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler={sampler!r} is not known; valid: {', '.join(SAMPLERS.names())}")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not known; valid: {', '.join(PRECISIONS)}")
    return sampler


def _device_on_cpu_or_cuda(model: nn.Module) -> str:
    """The model's device, refused (named as the caller knows it, not as train.device, a field the caller never
    set) unless it is the CPU or a CUDA device."""
    device = _device_of(model)
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(
            f"model is on device {device!r}; make_private trains a model on cpu or cuda (a 'meta' model "
            "has no values): build it there or move it with model.to('cpu')"
        )
    return device


def _set_engine_checks(train: dict, self_check, engine_watch_every, physical_batch_size: int | None) -> None:
    """The engine's self-check (on or off) and watch interval, and the micro-batch size when given."""
    if not isinstance(self_check, bool):
        raise ConfigError(f"self_check={self_check!r} must be True or False")
    train["self_check"] = dict(train.get("self_check") or {}, enabled=self_check)
    train["engine_watch"] = dict(train.get("engine_watch") or {}, every=engine_watch_every)
    if physical_batch_size is not None:
        train["physical_batch_size"] = physical_batch_size


def _post_processing_settings(every) -> dict:
    """``train.post_processing_check`` from make_private's ``post_processing_check``."""
    if every == "off":
        return {"enabled": False}
    if every == "auto" or (isinstance(every, int) and not isinstance(every, bool) and every >= 0):
        return {"enabled": True, "every": every}
    raise ConfigError(
        f"post_processing_check={every!r} must be 'auto', 'off' or an integer >= 0 (every N steps; 0: the first "
        "step and after a resume only)"
    )


def _set_length(train: dict, sampler: str, steps, epochs, batch_size, n: int) -> None:
    """The run's length in the sampler's terms: steps for Poisson and cyclic Poisson (``epochs``: that many
    expected passes), full passes for the fixed-size samplers (one by default)."""
    if steps is not None and epochs is not None:
        raise ConfigError(f"steps={steps!r} and epochs={epochs!r}: give one")
    if sampler in ("poisson", "cyclic_poisson"):
        train["steps"] = _epochs_to_steps(epochs, batch_size, n) if epochs is not None else steps
    else:
        if steps is not None:
            raise ConfigError(
                f"steps={steps!r} with sampler={sampler!r}: fixed-size samplers run full passes; give epochs"
            )
        train["epochs"] = 1 if epochs is None else epochs


def _prepared_run(cfg: dict, task: UserTask):
    """The config validated as the CLI's and the run prepared from it
    (:func:`~dp_adam_bench.engine.trainer.prepare`); a variant or task refusing one of its fields is a
    ConfigError."""
    from dp_adam_bench.config import validate
    from dp_adam_bench.engine.trainer import prepare

    conf = OmegaConf.create(cfg)
    validate(conf, custom_task=True)
    try:
        return prepare(conf, task)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _set_decay_mask(run, model: nn.Module, weight_decay_mask: Callable[[str, nn.Parameter], bool]) -> None:
    """The parameters weight decay acts on: those ``weight_decay_mask(name, parameter)`` keeps (instead of the
    default rule, :mod:`dp_adam_bench.optim.decay`)."""
    from dp_adam_bench.optim.decay import mask_from_names

    run.variant.decay_mask = mask_from_names(model, run.backend.params, weight_decay_mask)


def _warn_if_shuffled(plan) -> None:
    if plan.noisy and plan.sampler.kind == "shuffle":
        warnings.warn(
            "sampler='shuffle' is accounted as Poisson sampling, which it does not implement: its epsilon is not a "
            "guarantee (use sampler='poisson' for DP-SGD's accountants)",
            stacklevel=4,  # the caller of make_private (through this function and _errors_in_api_terms' wrapper)
        )


#: ``make_private``'s argument for each CLI field it sets (a config group's other fields: its ``*_args``)
_API_NAMES = {
    "privacy.clip": "clip",
    "privacy.sigma": "sigma",
    "privacy.target_epsilon": "target_epsilon",
    "privacy.epsilon_budget": "epsilon_budget",
    "privacy.delta": "delta",
    "privacy.accountant": "accountant",
    "privacy.secure_rng": "secure_rng",
    "train.sampler": "sampler",
    "train.batch_size": "batch_size",
    "train.steps": "steps",
    "train.epochs": "epochs",
    "train.clipping": "clipping",
    "train.physical_batch_size": "physical_batch_size",
    "train.precision": "precision",
    "train.lr_schedule": "lr_schedule",
    "train.lr_warmup_steps": "lr_warmup_steps",
    "train.self_check.enabled": "self_check",
    "train.self_check": "self_check",
    "train.engine_watch.every": "engine_watch_every",
    "train.post_processing_check.every": "post_processing_check",
    "train.post_processing_check.enabled": "post_processing_check",
    "train.post_processing_check": "post_processing_check",
    "optimizer.name": "optimizer",
    "optimizer.lr": "lr",
    "optimizer.weight_decay": "weight_decay",
    "noise.kind": "noise",
}
_FIELD = re.compile(
    r"(?<![\w./])(privacy|train|optimizer|noise)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)(=(?:null|true|false)\b)?"
)
_PY_VALUES = {"=null": "=None", "=true": "=True", "=false": "=False"}


def in_api_terms(message: str) -> str:
    """``message`` with the CLI fields :func:`make_private` sets renamed to its arguments: ``privacy.clip=null``
    -> ``clip=None``, ``train.clipping=bk`` -> ``clipping=bk``, ``optimizer.beta1`` -> ``optimizer_args['beta1']``,
    ``noise.bands`` -> ``noise_args['bands']``. Other fields (``train.self_check.tolerance``) are left as named."""

    def rename(m: re.Match) -> str:
        group, key, value = m.group(1), m.group(2), m.group(3) or ""
        field = f"{group}.{key}"
        if field in _API_NAMES:
            name = _API_NAMES[field]
        elif f"{group}.{key.split('.')[0]}" in _API_NAMES:  # train.self_check.x: only its own part renamed
            return m.group(0)
        elif group in ("optimizer", "noise") and "." not in key:
            name = f"{group}_args[{key!r}]"
        else:
            return m.group(0)
        return name + _PY_VALUES.get(value, value)

    return _FIELD.sub(rename, message)


def _merge(into: dict, extra: dict, what: str) -> None:
    """``extra`` over a config group's defaults; unknown keys are refused with the known ones (the variant's
    constructor arguments for the optimizer)."""
    if "name" in extra or "kind" in extra:
        raise ConfigError(
            f"{what} cannot rename the {what.split('_')[0]}: pass it as the first argument instead"
        )
    valid = set(into)
    if what == "optimizer_args":
        from dp_adam_bench.config import variant_fields
        from dp_adam_bench.optim.registry import VARIANTS

        valid |= set(
            variant_fields(VARIANTS.get(into["name"]))
        )  # along the classes: weight_decay from the base
    else:
        valid |= {"max_memory_gb"}
    unknown = sorted(set(extra) - valid)
    if unknown:
        raise ConfigError(
            f"{what}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid - {'name', 'kind'}))}"
        )
    into.update(extra)


def _epochs_to_steps(epochs, batch_size, n: int) -> int:
    if not (isinstance(epochs, (int, float)) and math.isfinite(epochs) and epochs > 0):
        raise ConfigError(f"epochs={epochs!r} must be a finite number > 0")
    if not (isinstance(batch_size, (int, float)) and math.isfinite(batch_size) and batch_size > 0):
        raise ConfigError(f"batch_size={batch_size!r} must be a finite number > 0")
    return max(1, round(epochs * n / batch_size))


def _device_of(model: nn.Module) -> str:
    p = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    return "cpu" if p is None else str(p.device)
