"""CIFAR-10 image classification with the 5-layer CNN of Tang & Lécuyer (DP-AdamBC).

Q. Tang and M. Lécuyer, "DP-Adam: Correcting DP Bias in Adam's Second Moment Estimation", ICLR 2023 workshop
(arXiv:2304.11208), §3 and Fig. 1 (left): "a 5-layer CNN model and all of the model parameters are initialized
randomly", C = 1, sigma = 1, B = 2048. The architecture is the ``CNN5`` of the authors' code for the extended
version, Q. Tang, F. Shpilevskiy, M. Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias
Correction)", AAAI 2024 (arXiv:2312.14334). Data: A. Krizhevsky, "Learning Multiple Layers of Features from Tiny
Images", tech. report, 2009 (50,000 training and 10,000 test 32x32 RGB images, 10 classes).

Data sources (``load_cifar10``):

* ``pickle`` — the official python batches folder ``cifar-10-batches-py`` (``data_batch_1..5``,
  ``test_batch``; pickled dicts with ``b"data"`` uint8 N x 3072, channel-major, and ``b"labels"``): exact.
* ``jpeg_tar`` — the offline copy in ``shared/data/cifar10/cifar10_jpeg_q75.tar.gz``: all 60,000 images as
  baseline JPEG (quality 75, 4:2:0 chroma), paths ``{train,test}/<class>/NNNN.jpg``. LOSSY, and the images are
  ordered by class rather than in the original batch order. Decoded once with Pillow and cached as a ``.npz``.
* ``hf`` — ``datasets.load_dataset("uoft-cs/cifar10")`` (needs the hub or a warm Hugging Face cache).
* ``auto`` — the pickle folder if ``data_dir`` holds one, then the JPEG archive, then the hub.

Every loader returns ``x`` as uint8 arrays of shape (N, 32, 32, 3) (NHWC) and ``y`` as int64 labels in the
standard class order (airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck).

Inputs are normalised per channel with the canonical CIFAR-10 training-set mean and standard deviation. These
are fixed public constants rather than statistics of the (possibly subsampled) private training set, so
normalisation spends no privacy budget.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import tarfile
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench import progress
from dp_adam_bench.files import write_atomic
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks.base import LabelledTask, count_field, missing_data, subset_indices, try_hub

log = logging.getLogger(__name__)

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# Canonical per-channel statistics of the CIFAR-10 training set (pixel values in [0, 1]).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

SOURCES = ("auto", "pickle", "jpeg_tar", "hf")
PICKLE_FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
JPEG_ARCHIVE = "cifar10_jpeg_q75.tar.gz"
HF_NAME = "uoft-cs/cifar10"
# Bump when the decoded array layout changes, so old caches are not reused.
_CACHE_FORMAT = 1

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


# --------------------------------------------------------------------------------------------- model


class CNN5(nn.Module):
    """The ``CNN5`` of Tang & Lécuyer (DP-AdamBC, AAAI 2024) for 3 x 32 x 32 inputs, 10 classes.

    ======  =====================================  ==============
    layer   operation                              output shape
    ======  =====================================  ==============
    conv1   3x3 conv, 32 channels, no padding      32 x 30 x 30
            tanh, 2x2 max-pool (stride 2)          32 x 15 x 15
    conv2   3x3 conv, 64 channels, "same"          64 x 15 x 15
            tanh, 2x2 max-pool (stride 2)          64 x 7 x 7
    conv3   3x3 conv, 128 channels, "same"         128 x 7 x 7
            tanh, 2x2 max-pool (stride 2)          128 x 3 x 3
    conv4   3x3 conv, 256 channels, "same"         256 x 3 x 3
            tanh                                   256 x 3 x 3
    conv5   3x3 conv, 10 channels, "same"          10 x 3 x 3
            global average pool                    10 (logits)
    ======  =====================================  ==============

    411,466 parameters (all convolutions have biases). No normalisation layers: each example's output depends
    on that example only, as per-example clipping requires. PyTorch's default initialisation.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=0)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv4 = nn.Conv2d(128, 256, 3, padding=1)
        self.conv5 = nn.Conv2d(256, num_classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2, 2)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2, 2)
        x = F.max_pool2d(torch.tanh(self.conv3(x)), 2, 2)
        x = torch.tanh(self.conv4(x))
        return self.conv5(x).mean(dim=(2, 3))


