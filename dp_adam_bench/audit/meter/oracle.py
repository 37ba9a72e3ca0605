"""The meter's own per-example gradients for a model whose gradients it does not know in closed form (a fine-tuning
method's adapters, carriers or prefix): plain autograd on each example alone, at the model's state before each step.

This is the size-one loop written again in plain torch (``torch.autograd.grad`` of one example's loss), not the
project's ``loop`` engine: the oracle the engines are tested against, independent of every clipping engine and of
the engine watch. It runs after the run, on a twin of the run's model (built by the same path, replay.py) loaded with
the state the run's engine saw at each step (recording.py keeps it), in train mode (the meter's tasks have no dropout:
a random mask the engine drew could not be drawn again here).
"""

from __future__ import annotations

import torch
from torch import nn


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every tensor the model holds (parameters trainable or frozen, buffers), by state-dict name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@torch.no_grad()
def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (:func:`state_of`) into the model's own tensors, in place (the tensors the variant and the
    method hold stay the same objects)."""
    live = model.state_dict(keep_vars=True)
    missing = sorted(set(live) ^ set(state))
    if missing:
        raise ValueError(f"the twin's tensors differ from the run's: {missing[:3]}")
    for k, v in state.items():
        live[k].copy_(v)


def per_example_grads(task, model: nn.Module, params: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """(examples, coordinates), float64: each example's gradient of ``task.loss_per_example`` with respect to
    ``params`` (flattened and joined in their order), by autograd on that example alone."""
    device = params[0].device if params else torch.device("cpu")
    numel = sum(p.numel() for p in params)
    out = torch.zeros(len(idx), numel, dtype=torch.float64)
    training = model.training
    model.train()
    try:
        for k, i in enumerate(torch.as_tensor(idx, dtype=torch.long).tolist()):
            batch = {name: v.to(device) for name, v in task.get_batch(torch.tensor([i])).items()}
            with torch.enable_grad():
                loss = task.loss_per_example(model, batch).sum()
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            flat = [
                torch.zeros(p.numel(), dtype=torch.float64)
                if g is None
                else g.detach().double().cpu().reshape(-1)
                for p, g in zip(params, grads, strict=True)
            ]
            out[k] = torch.cat(flat)
    finally:
        model.train(training)
    return out
