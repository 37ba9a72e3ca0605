"""Public side information: where a side-information variant's public examples come from, and the check that none
of them is a private one.

A side-information variant (``needs_side_info``: ``side_info``, Ganesh, McMahan & Thakurta 2025, Alg. 9) feeds the
gradient of a *public* batch into its update unclipped and un-noised, at no privacy cost. That is only true of data
that is public: an example in both sets reaches every update without the mechanism in between.

* Through :func:`dp_adam_bench.make_private` and :class:`~dp_adam_bench.hf_trainer.DPTrainer` the public set is the
  user's ``public_dataset``, never cut from the private data. The task serves it at indices ``N .. N + M - 1``,
  after its ``N`` private examples (``task.public_size = M``), so ``Run.population`` is ``0 .. N - 1`` alone: the
  sampler, the accountant (q = B / N), the participation ledger and the engine watch never see a public example.
* On the command line (a task without ``public_size``) ``train.side_info.public_examples`` examples are held out of
  the task's training set by a seeded split (:func:`dp_adam_bench.engine.trainer.split_public`), printed in the
  run's privacy notes: the paper reproduces Ganesh et al.'s held-out setting.

:func:`check_disjoint` runs when a :class:`~dp_adam_bench.engine.session.PrivateTraining` is made: by index (the
public indices against the accounted population), and by content wherever the task can give each example's content
(``task.example_content(i)``: make_private's task does, for both sets). The content of an example is a digest of
its fields (:func:`example_digest`).
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from dp_adam_bench.errors import ConfigError, PrivacyMismatch

#: the name of the public set in the check's messages when the task does not give one
DEFAULT_PUBLIC_NAME = "the public side-information set"


def side_info_variants() -> list[str]:
    """The registered optimizer variants that read public side information (``needs_side_info``)."""
    from dp_adam_bench.optim.registry import VARIANTS

    return [name for name, cls in VARIANTS.items() if getattr(cls, "needs_side_info", False)]


def refuse_public_mismatch(optimizer: str, needed: bool, size: int) -> None:
    """ConfigError (in make_private's and DPTrainer's words) for a side-information variant without a public set
    (``size`` 0), or a public set for a variant that would ignore it: refused rather than ignored, since a user who
    passes public data believes it is used."""
    if needed and size < 1:
        raise ConfigError(
            f"public_dataset=None with optimizer={optimizer!r}, which preconditions with the gradient of public "
            "examples (side information, Ganesh et al. Alg. 9), unclipped and un-noised: pass public_dataset= "
            "(data that is public, none of it in the private data set)"
        )
    if size and not needed:
        raise ConfigError(
            f"public_dataset has {size} examples, but optimizer={optimizer!r} reads no public data: pass "
            f"public_dataset=None, or a variant that preconditions with it ({', '.join(side_info_variants())})"
        )


def example_digest(item) -> bytes:
    """A digest (BLAKE2b, 16 bytes) of one example's content, canonical in its structure: a tensor hashes with its
    dtype, shape and bytes (on the CPU, contiguous); a dict with its keys, in sorted order; a tuple or list with its
    length and order; a list of numbers as the numpy array it makes (int64 / float64 / bool), so a row of a
    Hugging Face data set read as lists and the same row read as int64 tensors are the same example; strings, bytes,
    Python numbers and None with a tag of their type.

    What it cannot see: examples that are the same to a person but not in their bytes. Near-duplicates (an image
    re-encoded, cropped or with one pixel changed), the same text tokenized differently (another tokenizer, other
    padding or truncation, a BOS token added), the same values in another dtype (int32 against int64 tokens, a
    float32 image against its float64 copy), and a field present in one set and absent in the other (an ``idx``
    column) all give different digests. A data set whose ``[i]`` draws random numbers (random augmentation) gives
    another digest on each read: give it ``example_content(i)`` returning what identifies the example (the image
    before augmentation). Collisions of a 128-bit digest are negligible (about 2^-128 per pair)."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, item)
    return h.digest()