# --------------------------------------------------------------------------------------------- loaders


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "dp_adam_bench" / "cifar10"


def _check_arrays(arrays: Arrays, origin: str) -> Arrays:
    x_tr, y_tr, x_te, y_te = arrays
    for name, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (32, 32, 3):
            raise ValueError(
                f"{origin}: {name} images have dtype {x.dtype} and shape {x.shape}, want uint8 (N, 32, 32, 3)"
            )
        if y.shape != (x.shape[0],):
            raise ValueError(f"{origin}: {name} has {x.shape[0]} images but labels of shape {y.shape}")
        if y.size and (y.min() < 0 or y.max() >= len(CLASSES)):
            raise ValueError(f"{origin}: {name} labels outside 0..{len(CLASSES) - 1}")
        if x.shape[0] == 0:
            raise ValueError(f"{origin}: no {name} images")
    return arrays


def find_pickle_folder(data_dir: str | os.PathLike | None) -> Path | None:
    """``data_dir`` itself or ``data_dir/cifar-10-batches-py`` if it holds ``data_batch_1``, else None."""
    if data_dir is None:
        return None
    for folder in (Path(data_dir), Path(data_dir) / PICKLE_FOLDER):
        if (folder / TRAIN_BATCHES[0]).is_file():
            return folder
    return None


def _read_pickle_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(
            f"CIFAR-10 python batch {path} is missing (want {', '.join(TRAIN_BATCHES)}, {TEST_BATCH})"
        )
    try:
        with open(path, "rb") as f:
            # The official batches are Python-2 pickles; encoding="bytes" keeps their keys as bytes.
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
        x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    except Exception as e:
        raise ValueError(
            f"{path} is not a readable CIFAR-10 python batch (a pickled dict with b'data' uint8 N x 3072 and "
            f"b'labels'): {type(e).__name__}: {e}. Re-download cifar-10-python.tar.gz and unpack it again."
        ) from e
    if x.shape[0] != labels.shape[0]:
        raise ValueError(f"{path}: {x.shape[0]} images but {labels.shape[0]} labels")
    return np.ascontiguousarray(x), labels


def load_pickle(folder: str | os.PathLike) -> Arrays:
    """The official ``cifar-10-batches-py`` folder (pixel-exact). Only open pickles you trust."""
    folder = Path(folder)
    parts = [_read_pickle_batch(folder / name) for name in TRAIN_BATCHES]
    x_te, y_te = _read_pickle_batch(folder / TEST_BATCH)
    x_tr = np.concatenate([p[0] for p in parts])
    y_tr = np.concatenate([p[1] for p in parts])
    return _check_arrays((x_tr, y_tr, x_te, y_te), str(folder))


