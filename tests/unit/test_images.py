"""Image data without torch: the digits, CIFAR-10 and synthetic datasets, the shard sampler, augmentation."""

import gzip
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from mpiopt.tasks import images
from mpiopt.tasks.images import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DatasetError,
    ShardSampler,
    augment_cifar,
    batch_rng,
    load_dataset,
    make_synthetic,
)

CIFAR_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def _sklearn_digits_file():
    spec = importlib.util.find_spec("sklearn")
    for location in spec.submodule_search_locations if spec is not None else []:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    pytest.skip("scikit-learn's digits.csv.gz is not installed (pip install scikit-learn)")


# ----------------------------------------------------------------------------- digits


def test_digits_against_the_raw_file():
    path = _sklearn_digits_file()
    with gzip.open(path, "rt") as file:
        raw = np.array([[int(v) for v in line.split(",")] for line in file])
    data = load_dataset("digits")
    assert (len(data.y_train), len(data.y_test)) == (1438, 359) and len(raw) == 1797
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10 and data.classes[3] == "3"
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64

    # The standardisation is affine and increasing: the 17 pixel values 0..16 become 17 evenly spaced levels.
    levels = np.unique(data.x_train)
    assert len(levels) == 17
    np.testing.assert_allclose(np.diff(levels), levels[1] - levels[0], rtol=1e-4)
    pixels_train = np.searchsorted(levels, data.x_train).reshape(-1, 64)
    pixels_test = np.searchsorted(levels, data.x_test).reshape(-1, 64)
    # The train and test rows together are the file's rows, each exactly once.
    loaded = np.concatenate([np.column_stack([pixels_train, data.y_train]), np.column_stack([pixels_test, data.y_test])])
    np.testing.assert_array_equal(loaded[np.lexsort(loaded.T)], raw[np.lexsort(raw.T)])

    # Standardised by the statistics of the training pixels / 16, recomputed in float64.
    scaled = pixels_train / 16.0
    expected = (scaled - scaled.mean()) / scaled.std()
    np.testing.assert_allclose(data.x_train.reshape(-1, 64), expected, atol=1e-5)
    assert abs(data.x_test.mean()) < 0.1 and 0.9 < data.x_test.std() < 1.1

    # Stratified: every class has 20 % of its samples (rounded) in the test set.
    np.testing.assert_array_equal(np.bincount(data.y_test), np.round(0.2 * np.bincount(raw[:, -1])))


def test_digits_split_is_fixed_and_data_dir_works(tmp_path):
    path = _sklearn_digits_file()
    shutil.copy(path, tmp_path / "digits.csv.gz")
    first = load_dataset("digits", seed=0)
    for other in (load_dataset("digits", seed=7), load_dataset("digits", data_dir=tmp_path)):
        for field in ("x_train", "y_train", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(other, field), getattr(first, field))


def test_digits_missing_file(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="no digits.csv.gz in data_dir"):
        load_dataset("digits", data_dir=tmp_path)
    monkeypatch.setattr(images.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetError, match="pip install scikit-learn"):
        load_dataset("digits")


# ----------------------------------------------------------------------------- CIFAR-10


