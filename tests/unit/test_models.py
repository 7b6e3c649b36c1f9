"""The image classifiers: shapes, exact parameter counts, determinism, dropout, training, bad input."""

import pytest

torch = pytest.importorskip("torch")

from mpiopt.tasks.images import make_synthetic  # noqa: E402
from mpiopt.tasks.models import MODELS, build_model  # noqa: E402


def _count(model):
    return sum(p.numel() for p in model.parameters())


def _resnet20_params(channels, classes, width):
    """ResNet-20 with option-A shortcuts, layer by layer (He et al. 2016, section 4.2)."""
    conv = lambda c_in, c_out: 9 * c_in * c_out  # noqa: E731  3x3, no bias
    bn = lambda c: 2 * c  # noqa: E731  scale and shift
    total = conv(channels, width) + bn(width)
    c_in = width
    for c_out in (width, 2 * width, 4 * width):
        for _ in range(3):  # three basic blocks; the shortcuts have no parameters
            total += conv(c_in, c_out) + bn(c_out) + conv(c_out, c_out) + bn(c_out)
            c_in = c_out
    return total + 4 * width * classes + classes


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (3, 7, 9)])
def test_output_shape(name, shape):
    torch.manual_seed(0)
    model = build_model(name, input_shape=shape, num_classes=7)
    logits = model(torch.randn(3, *shape))
    assert logits.shape == (3, 7) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_parameter_counts_match_the_formulas():
    assert _resnet20_params(3, 10, 16) == 269_722  # the paper's "0.27M"
    resnet = build_model("resnet20", input_shape=(3, 32, 32), num_classes=10)
    assert _count(resnet) == _resnet20_params(3, 10, 16)
    assert _count(build_model("resnet20", input_shape=(1, 8, 8), num_classes=5, width=8)) == _resnet20_params(1, 5, 8)

    n, w, k = 64, 1024, 10
    mlp = build_model("mlp", input_shape=(1, 8, 8), num_classes=k, width=w)
    assert _count(mlp) == (n * w + w) + (w * w + w) + (w * k + k) == 1_126_410
    assert _count(mlp) >= 1_000_000
    assert _count(build_model("mlp", input_shape=(1, 8, 8), num_classes=10)) == 64 * 128 + 128 + 128 * 128 + 128 + 1290

    c, w, k = 3, 32, 10
    cnn = build_model("cnn", input_shape=(c, 32, 32), num_classes=k)
    assert _count(cnn) == 9 * c * w + 2 * w + 9 * w * 2 * w + 2 * 2 * w + 2 * w * 4 * k + k


@pytest.mark.parametrize("name", MODELS)
def test_initialisation_follows_the_torch_seed(name):
    def weights(seed):
        torch.manual_seed(seed)
        return build_model(name, input_shape=(1, 8, 8), num_classes=10).state_dict()

    first, again, other = weights(3), weights(3), weights(4)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first if first[key].is_floating_point())


@pytest.mark.parametrize("name", MODELS)
def test_dropout(name):
    x = torch.randn(4, 1, 8, 8)
    torch.manual_seed(0)
    model = build_model(name, input_shape=(1, 8, 8), num_classes=10, dropout=0.5)
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == 1
    model.train()
    assert not torch.equal(model(x), model(x))  # a new mask each call
    model.eval()
    assert torch.equal(model(x), model(x))

    # The default p = 0 is off and draws nothing from torch's generator.
    plain = build_model(name, input_shape=(1, 8, 8), num_classes=10).eval()
    state = torch.get_rng_state()
    plain.train()(x)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", MODELS)
def test_sgd_reduces_the_loss(name):
    data = make_synthetic(seed=0, n_train=256, n_test=1)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    torch.manual_seed(0)
    model = build_model(name, input_shape=data.input_shape, num_classes=data.num_classes, width=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Chance level is log(10) = 2.30; 25 full-batch steps fit well below it.
    assert losses[0] > 2.0 and losses[-1] < 0.5 * losses[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"unknown model 'vgg'.*'mlp', 'cnn', 'resnet20'"):
        build_model("vgg", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ValueError, match=r"input_shape for 'cnn' must be \(C, H, W\), got \(64,\)"):
        build_model("cnn", input_shape=(64,), num_classes=10)
    assert build_model("mlp", input_shape=(64,), num_classes=10)(torch.zeros(2, 64)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"H and W >= 2, got \(1, 1, 8\)"):
        build_model("cnn", input_shape=(1, 1, 8), num_classes=10)
    with pytest.raises(ValueError, match=r"positive ints, got \(1, 0, 8\)"):
        build_model("resnet20", input_shape=(1, 0, 8), num_classes=10)
    with pytest.raises(ValueError, match="num_classes must be >= 2, got 1"):
        build_model("mlp", input_shape=(1, 8, 8), num_classes=1)
    with pytest.raises(TypeError, match="num_classes must be an int"):
        build_model("mlp", input_shape=(1, 8, 8), num_classes=10.0)
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        build_model("cnn", input_shape=(1, 8, 8), num_classes=10, width=0)
    for dropout in (-0.1, 1.0, True, "0.5"):
        with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\)"):
            build_model("mlp", input_shape=(1, 8, 8), num_classes=10, dropout=dropout)