def decode_jpeg_tar(archive: str | os.PathLike, limit: int | None = None) -> Arrays:
    """Decode a tar(.gz) of ``{train,test}/<class>/NNNN.jpg`` files with Pillow (``limit``: first N images).

    Images are returned sorted by (class, file name) within each split, whatever the member order in the tar.
    """
    from PIL import Image, UnidentifiedImageError

    archive = Path(archive)
    rows: dict[str, list[tuple[int, str, np.ndarray]]] = {"train": [], "test": []}
    seen = 0
    member = None
    try:
        with tarfile.open(archive, "r:*") as tf:
            for member in tf:
                if limit is not None and seen >= limit:
                    break
                if not member.isfile() or not member.name.lower().endswith((".jpg", ".jpeg")):
                    continue
                parts = member.name.split("/")
                if len(parts) < 3 or parts[-3] not in rows:
                    continue
                split, cls, fname = parts[-3:]
                if cls not in CLASSES:
                    raise ValueError(
                        f"member {member.name!r}: unknown class folder {cls!r} (want one of {CLASSES})"
                    )
                seen += 1
                blob = tf.extractfile(member).read()
                try:
                    with Image.open(io.BytesIO(blob)) as im:
                        img = np.asarray(im.convert("RGB"), dtype=np.uint8)
                except (UnidentifiedImageError, OSError) as e:
                    raise ValueError(f"member {member.name!r} is not a readable image: {e}") from e
                if img.shape != (32, 32, 3):
                    raise ValueError(
                        f"member {member.name!r} is {img.shape[1]}x{img.shape[0]}, want 32x32 RGB"
                    )
                rows[split].append((CLASSES.index(cls), fname, img))
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as e:
        where = f" (at member {member.name!r})" if member is not None else ""
        raise ValueError(
            f"cannot read the CIFAR-10 JPEG archive {archive}{where}: {type(e).__name__}: {e}"
        ) from e

    out = []
    for split in ("train", "test"):
        if not rows[split]:
            if limit is not None:
                out += [np.zeros((0, 32, 32, 3), np.uint8), np.zeros(0, np.int64)]
                continue
            raise ValueError(
                f"{archive}: no {split}/<class>/*.jpg members (want {split}/airplane/0000.jpg, ...)"
            )
        rows[split].sort(key=lambda r: (r[0], r[1]))
        out.append(np.stack([r[2] for r in rows[split]]))
        out.append(np.array([r[0] for r in rows[split]], dtype=np.int64))
    if limit is None:
        _check_arrays(tuple(out), str(archive))
    return tuple(out)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def jpeg_cache_path(archive: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Cache file for ``archive``, keyed by its sha256, the Pillow version (decoders differ), the format."""
    import PIL

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = f"{file_sha256(archive)[:16]}-pil{PIL.__version__}-v{_CACHE_FORMAT}"
    return cache_dir / f"{Path(archive).name.split('.')[0]}-{key}.npz"


def _read_cache(path: Path) -> Arrays | None:
    try:
        with np.load(path) as z:
            arrays = (z["x_train"], z["y_train"], z["x_test"], z["y_test"])
        return _check_arrays(arrays, str(path))
    except Exception as e:
        warnings.warn(
            f"ignoring unreadable CIFAR-10 cache {path} ({type(e).__name__}: {e}); decoding again",
            stacklevel=3,
        )
        return None


def _write_cache(path: Path, arrays: Arrays, archive: Path) -> bool:
    try:
        write_atomic(
            path,
            lambda f: np.savez_compressed(
                f,
                x_train=arrays[0],
                y_train=arrays[1],
                x_test=arrays[2],
                y_test=arrays[3],
                archive=np.array(str(archive)),
            ),
        )
        return True
    except OSError as e:
        warnings.warn(f"could not write the CIFAR-10 cache {path} ({e}); continuing without it", stacklevel=3)
        return False


def load_jpeg_tar(
    archive: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    decode: Callable[[Path], Arrays] | None = None,
) -> tuple[Arrays, Path, bool]:
    """The JPEG archive through the ``.npz`` cache: returns (arrays, cache file, whether it was a hit)."""
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"CIFAR-10 JPEG archive {archive} not found")
    cache = jpeg_cache_path(archive, cache_dir)
    if cache.is_file():
        arrays = _read_cache(cache)
        if arrays is not None:
            return arrays, cache, True
    arrays = (decode or decode_jpeg_tar)(archive)
    _write_cache(cache, arrays, archive)
    return arrays, cache, False


def load_hf(name: str = HF_NAME) -> Arrays:
    """``datasets.load_dataset(name)`` (columns ``img`` or ``image``, and ``label``) as uint8 arrays."""
    import datasets

    ds = datasets.load_dataset(name)
    out = []
    for split in ("train", "test"):
        d = ds[split]
        col = "img" if "img" in d.column_names else "image"
        x = np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in d[col]])
        out += [x, np.asarray(d["label"], dtype=np.int64)]
    return _check_arrays(tuple(out), f"Hugging Face dataset {name!r}")


def _jpeg_candidates(data_dir) -> list[Path]:
    cands = []
    if data_dir is not None:
        d = Path(data_dir)
        cands.append(d if d.suffix in (".gz", ".tar", ".tgz") else d / JPEG_ARCHIVE)
    cands.append(shared_data_dir() / "cifar10" / JPEG_ARCHIVE)
    return list(dict.fromkeys(cands))


def load_cifar10_described(
    source: str = "auto",
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    hf_name: str = HF_NAME,
) -> tuple[Arrays, str]:
    """Like :func:`load_cifar10`, also returning a one-line description of where the data came from."""
    if source not in SOURCES:
        raise ValueError(f"unknown CIFAR-10 source {source!r}; valid: {', '.join(SOURCES)}")
    tried: list[str] = []

    if source in ("auto", "pickle"):
        folder = find_pickle_folder(data_dir)
        if folder is not None:
            return load_pickle(folder), f"pickle:{folder} (pixel-exact python batches)"
        if data_dir is None:
            tried.append("python batches folder: none given (task.data_dir is null)")
        else:
            alt = Path(data_dir) / PICKLE_FOLDER
            tried.append(f"python batches folder: no {TRAIN_BATCHES[0]} in {data_dir} or {alt}")

    if source in ("auto", "jpeg_tar"):
        for archive in _jpeg_candidates(data_dir):
            if archive.is_file():
                arrays, cache, hit = load_jpeg_tar(archive, cache_dir)
                how = "cache hit" if hit else "decoded and cached"
                return arrays, f"jpeg_tar:{archive} (LOSSY JPEG q75, class-sorted; {how}: {cache})"
            tried.append(f"JPEG archive: {archive} does not exist")

    if source in ("auto", "hf"):
        data = try_hub(source, hf_name, lambda: load_hf(hf_name), tried)
        if data is not None:
            return data, f"hf:{hf_name}"

    raise missing_data(
        "CIFAR-10 data",
        source,
        tried,
        "Provide one of: task.data_dir=/path/to/cifar-10-batches-py (unpacked from cifar-10-python.tar.gz); "
        f"the JPEG archive at {shared_data_dir() / 'cifar10' / JPEG_ARCHIVE} (DP_ADAM_BENCH_DATA sets the "
        f"data folder) or task.data_dir=/path/to/{JPEG_ARCHIVE}; or hub access for task.source=hf.",
        task="cifar10_cnn",
    )


def load_cifar10(
    source: str = "auto",
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    hf_name: str = HF_NAME,
) -> Arrays:
    """CIFAR-10 as ``(x_train, y_train, x_test, y_test)``: uint8 (N, 32, 32, 3) images and int64 labels.

    ``source``: ``pickle`` (``data_dir`` = the ``cifar-10-batches-py`` folder or its parent), ``jpeg_tar``
    (``data_dir`` = the archive or its folder, else the shared copy; decoded once into ``cache_dir``, default
    ``~/.cache/dp_adam_bench/cifar10``), ``hf`` (the hub), or ``auto`` (in that order, first available).
    Raises FileNotFoundError listing everything tried when no source is available.
    """
    arrays, desc = load_cifar10_described(source, data_dir, cache_dir, hf_name=hf_name)
    log.info("CIFAR-10 from %s", desc)
    return arrays


# --------------------------------------------------------------------------------------------- task


class Cifar10CNN(LabelledTask):
    """CIFAR-10 with Tang & Lécuyer's ``CNN5`` (DP-AdamBC, AAAI 2024, Fig. 1): data, model, loss and metrics.

    Config fields: ``source``, ``data_dir``, ``cache_dir`` (see :func:`load_cifar10`); ``train_subset`` /
    ``test_subset`` (null = all, else that many examples drawn without replacement with ``data_seed``, the
    same for every run); ``val_subset`` (null, or that many test-split images outside ``test_subset``, drawn
    after it with ``data_seed``, scored beside the test subset as ``val_accuracy`` / ``val_loss``: a validation
    split for choosing hyper-parameters in the same runs, never trained on and never reported as the test
    number); ``eval_batch_size``; ``augment`` (random horizontal flip and 4-pixel-padded random crop per example,
    seeded by the run seed; off in Tang's setup).
    """

    name = "cifar10_cnn"
    trial_dims = 0

    def __init__(self, cfg, *, trials: int, seed: int):
        del trials  # one model per run; DP noise trials are separate runs for model tasks
        (x_tr, y_tr, x_te, y_te), self.data_source = load_cifar10_described(
            str(cfg.get("source", "auto")),
            cfg.get("data_dir"),
            cfg.get("cache_dir"),
            hf_name=str(cfg.get("hf_name", HF_NAME)),
        )
        rng = np.random.default_rng(int(cfg.get("data_seed", 0)))
        tr = subset_indices(len(y_tr), cfg.get("train_subset"), rng, "train_subset")
        te = subset_indices(len(y_te), cfg.get("test_subset"), rng, "test_subset")
        self.x_val = self.y_val = None
        if cfg.get("val_subset") is not None:
            if te is None:
                raise ValueError(
                    "task.val_subset needs task.test_subset (the reported images it must avoid); with test_subset "
                    "null every test image is reported"
                )
            rest = np.setdiff1d(np.arange(len(y_te)), te)
            va = np.sort(
                rng.choice(
                    rest, size=count_field(cfg.get("val_subset"), "val_subset", len(rest)), replace=False
                )
            )
            self.x_val = torch.from_numpy(np.ascontiguousarray(x_te[va].transpose(0, 3, 1, 2)))
            self.y_val = torch.from_numpy(y_te[va].astype(np.int64))
        if tr is not None:
            x_tr, y_tr = x_tr[tr], y_tr[tr]
        if te is not None:
            x_te, y_te = x_te[te], y_te[te]
        # uint8 NCHW in memory (150 MB for the full training set); normalised to float per batch
        self.x_train = torch.from_numpy(np.ascontiguousarray(x_tr.transpose(0, 3, 1, 2)))
        self.y_train = torch.from_numpy(y_tr.astype(np.int64))
        self.x_test = torch.from_numpy(np.ascontiguousarray(x_te.transpose(0, 3, 1, 2)))
        self.y_test = torch.from_numpy(y_te.astype(np.int64))
        self.eval_batch_size = int(cfg.get("eval_batch_size", 1000))
        if self.eval_batch_size < 1:
            raise ValueError(f"task.eval_batch_size must be >= 1, got {self.eval_batch_size}")
        self.augment = bool(cfg.get("augment", False))
        self._aug_gen = torch.Generator().manual_seed(int(seed))
        self._mean = torch.tensor(MEAN).view(1, 3, 1, 1)
        self._std = torch.tensor(STD).view(1, 3, 1, 1)

    def build_model(self) -> nn.Module:
        return CNN5()

    def normalise(self, x_uint8: torch.Tensor) -> torch.Tensor:
        return (x_uint8.float() / 255.0 - self._mean) / self._std

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        b, pad = x.shape[0], 4
        g = self._aug_gen
        flip = torch.rand(b, generator=g) < 0.5
        x = torch.where(flip.view(b, 1, 1, 1), x.flip(3), x)
        xp = F.pad(x, (pad, pad, pad, pad))  # zero = the mean colour after normalisation
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=g)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=g)
        ar = torch.arange(32)
        rows = (dy[:, None] + ar)[:, None, :, None]
        cols = (dx[:, None] + ar)[:, None, None, :]
        return xp[torch.arange(b)[:, None, None, None], torch.arange(3)[None, :, None, None], rows, cols]

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The random state :meth:`get_batch` draws from (the augmentation generator, whether or not ``augment``
        is on): checkpointed, so that a resumed run augments exactly as the uninterrupted one (``base.py``)."""
        return {"augment": self._aug_gen.get_state()}

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from :meth:`rng_state`'s output."""
        self._aug_gen.set_state(state["augment"].cpu())  # generator states are CPU byte tensors

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self.normalise(self.x_train[idx])
        if self.augment:
            x = self._augment(x)
        return {"x": x, "y": self.y_train[idx]}

    def loss_per_example(
        self, forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return F.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        out = self._score(model, self.x_test, self.y_test, "test")
        if self.x_val is not None:
            out |= self._score(model, self.x_val, self.y_val, "val")
        return out

    def _score(self, model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, split: str) -> dict[str, float]:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        loss_sum, correct = 0.0, 0
        n = int(ys.shape[0])
        for start in progress.iterate(range(0, n, self.eval_batch_size), desc="evaluate"):
            x = self.normalise(xs[start : start + self.eval_batch_size]).to(device)
            y = ys[start : start + self.eval_batch_size].to(device)
            logits = model(x).float()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        return {f"{split}_accuracy": 100.0 * correct / n, f"{split}_loss": loss_sum / n}
