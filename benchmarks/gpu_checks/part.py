"""What a part of the GPU check is: its commands and its check, the context they run in, and its result."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class PartFailed(Exception):
    """A part ran but its result is wrong: the message is the report's one-line summary."""


@dataclass
class Ctx:
    device: str  # "cuda" or "cpu"
    quick: bool
    out: Path  # the report folder
    work: Path  # scratch: run store, caches, slot files (not part of the report)
    cores: int
    xdist: bool
    py: str = sys.executable

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclass
class Part:
    name: str
    what: str
    limit_s: int
    commands: Callable[[Ctx], list[list[str]]]
    verify: Callable[[Ctx, str], str]  # (ctx, the log) -> summary; raises PartFailed
    cuda_only: bool = False


@dataclass
class Result:
    name: str
    what: str
    status: str  # passed, FAILED, TIMED OUT, skipped: ...
    seconds: float = 0.0
    limit_s: float = 0.0
    summary: str = ""
    commands: list[str] = field(default_factory=list)