def _feed(h, value) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(b"T" + str(t.dtype).encode() + b"|" + repr(tuple(t.shape)).encode() + b"|")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray | np.generic):
        if value.dtype == object:
            _feed(h, value.tolist())
        else:
            _feed(h, torch.from_numpy(np.ascontiguousarray(value)))
    elif isinstance(value, Mapping):
        keys = sorted(value, key=str)
        h.update(b"D" + struct.pack("<q", len(keys)))
        for k in keys:
            _feed(h, str(k))
            _feed(h, value[k])
    elif isinstance(value, list | tuple):
        numbers = _numeric_array(value)
        if numbers is not None:
            _feed(h, numbers)
            return
        h.update(b"L" + struct.pack("<q", len(value)))
        for v in value:
            _feed(h, v)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        h.update(b"S" + struct.pack("<q", len(data)) + data)
    elif isinstance(value, bytes | bytearray):
        h.update(b"Y" + struct.pack("<q", len(value)) + bytes(value))
    elif isinstance(value, bool | int | float):  # as the 0-d array numpy makes of it (int64, float64, bool)
        _feed(h, np.asarray(value))
    elif value is None:
        h.update(b"N")
    else:
        raise TypeError(
            f"cannot hash a {type(value).__name__} in an example (tensors, arrays, numbers, strings, lists and "
            "dicts of them): give the data set example_content(i) returning those"
        )


def _numeric_array(value: list | tuple) -> np.ndarray | None:
    """A non-empty, rectangular list of Python numbers (nested) as a numpy array of int64, float64 or bool; None
    for anything else."""
    # numpy scalars and tensors inside a list hash as themselves (their own dtype)
    if not value or any(not isinstance(v, bool | int | float) for v in _leaves(value)):
        return None
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged
        return None
    if arr.dtype.kind not in "bif":
        return None
    return arr.astype({"b": np.bool_, "i": np.int64, "f": np.float64}[arr.dtype.kind])


def _leaves(value):
    if isinstance(value, list | tuple):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def check_disjoint(run) -> None:
    """Every example a step reads is in the accounted population or in a public set disjoint from it.

    By index: ``run.public`` against ``run.population`` (the task's own numbering). By content, where the task gives
    it (``run.task.example_content(i)``): the digests (:func:`example_digest`) of every public example against those
    of every private one, so a copy of a private example in the public set is found wherever it sits. Either overlap
    raises :class:`~dp_adam_bench.errors.PrivacyMismatch` in one line naming how many examples overlap. A task
    without ``example_content`` (the command line's, whose public examples are held out of its own training set by
    index) is checked by index alone. What the content check cannot see: :func:`example_digest`."""
    if run.public is None:
        return
    public_name = getattr(run.task, "public_name", DEFAULT_PUBLIC_NAME)
    both = torch.isin(run.public, run.population)
    if bool(both.any()):
        raise PrivacyMismatch(
            f"{int(both.sum())} example(s) are both in {public_name} and in the private population the "
            "accountant counts: their gradients would reach the update unclipped and unnoised"
        )
    content = getattr(run.task, "example_content", None)
    if content is None:
        return
    private = {example_digest(content(int(i))) for i in run.population}
    public = [example_digest(content(int(i))) for i in run.public]
    _warn_if_not_repeatable(content, run, public_name)
    shared = sum(d in private for d in public)
    if shared:
        raise PrivacyMismatch(
            f"{public_name}: {shared} of its {len(public)} examples have the same content as examples of the "
            f"private data set ({len(run.population)} examples): their gradients would reach every update unclipped "
            f"and un-noised; remove them from {public_name}"
        )


def _warn_if_not_repeatable(content, run, public_name: str) -> None:
    """A warning when reading an example twice gives two contents (a data set with random augmentation): the
    content check cannot match such examples."""
    for name, idx in (("the private data set", run.population), (public_name, run.public)):
        first = int(idx[0])
        if example_digest(content(first)) != example_digest(content(first)):
            warnings.warn(
                f"{name} gives example {first} with another content on a second read (random augmentation in its "
                "[i]?): the public / private overlap check cannot match its examples; give the data set "
                "example_content(i) returning what identifies example i",
                stacklevel=2,
            )
            return
