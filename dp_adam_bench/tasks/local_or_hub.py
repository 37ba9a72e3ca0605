"""Where a text task's data split comes from: the first local folder holding one of its files, else the Hugging Face
hub (the search of :func:`~dp_adam_bench.tasks.e2e_gpt2.load_e2e_split` and
:func:`~dp_adam_bench.tasks.snli_bert.load_snli_split`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dp_adam_bench.tasks.base import try_hub


def local_or_hub(
    names: Sequence[str],
    folders: Sequence[Path],
    read: Callable[[Path], Any],
    source: str,
    hf_name: str,
    load_hf: Callable[[], Any],
    hf_origin: str,
) -> tuple[Any, str | None, list[str]]:
    """``(data, origin, tried)``: ``read(path)`` of the first of ``names`` in the first of ``folders`` that holds one
    (``source`` auto or local), else ``load_hf()`` (auto or hf, :func:`~dp_adam_bench.tasks.base.try_hub`);
    ``(None, None, tried)`` when neither has it, ``tried`` saying every place looked at."""
    tried: list[str] = []
    if source in ("auto", "local"):
        for folder in folders:
            for name in names:
                if (folder / name).is_file():
                    return read(folder / name), f"local:{folder / name}", tried
            tried.append(f"{folder}: none of {', '.join(names)}")
    if source in ("auto", "hf"):
        data = try_hub(source, hf_name, load_hf, tried)
        if data is not None:
            return data, hf_origin, tried
    return None, None, tried