def _write_cifar(directory, records_per_file=3, seed=0):
    """Batch files in the exact binary format; returns {file: (labels, pixel bytes (n, 3072))}."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for index, name in enumerate(CIFAR_FILES):
        labels = (np.arange(records_per_file) + index) % 10
        pixels = rng.integers(0, 256, size=(records_per_file, 3072), dtype=np.uint8)
        with open(directory / name, "wb") as file:
            for label, row in zip(labels, pixels):
                file.write(bytes([label]) + row.tobytes())
        written[name] = (labels, pixels)
    return written


def _expected_image(row):
    """Record bytes -> normalised (3, 32, 32), one pixel at a time in float64."""
    image = np.empty((3, 32, 32))
    for channel in range(3):
        for y in range(32):
            for x in range(32):
                value = row[channel * 1024 + y * 32 + x] / 255.0
                image[channel, y, x] = (value - CIFAR10_MEAN[channel]) / CIFAR10_STD[channel]
    return image


def test_cifar10_reads_the_binary_format(tmp_path):
    written = _write_cifar(tmp_path / "cifar-10-batches-bin")
    # One record with a single bright pixel at channel 1 (green), row 2, column 5.
    labels, pixels = written["data_batch_2.bin"]
    pixels[1] = 0
    pixels[1, 1 * 1024 + 2 * 32 + 5] = 255
    with open(tmp_path / "cifar-10-batches-bin" / "data_batch_2.bin", "wb") as file:
        file.write(b"".join(bytes([label]) + row.tobytes() for label, row in zip(labels, pixels)))

    for data_dir in (tmp_path, tmp_path / "cifar-10-batches-bin"):  # the parent or the directory itself
        data = load_dataset("cifar10", data_dir=str(data_dir))
        assert data.x_train.shape == (15, 3, 32, 32) and data.x_test.shape == (3, 3, 32, 32)
        assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
        assert data.num_classes == 10 and data.classes[0] == "airplane" and data.input_shape == (3, 32, 32)
        train_labels = np.concatenate([written[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
        np.testing.assert_array_equal(data.y_train, train_labels)
        np.testing.assert_array_equal(data.y_test, written["test_batch.bin"][0])

    bright = data.x_train[4]  # second record of the second file
    assert np.unravel_index(np.argmax(bright - bright.min(axis=(1, 2), keepdims=True)), bright.shape) == (1, 2, 5)
    assert bright[1, 2, 5] == pytest.approx((1 - CIFAR10_MEAN[1]) / CIFAR10_STD[1], rel=1e-6)
    assert bright[0, 0, 0] == pytest.approx(-CIFAR10_MEAN[0] / CIFAR10_STD[0], rel=1e-6)
    np.testing.assert_allclose(data.x_train[0], _expected_image(written["data_batch_1.bin"][1][0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(data.x_test[2], _expected_image(written["test_batch.bin"][1][2]), rtol=1e-5, atol=1e-5)


def test_cifar10_missing_and_truncated_files(tmp_path):
    with pytest.raises(DatasetError, match="cifar10 needs data_dir"):
        load_dataset("cifar10")
    with pytest.raises(DatasetError, match="expected files: " + ", ".join(CIFAR_FILES).replace(".", r"\.")) as error:
        load_dataset("cifar10", data_dir=tmp_path / "nowhere")
    assert "nowhere' (no such directory)" in str(error.value)

    _write_cifar(tmp_path)
    (tmp_path / "data_batch_4.bin").unlink()
    with pytest.raises(DatasetError, match=r"missing data_batch_4\.bin\)"):
        load_dataset("cifar10", data_dir=tmp_path)

    _write_cifar(tmp_path)
    path = tmp_path / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(DatasetError, match=r"data_batch_3\.bin is truncated"):
        load_dataset("cifar10", data_dir=tmp_path)

    _write_cifar(tmp_path)
    record = bytearray((tmp_path / "test_batch.bin").read_bytes())
    record[0] = 42  # a label no CIFAR-10 file has
    (tmp_path / "test_batch.bin").write_bytes(bytes(record))
    with pytest.raises(DatasetError, match="test_batch.bin has label 42"):
        load_dataset("cifar10", data_dir=tmp_path)


# ----------------------------------------------------------------------------- synthetic and errors


def test_synthetic_is_deterministic_learnable_and_not_trivial():
    data = load_dataset("synthetic", seed=5, n_train=1000, n_test=2000)
    again = make_synthetic(seed=5, n_train=1000, n_test=2000)
    np.testing.assert_array_equal(data.x_train, again.x_train)
    assert not np.array_equal(data.x_train, make_synthetic(seed=6, n_train=1000).x_train)
    # The test set comes from its own stream: the training size does not change it.
    np.testing.assert_array_equal(make_synthetic(seed=5, n_train=10, n_test=2000).x_test, data.x_test)
    assert data.x_train.shape == (1000, 1, 8, 8) and data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert np.bincount(data.y_train).tolist() == [100] * 10

    # Nearest training-class centroid: far above chance (10 %), far from perfect.
    flat_train, flat_test = data.x_train.reshape(1000, -1), data.x_test.reshape(2000, -1)
    centroids = np.stack([flat_train[data.y_train == k].mean(0) for k in range(10)])
    predicted = np.argmin(((flat_test[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    assert 0.6 < np.mean(predicted == data.y_test) < 0.95

    small = make_synthetic(n_train=6, n_test=4, input_shape=(3, 5, 7), num_classes=3)
    assert small.x_train.shape == (6, 3, 5, 7) and small.input_shape == (3, 5, 7) and small.num_classes == 3


def test_dataset_errors():
    with pytest.raises(DatasetError, match=r"unknown dataset 'mnist'; expected one of 'digits', 'cifar10', 'synthetic'"):
        load_dataset("mnist")
    assert issubclass(DatasetError, ValueError)
    with pytest.raises(DatasetError, match=r"\['n_train'\] apply to the synthetic dataset only, not 'digits'"):
        load_dataset("digits", n_train=5)
    with pytest.raises(DatasetError, match="data_dir"):
        load_dataset("synthetic", data_dir="/tmp")
    with pytest.raises(DatasetError, match="n_train must be >= 1, got 0"):
        make_synthetic(n_train=0)
    with pytest.raises(DatasetError, match=r"input_shape must be \(C, H, W\)"):
        make_synthetic(input_shape=(64,))
    with pytest.raises(DatasetError, match="separation must be a number > 0"):
        make_synthetic(separation=0)


# ----------------------------------------------------------------------------- sampler


def _epoch(num_samples, world_size, batch_size, epoch, seed=3, **kwargs):
    """Every rank's indices over one epoch: (world_size, batches, batch_size)."""
    samplers = [
        ShardSampler(num_samples, rank=r, world_size=world_size, batch_size=batch_size, seed=seed, **kwargs)
        for r in range(world_size)
    ]
    batches = samplers[0].batches_per_epoch
    assert all(s.batches_per_epoch == batches for s in samplers)
    steps = range(epoch * batches, (epoch + 1) * batches)
    assert all(s.epoch_of(step) == epoch for s in samplers for step in steps)
    return np.array([[s.indices(step) for step in steps] for s in samplers])


