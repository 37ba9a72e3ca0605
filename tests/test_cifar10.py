"""CIFAR-10 loaders on tiny fixtures (pickle folder, JPEG tar, fake hub), the cache, and Tang's CNN5."""

import io
import pickle
import sys
import tarfile
import types

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dp_adam_bench.tasks import cifar10_cnn as c10
from dp_adam_bench.tasks.cifar10_cnn import CNN5, Cifar10CNN, load_cifar10, load_cifar10_described

N_TRAIN, N_TEST = 20, 10
REAL_ARCHIVE = c10.shared_data_dir() / "cifar10" / c10.JPEG_ARCHIVE


def smooth_images(n, seed):
    """Piecewise-smooth images (a colour plus a gentle gradient), so q75 JPEG round-trips them closely."""
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 216, size=(n, 1, 1, 3))
    ramp = np.linspace(-30, 30, 32)
    grad = ramp[None, :, None, None] * rng.uniform(-1, 1, size=(n, 1, 1, 3))
    return np.clip(base + grad, 0, 255).astype(np.uint8).repeat(32, axis=2)


def fake_arrays(seed=0):
    x_tr, x_te = smooth_images(N_TRAIN, seed), smooth_images(N_TEST, seed + 1)
    y_tr = np.arange(N_TRAIN) % 10
    y_te = np.arange(N_TEST) % 10
    return x_tr, y_tr.astype(np.int64), x_te, y_te.astype(np.int64)


def write_pickle_folder(folder, arrays):
    x_tr, y_tr, x_te, y_te = arrays
    folder.mkdir(parents=True)
    chunks = np.array_split(np.arange(len(y_tr)), 5)
    for i, idx in enumerate(chunks, 1):
        data = x_tr[idx].transpose(0, 3, 1, 2).reshape(len(idx), 3072)
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": data, b"labels": [int(v) for v in y_tr[idx]], b"batch_label": b"x"}, f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": x_te.transpose(0, 3, 1, 2).reshape(len(y_te), 3072), b"labels": list(y_te)}, f)
    return folder


def write_jpeg_tar(path, arrays):
    """Same layout as the shared archive: sorted ``{train,test}/<class>/NNNN.jpg``, quality 75."""
    from PIL import Image

    x_tr, y_tr, x_te, y_te = arrays
    members = {}
    for split, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        counts = {}
        for img, label in zip(x, y, strict=True):
            cls = c10.CLASSES[label]
            k = counts.get(cls, 0)
            counts[cls] = k + 1
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=75)
            members[f"{split}/{cls}/{k:04d}.jpg"] = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size = len(members[name])
            tf.addfile(info, io.BytesIO(members[name]))
    return path


def class_sorted(x, y):
    order = np.argsort(y, kind="stable")
    return x[order], y[order]


@pytest.fixture
def arrays():
    return fake_arrays()


