"""Did every trainable tensor move? Checked after the first steps of every model run (issue 45).

Opacus with peft 0.18 trains LoRA weights that never update, and nothing says so; the run reports the pretrained
model's score as the fine-tuned one. Here, after ``train.moved_check`` steps (3 by default: LoRA's A has an exactly
zero gradient until B has moved once, so a noiseless run needs two steps to reach it), each trainable tensor — the
tensors the variant updates, RGP's reconstructed weights rather than its carriers — is compared with its value
before the first step, by an exact digest (the float64 sum and sum of squares of its entries). Any that did not
move are named in one line (:class:`NotTraining`) and the run stops: it is not complete, and no report reads it.

With noise every trainable coordinate receives noise each step, so a tensor that did not move was never updated:
the optimizer does not hold it, or its update is written somewhere the forward pass does not read. Without noise a
tensor also stays put when the loss never reaches it (a layer the forward pass skips); freeze it, or fix the model.

Only steps that can move a tensor count: a step that drew at least one example, or added noise. A noiseless step
on an empty Poisson batch (an expected batch below one, as in a smoke run on little data) updates nothing, and a
run whose every step was such a one is recorded as not checked, never stopped.

What it cannot see: a tensor that moves but is not used by the loss (noise moves it); the engine probe and the
watch (:mod:`dp_adam_bench.engine.watch`) list those as never verified. And a tensor that moves only through weight
decay.
"""

from __future__ import annotations

import torch

from dp_adam_bench.errors import PrivacyMismatch

DEFAULT_AFTER = 3


class NotTraining(PrivacyMismatch):
    """A trainable tensor did not move in the first steps: the run would report an untrained result as trained.
    (A :class:`PrivacyMismatch` so that the trainer stops the run as it does for a failed engine check.)"""


def digest(t: torch.Tensor) -> tuple[float, float]:
    x = t.detach().to(torch.float64)
    return float(x.sum()), float((x * x).sum())


class MovedCheck:
    """``tensors()`` -> [(name, tensor)] the variant updates; checked once, at the end of step ``after``."""

    def __init__(self, tensors, after: int = DEFAULT_AFTER):
        self.tensors = tensors
        self.after = int(after)
        self.start = {n: digest(t) for n, t in tensors()} if self.after > 0 else {}
        self.result: dict | None = None
        self.counted = 0  # steps that could move a tensor: an example drawn, or noise added

    def after_step(self, step: int, total: int, counts: bool = True) -> None:
        """At the ``after``-th step that ``counts`` (drew an example or added noise), or at the run's last step
        if fewer counted: :class:`NotTraining` naming the tensors that did not move."""
        if self.result is not None or self.after <= 0:
            return
        self.counted += bool(counts)
        if self.counted < self.after and step < total:
            return
        if self.counted == 0:
            self.result = {
                "step": step,
                "tensors": None,
                "unmoved": None,
                "not_checked": "no step drew an example",
            }
            return
        named = list(self.tensors())
        still = [n for n, t in named if n in self.start and digest(t) == self.start[n]]
        self.result = {"step": step, "tensors": len(named), "unmoved": still}
        if still:
            shown = ", ".join(still[:5]) + (f" and {len(still) - 5} more" if len(still) > 5 else "")
            raise NotTraining(
                f"{len(still)} of {len(named)} trainable tensors did not move in the first {step} steps ({shown}): "
                "the optimizer does not update them or the forward pass does not read them; the run stops"
            )

    def state_dict(self) -> dict:
        return {"start": self.start, "result": self.result, "counted": self.counted}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.result = dict(state["start"]), state["result"]
        self.counted = int(state.get("counted", 0))  # checkpoints written before it counted steps
