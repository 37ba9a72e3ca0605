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


def _tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor, bool]]:
    """Every tensor the model holds, by dotted name -> (its module, its name there, the tensor, whether it is a
    parameter or a buffer): parameters (trainable or frozen), buffers (persistent or not) and plain tensor
    attributes hung on its modules (a statistic a method keeps without registering it)."""
    out: dict[str, tuple[nn.Module, str, torch.Tensor, bool]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = [(a, v, True) for a, v in [*module._parameters.items(), *module._buffers.items()]]
        own += [(a, v, False) for a, v in vars(module).items() if isinstance(v, torch.Tensor)]
        for attr, value, registered in own:
            if isinstance(value, torch.Tensor):
                out.setdefault(prefix + attr, (module, attr, value, registered))
    return out


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every tensor the model holds (:func:`_tensors`), by name."""
    return {k: v[2].detach().clone() for k, v in _tensors(model).items()}


@torch.no_grad()
def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (:func:`state_of`) into the model's own tensors, in place (the tensors the variant and the
    method hold stay the same objects); a plain tensor attribute the model lacks is set, one it has beyond
    ``state`` is left. A parameter or buffer on one side only is a different model: ValueError."""
    live = _tensors(model)
    registered = {k for k, v in live.items() if v[3]}
    odd = sorted((registered - set(state)) | {k for k in set(state) - set(live) if _is_registered(model, k)})
    if odd:
        raise ValueError(f"the twin's parameters and buffers differ from the run's: {odd[:3]}")
    for k, v in state.items():
        if k in live and live[k][2].shape == v.shape:
            live[k][2].copy_(v)
        else:
            owner, _, attr = k.rpartition(".")
            object.__setattr__(model.get_submodule(owner) if owner else model, attr, v.clone())


def _is_registered(model: nn.Module, key: str) -> bool:
    owner, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return True  # no such module: not the same model
    return attr in module._parameters or attr in module._buffers


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