@pytest.fixture
def no_shared(tmp_path, monkeypatch):
    """An empty shared-data folder and a hub that refuses, so only what a test provides is found."""
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "empty_shared"))

    def refuse(name, *a, **k):
        raise ConnectionError(f"Couldn't reach {name!r} on the Hub (offline test)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=refuse))
    return tmp_path


def test_pickle_loader_is_exact(tmp_path, arrays):
    folder = write_pickle_folder(tmp_path / "cifar-10-batches-py", arrays)
    out = load_cifar10("pickle", folder)
    for got, want in zip(out, arrays, strict=True):
        assert got.shape == want.shape and np.array_equal(got, want)
    assert out[0].dtype == np.uint8 and out[1].dtype == np.int64
    # the parent folder works too
    assert np.array_equal(load_cifar10("pickle", tmp_path)[0], arrays[0])


def test_jpeg_loader_shapes_labels_and_cache_hit(tmp_path, arrays, monkeypatch):
    archive = write_jpeg_tar(tmp_path / "c10.tar.gz", arrays)
    cache = tmp_path / "cache"
    x_tr, y_tr, x_te, y_te = load_cifar10("jpeg_tar", archive, cache)
    assert x_tr.shape == (N_TRAIN, 32, 32, 3) and x_te.shape == (N_TEST, 32, 32, 3)
    for (x, y), (xw, yw) in (
        ((x_tr, y_tr), class_sorted(*arrays[:2])),
        ((x_te, y_te), class_sorted(*arrays[2:])),
    ):
        assert np.array_equal(y, yw)
        err = np.abs(x.astype(int) - xw.astype(int))
        assert err.mean() < 2.0 and err.max() < 20  # lossy, but close on smooth images
    files = list(cache.glob("*.npz"))
    assert len(files) == 1 and c10.file_sha256(archive)[:16] in files[0].name

    def boom(*a, **k):
        raise AssertionError("decoded again despite a warm cache")

    monkeypatch.setattr(c10, "decode_jpeg_tar", boom)
    again, desc = load_cifar10_described("jpeg_tar", archive, cache)
    assert "cache hit" in desc
    for a, b in zip(again, (x_tr, y_tr, x_te, y_te), strict=True):
        assert np.array_equal(a, b)
    # a different archive (different bytes) gets a different cache key
    write_jpeg_tar(archive, fake_arrays(seed=5))
    with pytest.raises(AssertionError, match="decoded again"):
        load_cifar10("jpeg_tar", archive, cache)


def test_jpeg_decode_limit_reads_first_members(tmp_path, arrays):
    archive = write_jpeg_tar(tmp_path / "c10.tar.gz", arrays)
    x_tr, y_tr, x_te, y_te = c10.decode_jpeg_tar(archive, limit=7)
    assert x_tr.shape == (0, 32, 32, 3) and len(y_tr) == 0  # "test/..." sorts before "train/..."
    assert x_te.shape == (7, 32, 32, 3) and list(y_te) == list(range(7))


def test_hf_loader_converts_columns(monkeypatch, arrays):
    from PIL import Image

    x_tr, y_tr, x_te, y_te = arrays

    class Split:
        def __init__(self, x, y):
            self.column_names = ["img", "label"]
            self.cols = {"img": [Image.fromarray(i) for i in x], "label": list(y)}

        def __getitem__(self, k):
            return self.cols[k]

    fake = types.SimpleNamespace(
        load_dataset=lambda name: {"train": Split(x_tr, y_tr), "test": Split(x_te, y_te)}
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    out, desc = load_cifar10_described("hf")
    assert desc == "hf:uoft-cs/cifar10"
    for got, want in zip(out, arrays, strict=True):
        assert np.array_equal(got, want)


def test_auto_order(tmp_path, arrays, no_shared, monkeypatch):
    pickle_arrays, jpeg_arrays = arrays, fake_arrays(seed=9)
    folder = write_pickle_folder(tmp_path / "py", pickle_arrays)
    write_jpeg_tar(tmp_path / "empty_shared" / "cifar10" / c10.JPEG_ARCHIVE, jpeg_arrays)
    cache = tmp_path / "cache"
    # 1. a pickle folder in data_dir wins over the shared JPEG archive
    out, desc = load_cifar10_described("auto", folder, cache)
    assert desc.startswith("pickle:") and np.array_equal(out[0], pickle_arrays[0])
    # 2. without one, the shared archive
    out, desc = load_cifar10_described("auto", None, cache)
    assert desc.startswith("jpeg_tar:") and "LOSSY" in desc
    assert np.array_equal(out[1], class_sorted(*jpeg_arrays[:2])[1])
    # 3. without either, the hub
    (tmp_path / "empty_shared" / "cifar10" / c10.JPEG_ARCHIVE).unlink()

    def hub(name):
        raise RuntimeError(f"reached the hub for {name}")

    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", hub)
    with pytest.raises(FileNotFoundError, match="reached the hub"):
        load_cifar10("auto", None, cache)


def test_missing_data_error_names_everything_tried(tmp_path, no_shared):
    with pytest.raises(FileNotFoundError) as e:
        load_cifar10("auto", tmp_path / "nowhere", tmp_path / "cache")
    msg = str(e.value)
    for part in (
        str(tmp_path / "nowhere"),
        str(tmp_path / "nowhere" / "cifar-10-batches-py"),
        str(tmp_path / "empty_shared" / "cifar10" / c10.JPEG_ARCHIVE),
        "uoft-cs/cifar10",
        "task.data_dir=/path/to/cifar-10-batches-py",
    ):
        assert part in msg, part
    with pytest.raises(FileNotFoundError, match="task.data_dir is null"):
        load_cifar10("pickle")
    with pytest.raises(ValueError, match="valid: auto, pickle, jpeg_tar, hf"):
        load_cifar10("torchvision")


def test_corrupt_files_are_named(tmp_path, arrays):
    folder = write_pickle_folder(tmp_path / "py", arrays)
    (folder / "data_batch_3").write_bytes(b"\x80\x04this is not a pickle")
    with pytest.raises(ValueError, match="data_batch_3 is not a readable CIFAR-10 python batch"):
        load_cifar10("pickle", folder)
    write_pickle_folder(tmp_path / "py2", arrays)
    (tmp_path / "py2" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch is missing"):
        load_cifar10("pickle", tmp_path / "py2")

    good = write_jpeg_tar(tmp_path / "good.tar.gz", arrays).read_bytes()
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(good[: len(good) // 2])  # truncated download
    with pytest.raises(ValueError, match="cannot read the CIFAR-10 JPEG archive .*bad.tar.gz"):
        load_cifar10("jpeg_tar", bad, tmp_path / "cache")
    bad.write_bytes(b"not a tar at all")
    with pytest.raises(ValueError, match="bad.tar.gz"):
        load_cifar10("jpeg_tar", bad, tmp_path / "cache")


def test_corrupt_cache_is_rebuilt(tmp_path, arrays):
    archive = write_jpeg_tar(tmp_path / "c10.tar.gz", arrays)
    cache_file = c10.jpeg_cache_path(archive, tmp_path / "cache")
    cache_file.parent.mkdir()
    cache_file.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="ignoring unreadable CIFAR-10 cache"):
        out = load_cifar10("jpeg_tar", archive, tmp_path / "cache")
    assert out[0].shape == (N_TRAIN, 32, 32, 3)
    assert c10._read_cache(cache_file) is not None


def test_cnn5_parameter_count_and_shapes():
    torch.manual_seed(0)
    model = CNN5()
    n = sum(p.numel() for p in model.parameters())
    print(f"CNN5 parameters: {n}")
    # 3*32*9+32 + 32*64*9+64 + 64*128*9+128 + 128*256*9+256 + 256*10*9+10
    assert n == 411_466
    assert model(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert not any(isinstance(m, nn_norm) for m in model.modules() for nn_norm in NORM_LAYERS)


NORM_LAYERS = (torch.nn.BatchNorm2d, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.InstanceNorm2d)


def test_cnn5_output_is_independent_of_the_batch():
    torch.manual_seed(0)
    model = CNN5()
    x = torch.randn(6, 3, 32, 32)
    batched = model(x)
    alone = torch.cat([model(x[i : i + 1]) for i in range(6)])
    assert torch.allclose(batched, alone, atol=1e-6)


def make_task(tmp_path, arrays, **kw):
    folder = tmp_path / "py"
    if not folder.exists():
        write_pickle_folder(folder, arrays)
    cfg = OmegaConf.create(
        dict(
            name="cifar10_cnn",
            source="pickle",
            data_dir=str(folder),
            cache_dir=None,
            train_subset=None,
            test_subset=None,
            eval_batch_size=4,
            augment=False,
            trials=1,
        )
        | kw
    )
    return Cifar10CNN(cfg, trials=1, seed=0)


def test_task_batches_loss_and_evaluate(tmp_path, arrays):
    task = make_task(tmp_path, arrays)
    assert task.dataset_size == N_TRAIN and task.data_source.startswith("pickle:")
    batch = task.get_batch(torch.tensor([3, 0, 7]))
    assert batch["x"].shape == (3, 3, 32, 32) and batch["x"].dtype == torch.float32
    assert batch["y"].dtype == torch.long and batch["y"].tolist() == [3, 0, 7]
    want = (arrays[0][3].transpose(2, 0, 1) / 255.0 - np.array(c10.MEAN)[:, None, None]) / np.array(c10.STD)[
        :, None, None
    ]
    assert np.allclose(batch["x"][0].numpy(), want, atol=1e-5)
    torch.manual_seed(0)
    model = task.build_model()
    losses = task.loss_per_example(model, batch)
    assert losses.shape == (3,)
    ref = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    assert torch.allclose(losses, ref)
    metrics = task.evaluate(model)
    assert set(metrics) == {"test_accuracy", "test_loss"}
    with torch.no_grad():
        logits = model(task.normalise(task.x_test))
    assert metrics["test_accuracy"] == pytest.approx(
        100.0 * float((logits.argmax(1) == task.y_test).float().mean())
    )
    assert metrics["test_loss"] == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, task.y_test)), rel=1e-5
    )


def test_task_subsets_are_seeded(tmp_path, arrays):
    a = make_task(tmp_path, arrays, train_subset=8, test_subset=5)
    b = make_task(tmp_path, arrays, train_subset=8, test_subset=5)
    assert a.dataset_size == 8 and a.test_size == 5
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    with pytest.raises(ValueError, match="train_subset"):
        make_task(tmp_path, arrays, train_subset=N_TRAIN + 1)


def test_augment_is_a_flip_and_crop_of_each_image(tmp_path):
    x_tr, y_tr, x_te, y_te = fake_arrays()
    noisy = np.random.default_rng(3).integers(0, 256, size=x_tr.shape, dtype=np.uint8)
    task = make_task(tmp_path, (noisy, y_tr, x_te, y_te), augment=True)
    idx = torch.arange(6)
    aug = task.get_batch(idx)["x"]
    plain = task.normalise(task.x_train[idx])
    padded = torch.nn.functional.pad(plain, (4, 4, 4, 4))
    for i in range(6):
        cands = [
            p[:, dy : dy + 32, dx : dx + 32]
            for p in (padded[i], padded[i].flip(2))
            for dy in range(9)
            for dx in range(9)
        ]
        assert sum(torch.equal(aug[i], c) for c in cands) == 1
    assert not torch.equal(aug, plain)


def test_cnn5_per_example_gradients_match_loop_engine(tmp_path, arrays):
    from dp_adam_bench.engine.engines import build_engine

    task = make_task(tmp_path, arrays)
    batch = task.get_batch(torch.arange(3))
    grads = {}
    for name in ("loop", "functorch"):
        torch.manual_seed(0)
        eng = build_engine(name, task.build_model(), task.loss_per_example)
        grads[name] = eng.per_example_grads(batch)
        eng.close()
    for g, ref in zip(grads["functorch"], grads["loop"], strict=True):
        assert torch.allclose(g, ref, atol=1e-6, rtol=1e-4)


def test_registry_and_config(tmp_path, arrays):
    from dp_adam_bench.paths import CONFIG_DIR
    from dp_adam_bench.tasks.registry import build_task

    cfg = OmegaConf.load(CONFIG_DIR / "task" / "cifar10_cnn.yaml")
    assert cfg.name == "cifar10_cnn" and cfg.source == "auto" and cfg.eval_batch_size == 1000
    write_pickle_folder(tmp_path / "py", arrays)
    cfg.data_dir = str(tmp_path / "py")
    assert isinstance(build_task(cfg, trials=1, seed=0), Cifar10CNN)


@pytest.mark.skipif(not REAL_ARCHIVE.is_file(), reason=f"{REAL_ARCHIVE} not present")
@pytest.mark.slow
def test_real_jpeg_archive_decodes_to_cifar10():
    # Decoding all 60k JPEGs takes ~10 s here; the cache write is covered by the fixtures above.
    x_tr, y_tr, x_te, y_te = c10.decode_jpeg_tar(REAL_ARCHIVE)
    assert x_tr.shape == (50_000, 32, 32, 3) and x_te.shape == (10_000, 32, 32, 3)
    assert np.bincount(y_tr).tolist() == [5000] * 10 and np.bincount(y_te).tolist() == [1000] * 10
    means = x_tr.reshape(-1, 3).mean(0) / 255.0
    assert np.allclose(means, c10.MEAN, atol=1e-3)  # SOURCE.md: (0.49125, 0.48209, 0.44652) vs canonical


def augmented_run(data_dir, name: str, *extra: str) -> list[str]:
    """Overrides of a short private CNN5 run with augmentation on the fixture images, checkpointed every 2 steps."""
    from helpers import ON_CPU

    return [
        "task=cifar10_cnn",
        "task.source=pickle",
        f"task.data_dir={data_dir}",
        "task.augment=true",
        "task.eval_batch_size=10",
        f"experiment_name={name}",
        "optimizer=adam",
        "optimizer.lr=0.01",
        "noise=independent",
        "privacy.sigma=1.0",
        "privacy.clip=1.0",
        "train.sampler=poisson",
        "train.batch_size=4",
        "train.steps=4",
        "train.physical_batch_size=4",
        "train.checkpoint_every=2",
        "logger.wandb.mode=disabled",
        ON_CPU,
        *extra,
    ]


@pytest.mark.slow
def test_an_augmented_run_killed_and_resumed_ends_with_the_uninterrupted_run_weights(isolated_dirs, arrays):
    """The augmentation generator is in the checkpoint (``Cifar10CNN.rng_state``): without it the resumed run
    flipped and cropped other images than the uninterrupted one and ended with other weights."""
    from dp_adam_bench.engine import checkpoint as ckpt
    from dp_adam_bench.train import train

    from helpers import compose_cfg

    data = write_pickle_folder(isolated_dirs / "py", arrays)
    full = train(compose_cfg(augmented_run(data, "full")))
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg(augmented_run(data, "killed", "train.stop_after=2")))
    (path,) = (isolated_dirs / "runs" / "killed").glob(f"*/{ckpt.FILENAME}")
    saved = torch.load(path, weights_only=False)
    resumed = train(compose_cfg(augmented_run(data, "killed")))
    assert resumed["steps"] == 4 and resumed["final_params_sha1"] == full["final_params_sha1"]
    assert list(saved["task_rng"][0]) == ["augment"] and "rank 0 task 'augment'" in saved["rng_fingerprints"]


def test_a_restore_that_forgets_the_augmentation_generator_refuses_to_resume(
    isolated_dirs, arrays, monkeypatch
):
    from dp_adam_bench.engine.checkpoint import CheckpointError
    from dp_adam_bench.train import train

    from helpers import compose_cfg

    data = write_pickle_folder(isolated_dirs / "py", arrays)
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg(augmented_run(data, "forgot", "train.stop_after=2")))
    monkeypatch.setattr(Cifar10CNN, "load_rng_state", lambda self, state: None)  # the planted bug
    with pytest.raises(
        CheckpointError,
        match=r"^resume: the rank 0 task 'augment' generator after loading is not the one saved at step 2 .*"
        r"refusing to resume$",
    ):
        train(compose_cfg(augmented_run(data, "forgot")))
