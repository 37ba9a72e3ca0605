"""How one training step reaches the privatizer, for the two kinds of task the one trainer runs.

* :class:`ModelBackend` — an ``nn.Module`` task: the logical batch is split into physical micro-batches (and, data
  parallel, into each rank's share), a clipping engine returns each micro-batch's sum of clipped per-example
  gradients, and the global sum goes to :meth:`Privatizer.release_sum`.
* :class:`VectorBackend` — a closed-form toy task (``per_example_grads``) whose independent trials are vectorised
  along a leading dimension of the parameters: per-example gradients go to :meth:`Privatizer.release_per_example`.

Both give the trainer the same things: the parameters, one private release per step, the mean gradient of public
side-information examples, an evaluation, and the extra summary fields of their kind of task.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch.utils import _pytree as pytree

from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.privatizer import Privatizer, Release
from dp_adam_bench.engine.probe import clipped_sum, probe
from dp_adam_bench.engine.self_check import DEFAULT_TOLERANCE, self_check, tolerance_for
from dp_adam_bench.errors import ConfigError


def refuse_half_precision(model: torch.nn.Module, fix: str) -> None:
    """A model cast to bf16 / fp16 would keep its optimizer state, noise and updates in half precision (an Adam
    update below the parameter's resolution, 2^-8 relative in bf16, is lost) and have its norms computed in it:
    refused (``make_private`` and every task's model), with ``fix``, the way to train in bf16 that keeps all of
    those in fp32."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            raise ConfigError(
                f"model parameter {name!r} is {p.dtype}: keep the model in fp32 and {fix} (bf16 autocast, with "
                "fp32 parameters, norms, noise and optimizer state)"
            )


class VectorBackend:
    """Closed-form toy tasks: parameters with a leading trials dimension, gradients from the task itself."""

    kind = "vector"

    def __init__(self, task):
        self.task = task
        self.params = task.init_params()
        self.trial_dims = int(getattr(task, "trial_dims", 0))
        self.device = self.params[0].device

    @property
    def numel_per_trial(self) -> int:
        """Coordinates of all trials together (the noise mechanism's buffers hold every trial's noise)."""
        return sum(p.numel() for p in self.params)

    supports_scale = True  # per-example gradients are materialised

    def release(self, idx: torch.Tensor, privatizer: Privatizer, scale) -> Release:
        return privatizer.release_per_example(self.task.per_example_grads(self.params, idx), scale)

    def public_grad(self, pick: torch.Tensor) -> list[torch.Tensor]:
        """Mean gradient of the public side-information examples ``pick`` (no clipping, no noise), per trial."""
        return [g.mean(0) for g in self.task.per_example_grads(self.params, pick)]

    def evaluate(self, *, final: bool) -> dict:
        metrics = self.task.evaluate(self.params)
        return {f"{k}_mean": float(v.mean()) for k, v in metrics.items()} | {
            f"{k}_std": float(v.std(unbiased=False)) for k, v in metrics.items()
        }

    def final_summary(self, variant, state) -> dict:
        final = self.task.evaluate(self.params)
        if hasattr(
            self.task, "final_diagnostics"
        ):  # optional: per-trial quantities of the final optimizer state
            final = final | self.task.final_diagnostics(self.params, variant, state)
        return {
            "metrics": {k: float(v.mean()) for k, v in final.items()}
            | {f"{k}_std": float(v.std(unbiased=False)) for k, v in final.items()},
            "trials": {k: v.tolist() for k, v in final.items()},
            "n_trials": int(final[next(iter(final))].numel()),
            "ground_truth": self.task.ground_truth_loss()
            if hasattr(self.task, "ground_truth_loss")
            else None,
        }

    def close(self) -> None:
        pass


class ModelBackend:
    """``nn.Module`` tasks: micro-batches through a clipping engine, sums all-reduced across data-parallel ranks."""

    kind = "model"

    def __init__(
        self, task, model, engine_name: str, physical_batch_size: int, ddp, device, precision="fp32"
    ):
        self.task, self.model, self.ddp, self.device = task, model, ddp, device
        self.precision = precision
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:  # every engine and the noise need at least one tensor to train
            frozen = sum(1 for _ in model.parameters())
            raise ConfigError(
                f"the model ({type(model).__name__}) has no trainable parameters ({frozen} parameter tensor(s), "
                "none with requires_grad=True): nothing to train privately; unfreeze the layers to train "
                "(p.requires_grad_(True))"
            )
        refuse_half_precision(model, "set train.precision=bf16")
        self.engine_name = engine_name
        self.engine = build_engine(engine_name, model, task.loss_per_example)
        self.physical = int(physical_batch_size)
        self.trial_dims = 0
        self._counts = torch.zeros(2, dtype=torch.float64, device=device)
        self.last_norms: torch.Tensor | None = None  # the last step's per-example norms (diagnostic)
        self.last_loss: torch.Tensor | None = None  # the last step's mean loss (diagnostic; :meth:`release`)

    @property
    def numel_per_trial(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def supports_scale(self) -> bool:
        return self.engine.supports_scale

    def release(self, idx: torch.Tensor, privatizer: Privatizer, scale) -> Release:
        """The logical batch ``idx``: this rank's share in physical micro-batches, clipped sums all-reduced, then
        the privatizer's releases. Counts for :meth:`clipped_fraction` and the per-example norms
        (:attr:`last_norms`, diagnostic: never released) stay on the device (no host sync), and so does the mean
        loss over the examples clipped here (:attr:`last_loss`, diagnostic: never released), summed from what the
        engine's forward computed (no extra pass); None when the engine does not see the losses (loop,
        functorch) or no example was clipped."""
        ddp, clip = self.ddp, privatizer.clip
        summed = None  # the first micro-batch's sums (fresh tensors), then the others added to them
        norms = []
        loss_sum, losses_seen = None, True
        self._counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # (examples, clipped) here
        self.model.train()
        share = idx[ddp.rank :: ddp.world]  # this rank's share of the logical batch
        order = getattr(self.task, "micro_batch_order", None)
        if order is not None:  # e.g. similar lengths together: less padding; the clipped sum is order-free
            share = order(share)
        for chunk in share.split(self.physical):
            if not len(chunk):  # an empty Poisson batch, or fewer examples than ranks: noise only
                continue
            batch = {k: v.to(self.device) for k, v in self.task.get_batch(chunk).items()}
            with self._autocast():
                cs = self.engine.clipped_sum(batch, clip, scale)
            if summed is None:
                summed = cs.summed
            else:
                for acc, s in zip(summed, cs.summed, strict=True):
                    acc.add_(s)
            cs.summed = None  # not held through the release
            norms.append(cs.norms.detach())
            if cs.loss_sum is None:
                losses_seen = False
            else:
                loss_sum = cs.loss_sum if loss_sum is None else loss_sum + cs.loss_sum
            self._counts[0] += cs.norms.numel()
            if clip:
                self._counts[1] += (cs.norms > clip).sum()
        self.last_norms = torch.cat(norms) if norms else torch.zeros(0, device=self.device)
        examples = sum(n.numel() for n in norms)
        self.last_loss = loss_sum / examples if losses_seen and loss_sum is not None and examples else None
        if summed is None:
            summed = [torch.zeros_like(p) for p in self.params]
        ddp.all_reduce_(summed)  # the global sum of clipped gradients, before any noise
        return privatizer.release_sum(summed, scale)

    def _autocast(self):
        """``train.precision=bf16``: the model's forward and backward under bf16 autocast; the engine computes the
        per-example norms, clip factors and clipped sums in the parameters' precision (fp32), and the noise and
        the optimizer state stay fp32 (engine/bk.py)."""
        return torch.autocast(
            torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.precision == "bf16"
        )

    def self_check(self, examples: torch.Tensor, clip: float | None, settings, equalize: bool = True) -> dict:
        """The engine against the size-one loop on the private ``examples`` (dataset indices, chosen at random by
        :class:`~dp_adam_bench.engine.watch.EngineWatch`; :mod:`dp_adam_bench.engine.self_check`); raises
        ConfigError on a mismatch. Under bf16 it compares the autocast path at the bf16 tolerance and the full fp32
        path at the configured one."""
        settings = settings or {}
        if not settings.get("enabled", True):
            return {"enabled": False}
        if len(examples) == 0:
            return {"enabled": True, "examples": 0}
        batch = {name: v.to(self.device) for name, v in self.task.get_batch(examples).items()}
        configured = float(settings.get("tolerance", DEFAULT_TOLERANCE))
        tol = tolerance_for(configured, self.precision)
        fp32_tol = configured if self.precision == "bf16" else None
        record = self_check(
            self.engine, batch, clip, tol, autocast=self._autocast, fp32_tolerance=fp32_tol, equalize=equalize
        )
        return record | {"precision": self.precision}

    def probe(
        self, examples: torch.Tensor, generator: torch.Generator | None = None, clip: float | None = None
    ) -> dict:
        """The engine's unclipped gradient and norm of the first of ``examples`` whose gradient is not all zero
        against autograd's
        (:mod:`dp_adam_bench.engine.probe`), whether or not the self-check is on: refuses a parameter the engine
        does not see every use of; ``generator`` perturbs the weights for parameters whose gradient is zero."""
        if not len(examples):
            return {"examples": 0}
        for i in range(
            len(examples)
        ):  # the first example whose gradient is not all zero (a masked-out example's is)
            one = {k: v.to(self.device) for k, v in self.task.get_batch(examples[i : i + 1]).items()}
            record = probe(self.engine, one, generator, clip)
            if len(record["unverified"]) < len(self.params):
                break
        return record

    def dry_pass(self, examples: torch.Tensor, clip: float | None) -> None:
        """One engine pass on two of ``examples`` exactly as a training step makes it (train mode, dropout as
        configured, the step's autocast) under a forked random state, releasing nothing: what the engine refuses
        only on the training path (a module without a bk rule whose forward draws dropout masks; the probe and
        the self-check set dropout to 0) is refused here, before the run folder exists, not at the first step."""
        if not len(examples):
            return
        batch = {k: v.to(self.device) for k, v in self.task.get_batch(examples[:2]).items()}
        devices = [self.device] if torch.device(self.device).type == "cuda" else []
        training = self.model.training
        try:
            with torch.random.fork_rng(devices=devices), self._autocast():
                self.model.train()
                clipped_sum(self.engine, batch, clip)
        finally:
            self.model.train(training)

    def example_sizes(self, examples: torch.Tensor) -> torch.Tensor:
        """Each of the private ``examples``' size (dataset indices; the engine watch takes a batch's longest and
        shortest, :class:`~dp_adam_bench.engine.watch.EngineWatch`): its non-padding positions where the task's
        batch has an ``attention_mask`` (or another integer or boolean ``...mask``), else the non-zero entries of
        every tensor of the batch that leads with the examples. The task's random state (augmentation) is left as
        it was."""
        saved = self.task.rng_state() if hasattr(self.task, "rng_state") else None
        try:
            batch = self.task.get_batch(examples)
        finally:
            if saved is not None:
                self.task.load_rng_state(saved)
        n = len(examples)

        def nonzero(t) -> torch.Tensor:
            return (t != 0).reshape(n, -1).sum(1).cpu()

        names = [k for k in batch if k.endswith("mask")] if isinstance(batch, dict) else []
        for name in sorted(names, key=lambda k: k != "attention_mask"):  # the tokenizer's first
            mask = batch[name]
            if (
                isinstance(mask, torch.Tensor)
                and mask.dim() >= 2
                and mask.shape[0] == n
                and not mask.is_floating_point()
            ):
                return nonzero(mask)
        size = torch.zeros(n, dtype=torch.long, device="cpu")
        for t in pytree.tree_leaves(batch):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n:
                size += nonzero(t)
        return size

    def engine_check(
        self, examples: torch.Tensor, generator, clip: float | None, settings, start: bool = True
    ) -> dict:
        """:meth:`probe` and :meth:`self_check` on ``examples`` (the check of :class:`EngineWatch`): ``{"probe",
        "self_check", "max_rel_error", "unverified"}``; a parameter is unverified when neither saw its gradient
        non-zero (the probe's perturbed weights included). ``start``: the start-up check, which also makes one
        engine pass as training does (:meth:`dry_pass`) and compares the equalized norms."""
        # the task's own random state (augmentation) as the check found it: a check reads examples through
        # get_batch, and the run's result must not depend on how many checks it made
        saved = self.task.rng_state() if hasattr(self.task, "rng_state") else None
        try:
            if (
                start
            ):  # what the training path refuses is refused before the run folder exists; later, training does
                self.dry_pass(examples, clip)
            probed = self.probe(examples, generator, clip)
            check = self.self_check(examples, clip, settings, equalize=start)
        finally:
            if saved is not None:
                self.task.load_rng_state(saved)
        unverified = set(probed.get("unverified", []))
        if check.get("examples"):
            unverified &= set(check.get("unverified", []))
        errs = [r["max_rel_error"] for r in (probed, check) if "max_rel_error" in r]
        return {
            "probe": probed,
            "self_check": check,
            "max_rel_error": max(errs) if errs else math.nan,
            "unverified": sorted(unverified),
        }

    def clipped_fraction(self, clip: float | None) -> dict:
        """Diagnostic: the fraction of the last step's examples whose norm exceeded C (a collective under DDP)."""
        counts = self._counts.clone()
        self.ddp.all_reduce_([counts])
        return {"diag/frac_clipped": float(counts[1] / counts[0]) if clip and counts[0] > 0 else 0.0}

    def public_grad(self, pick: torch.Tensor) -> list[torch.Tensor]:
        """Mean gradient of the public side-information batch ``pick`` (the same indices on every rank).
        Data-parallel: rank r takes ``pick[r::world]`` and the count-weighted means are all-reduced."""
        ddp = self.ddp
        if not ddp.active:
            return self.engine.mean_grad({k: v.to(self.device) for k, v in self.task.get_batch(pick).items()})
        mine = pick[ddp.rank :: ddp.world]
        if len(mine):
            grads = self.engine.mean_grad(
                {k: v.to(self.device) for k, v in self.task.get_batch(mine).items()}
            )
            grads = [g * len(mine) for g in grads]
        else:
            grads = [torch.zeros_like(p) for p in self.params]
        ddp.all_reduce_(grads)
        return [g / len(pick) for g in grads]

    def evaluate(self, *, final: bool) -> dict:
        """``task.evaluate(model)``, telling tasks whose ``evaluate`` takes ``final`` whether this is the run's
        last evaluation (e2e_gpt2 decodes the test MRs, its costly part, only then)."""
        self.model.eval()
        with torch.no_grad():
            if "final" in inspect.signature(self.task.evaluate).parameters:
                return self.task.evaluate(self.model, final=final)
            return self.task.evaluate(self.model)

    def final_summary(self, variant, state) -> dict:
        return {}

    def close(self) -> None:
        self.engine.close()
