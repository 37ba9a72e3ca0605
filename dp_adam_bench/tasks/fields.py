"""Config fields the text tasks share (``max_length``, ``pad_to``, batch sizes, ``eval_split``): read and checked the
same way in each, the error naming the field, the value and what is valid."""

from __future__ import annotations


def max_length(cfg, default: int = 128) -> int:
    """``task.max_length``: tokens per example, at least 8."""
    n = int(cfg.get("max_length", default))
    if n < 8:
        raise ValueError(f"task.max_length must be >= 8, got {n}")
    return n


def pad_to(cfg, default: str) -> str:
    """``task.pad_to``: ``max_length`` (every batch padded to it) or ``longest`` (to its longest row)."""
    pad = str(cfg.get("pad_to", default))
    if pad not in ("max_length", "longest"):
        raise ValueError(f"task.pad_to must be max_length or longest, got {pad!r}")
    return pad


def positive(cfg, key: str, default: int) -> int:
    """``task.<key>``: an integer >= 1."""
    v = int(cfg.get(key, default))
    if v < 1:
        raise ValueError(f"task.{key} must be >= 1, got {v}")
    return v


def eval_split(cfg, valid: tuple[str, ...]) -> str:
    """``task.eval_split`` (null = test), one of ``valid``."""
    split = str(cfg.get("eval_split") or "test")
    if split not in valid:
        raise ValueError(f"task.eval_split must be {' or '.join(valid)}, got {split!r}")
    return split