@pytest.mark.parametrize("num_samples", [1, 7, 100, 128])
@pytest.mark.parametrize("world_size, batch_size", [(1, 1), (1, 32), (2, 5), (3, 4), (4, 8)])
def test_sampler_covers_every_sample_each_epoch(num_samples, world_size, batch_size):
    for epoch in (0, 1):
        shards = _epoch(num_samples, world_size, batch_size, epoch)
        assert shards.shape[1] == -(-num_samples // (world_size * batch_size))
        counts = np.bincount(shards.ravel(), minlength=num_samples)
        assert len(counts) == num_samples and counts.min() >= 1
        # Padding wraps around the permutation: no sample is used more than once more than another.
        assert counts.max() - counts.min() <= 1


def test_sampler_shards_disjoint_when_divisible_and_equal_to_one_big_batch():
    shards = _epoch(96, 4, 8, epoch=2)
    assert sorted(shards.ravel()) == list(range(96))
    # One step of 4 ranks with batch 8 uses the samples of one step of 1 rank with batch 32.
    single = ShardSampler(96, rank=0, world_size=1, batch_size=32, seed=3)
    for batch in range(3):
        np.testing.assert_array_equal(np.concatenate(shards[:, batch]), single.indices(2 * 3 + batch))


def test_sampler_is_stateless_deterministic_and_reshuffles():
    a = ShardSampler(50, rank=1, world_size=2, batch_size=4, seed=9)
    b = ShardSampler(50, rank=1, world_size=2, batch_size=4, seed=9)
    later = a.indices(20)
    assert a.batches_per_epoch == 7 and a.epoch_of(20) == 2 and a.epoch_of(6) == 0 and a.epoch_of(7) == 1
    np.testing.assert_array_equal(b.indices(0), a.indices(0))
    np.testing.assert_array_equal(b.indices(20), later)  # any order of calls, same answer
    assert a.indices(0).dtype == np.int64
    assert not np.array_equal(_epoch(50, 2, 4, 0, seed=9), _epoch(50, 2, 4, 1, seed=9))
    assert not np.array_equal(_epoch(50, 2, 4, 0, seed=9), _epoch(50, 2, 4, 0, seed=10))


def test_sampler_drop_last():
    shards = _epoch(30, 2, 4, epoch=1, drop_last=True)
    assert shards.shape == (2, 3, 4) and len(np.unique(shards)) == 24
    with pytest.raises(ValueError, match=r"num_samples=7 < world_size \* batch_size = 8"):
        ShardSampler(7, rank=0, world_size=2, batch_size=4, drop_last=True)


def test_sampler_state_dict_refuses_other_settings():
    sampler = ShardSampler(100, rank=1, world_size=2, batch_size=8, seed=4)
    state = sampler.state_dict()
    assert state == ShardSampler(100, rank=0, world_size=2, batch_size=8, seed=4).state_dict()
    sampler.load_state_dict(state)
    sampler.load_state_dict({key: np.asarray(value) for key, value in state.items()})  # as read from HDF5
    with pytest.raises(ValueError, match="batch_size: saved 16, now 8") as error:
        sampler.load_state_dict({**state, "batch_size": 16, "world_size": 4})
    assert "world_size: saved 4, now 2" in str(error.value)
    with pytest.raises(ValueError, match="seed: saved 'nothing', now 4"):
        sampler.load_state_dict({key: value for key, value in state.items() if key != "seed"})


def test_sampler_bad_arguments():
    with pytest.raises(ValueError, match=r"rank must be >= 0 and <= 1, got 2"):
        ShardSampler(10, rank=2, world_size=2, batch_size=1)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ShardSampler(10, rank=0, world_size=1, batch_size=0)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        ShardSampler(0, rank=0, world_size=1, batch_size=1)
    with pytest.raises(TypeError, match="seed must be an int"):
        ShardSampler(10, rank=0, world_size=1, batch_size=1, seed=1.5)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        ShardSampler(10, rank=0, world_size=1, batch_size=1).indices(-1)


# ----------------------------------------------------------------------------- augmentation


def _augment_reference(x, rng, padding):
    """One image at a time, drawing in the documented order: row offsets, column offsets, flips."""
    n = len(x)
    top = rng.integers(0, 2 * padding + 1, size=n)
    left = rng.integers(0, 2 * padding + 1, size=n)
    flip = rng.random(n) < 0.5
    out = np.empty_like(x)
    height, width = x.shape[2:]
    for i in range(n):
        padded = np.pad(x[i], ((0, 0), (padding, padding), (padding, padding)))
        crop = padded[:, top[i] : top[i] + height, left[i] : left[i] + width]
        out[i] = crop[:, :, ::-1] if flip[i] else crop
    return out, top, left, flip


@pytest.mark.parametrize("padding", [0, 1, 4])
@pytest.mark.parametrize("shape", [(64, 3, 32, 32), (9, 2, 5, 7)])
def test_augment_matches_a_per_image_loop(padding, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    original = x.copy()
    out = augment_cifar(x, batch_rng(1, 2, 30), padding=padding)
    expected, top, left, flip = _augment_reference(x, batch_rng(1, 2, 30), padding)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(x, original)
    assert out.shape == x.shape and out.dtype == np.float32
    if shape[0] == 64:  # the random draws really vary
        assert flip.any() and not flip.all() and (padding == 0 or len(np.unique(top)) > 1)
    # In place gives the same.
    assert augment_cifar(x, batch_rng(1, 2, 30), padding=padding, out=x) is x
    np.testing.assert_array_equal(x, expected)


def test_augment_zero_padding_at_the_borders():
    x = np.ones((200, 3, 32, 32), np.float32)
    out = augment_cifar(x, batch_rng(0, 0, 0), padding=4)
    _, top, left, _ = _augment_reference(x, batch_rng(0, 0, 0), 4)
    # The window keeps 32 - |offset - 4| rows and columns of the image; the rest is the zero border.
    kept = (32 - np.abs(top - 4)) * (32 - np.abs(left - 4)) * 3
    np.testing.assert_array_equal(out.sum(axis=(1, 2, 3)), kept)
    i = np.flatnonzero(top == 0)[0]  # the window starts in the padding: the top 4 rows are zero
    assert np.all(out[i, :, :4] == 0) and np.all(out[i, :, 4:].sum(axis=(0, 2)) == 3 * (32 - abs(left[i] - 4)))
    assert set(np.unique(out)) == {0.0, 1.0}


def test_augment_is_reproducible_from_batch_rng():
    x = np.random.default_rng(1).standard_normal((16, 3, 32, 32)).astype(np.float32)
    first = augment_cifar(x, batch_rng(5, 1, 100))
    np.testing.assert_array_equal(augment_cifar(x, batch_rng(5, 1, 100)), first)
    for other in (batch_rng(5, 1, 101), batch_rng(5, 0, 100), batch_rng(6, 1, 100)):
        assert not np.array_equal(augment_cifar(x, other), first)


def test_augment_bad_arguments():
    rng = batch_rng(0, 0, 0)
    x = np.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(ValueError, match="x must be 4-D"):
        augment_cifar(x[0], rng)
    with pytest.raises(TypeError, match="x must have a dtype of kind 'f'"):
        augment_cifar(x.astype(np.uint8), rng)
    with pytest.raises(ValueError, match="out must be a C-contiguous float32 array of shape"):
        augment_cifar(x, rng, out=np.zeros((2, 3, 8, 9), np.float32))
    with pytest.raises(ValueError, match="padding must be >= 0, got -1"):
        augment_cifar(x, rng, padding=-1)
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        augment_cifar(x, np.random.RandomState(0))
    with pytest.raises(ValueError, match="step must be >= 0"):
        batch_rng(0, 0, -1)
