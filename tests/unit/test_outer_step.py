"""DiLoCo's outer step (mpiopt.kernels.update.outer_sgd): the fused pass (C loop, CUDA kernel) and the array code
against numpy expressions rounded op by op, and against torch.optim.SGD in float64."""

import numpy as np
import pytest

from mpiopt.algorithms.diloco import outer_step
from mpiopt.arrays import array_module
from mpiopt.kernels import update
from mpiopt.kernels.update import outer_sgd

# (momentum, nesterov, out, alpha): no momentum, heavy ball, Nesterov; no output, a copy, Streaming DiLoCo's mix.
RULES = [
    (momentum, nesterov, out, alpha)
    for momentum in (0.0, 0.9)
    for nesterov in (False, True)
    for out, alpha in ((False, 0.0), (True, 0.0), (True, 0.5), (True, 0.3))
    if momentum or not nesterov
]
LR = 0.7
WORLD = 3
# Long enough for 3 parts of at least 2**18 elements (mpiopt/kernels/_parallel.h), with a ragged end.
SPLIT_SIZE = 3 * 2**18 + 13


def awkward(rng, size, dtype):
    """Random values with NaN, +-inf, +-0.0 and a subnormal sprinkled in."""
    values = (rng.standard_normal(size) * 3).astype(dtype)
    if size:
        spots = rng.integers(0, size, max(1, size // 50))
        values[spots] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], dtype=dtype), spots.size)
    return values


@np.errstate(all="ignore")
def reference(x, total, b, out, momentum, nesterov, alpha):
    """The outer step as numpy expressions, each operation rounded to x's dtype (docs/internals-kernels.md)."""
    t = x.dtype.type
    d = x - total / t(WORLD)
    s = d
    if momentum:
        b = b * t(momentum) + d
        s = d + b * t(momentum) if nesterov else b
    x = x - s * t(LR)
    if out is not None:
        out = out * t(alpha) + x * t(1.0 - alpha) if alpha else x.copy()
    return x, b, out


def assert_same_bits(actual, expected):
    """Equal bit for bit, except that any NaN matches any NaN (payloads are not part of the contract)."""
    actual = actual.get() if hasattr(actual, "get") else actual
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    bits = {4: np.uint32, 8: np.uint64}[actual.dtype.itemsize]
    np.testing.assert_array_equal(actual[~nan].view(bits), expected[~nan].view(bits))


def array_code_only(monkeypatch):
    """As where neither the C loop nor the CUDA kernels exist."""
    monkeypatch.setattr(update, "_updatec", None)
    monkeypatch.setattr(update._cuda, "takes", lambda x: False)


def run_outer_steps(xp, size, dtype, rule, steps=3):
    """``steps`` outer steps on ``xp`` arrays and of the reference from the same inputs; asserts the same bits."""
    momentum, nesterov, with_out, alpha = rule
    rng = np.random.default_rng([size, np.dtype(dtype).itemsize, int(momentum * 10), nesterov, with_out, int(alpha * 10)])
    x = awkward(rng, size, dtype)
    b = np.zeros(size, dtype) if momentum else None  # DiLoCo's buffer starts as zeros
    out = awkward(rng, size, dtype) if with_out else None
    on = [None if a is None else xp.array(a, copy=True) for a in (x, b, out)]  # apart from the reference's
    for _ in range(steps):
        total = awkward(rng, size, dtype)
        outer_sgd(on[0], xp.array(total, copy=True), WORLD, on[1], lr=LR, momentum=momentum, nesterov=nesterov, out=on[2], alpha=alpha)
        x, b, out = reference(x, total, b, out, momentum, nesterov, alpha)
        for actual, expected in zip(on, (x, b, out)):
            if expected is not None:
                assert_same_bits(actual, expected)


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda t: t.__name__)
@pytest.mark.parametrize("size", [0, 1, 7, 10_007])
def test_fused_pass_equals_the_reference(xp, size, dtype, rule):
    run_outer_steps(xp, size, dtype, rule)


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("size", [7, 10_007])
def test_array_code_equals_the_reference(size, rule, monkeypatch):
    """numpy's (cupy's own array code flushes float32 subnormals, which the inputs hold: docs/internals-kernels.md)."""
    array_code_only(monkeypatch)
    run_outer_steps(np, size, np.float32, rule)


@pytest.mark.parametrize("rule", [RULES[2], RULES[-1]], ids=str)
def test_views_at_an_offset_give_the_same_bits(xp, rule):
    """Arrays one element into their allocation: the C loop on views, the CUDA kernel's one-element path."""
    momentum, nesterov, with_out, alpha = rule
    rng = np.random.default_rng(3)
    size = 1001
    whole = {name: xp.asarray(awkward(rng, size + 1, np.float32)) for name in ("x", "total", "out")}
    whole["b"] = xp.zeros(size + 1, np.float32)
    x, total, out, b = (whole[name][1:] for name in ("x", "total", "out", "b"))
    want = reference(*(a.get() if hasattr(a, "get") else a.copy() for a in (x, total, b, out)), momentum, nesterov, alpha)
    outer_sgd(x, total, WORLD, b if momentum else None, lr=LR, momentum=momentum, nesterov=nesterov, out=out, alpha=alpha)
    for actual, expected in zip((x, b, out), want):
        if expected is not None and (actual is not b or momentum):
            assert_same_bits(actual, expected)


@pytest.mark.parametrize("rule", [RULES[1], RULES[-1]], ids=str)
def test_threads_give_the_same_bits(rule, kernel_threads):
    kernel_threads(3)
    run_outer_steps(np, SPLIT_SIZE, np.float32, rule, steps=2)


def test_fused_pass_leaves_the_sum_unchanged():
    if not update.fused_update_available(np.zeros(1, np.float32)):
        pytest.skip("the C loop is not built: the array code uses the sum as scratch")
    total = np.arange(5, dtype=np.float32)
    before = total.copy()
    outer_sgd(np.ones(5, np.float32), total, 2, np.zeros(5, np.float32), lr=0.5, momentum=0.9, nesterov=True)
    assert_same_bits(total, before)


@pytest.mark.parametrize("nesterov", [False, True])
def test_is_torch_sgd_on_the_mean_pseudo_gradient_in_float64(nesterov):
    """An independent reference: torch.optim.SGD on Delta = theta - mean_i theta_i over 4 outer steps (1e-12)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    theta = rng.standard_normal(1000)
    buffer = np.zeros_like(theta)
    param = torch.nn.Parameter(torch.from_numpy(theta.copy()))
    opt = torch.optim.SGD([param], lr=LR, momentum=0.9, nesterov=nesterov)
    for _ in range(4):
        workers = theta + 0.1 * rng.standard_normal((WORLD, theta.size))
        param.grad = param.detach() - torch.from_numpy(workers.mean(axis=0))
        opt.step()
        outer_step(theta, workers.sum(axis=0), WORLD, lr=LR, momentum=0.9, nesterov=nesterov, buffer=buffer)
        np.testing.assert_allclose(theta, param.detach().numpy(), rtol=0, atol=1e-12)


def test_the_plain_mean_and_its_mix():
    """lr = 1 without momentum is the mean itself, exactly; the mix is alpha * out + (1 - alpha) * mean."""
    theta, total, out = np.zeros(4), np.array([3.0, 6.0, -3.0, 0.3]), np.full(4, 2.0)
    outer_step(theta, total.copy(), 3, lr=1.0, momentum=0.0, nesterov=True, buffer=None, out=out, alpha=0.25)
    np.testing.assert_array_equal(theta, total / 3)
    np.testing.assert_allclose(out, 0.25 * 2.0 + 0.75 * total / 3, rtol=1e-15)


def test_bad_arguments_are_named():
    x, total = np.zeros(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="momentum=0.9 needs a buffer"):
        outer_sgd(x, total, 2, None, lr=1.0, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="alpha=0.5 mixes into out, got out=None"):
        outer_sgd(x, total, 2, None, lr=1.0, momentum=0.0, nesterov=False, alpha=0.5)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        outer_sgd(x, total, 0, None, lr=1.0, momentum=0.0, nesterov=False)
    with pytest.raises(ValueError, match="lr must be a finite real number, got nan"):
        outer_sgd(x, total, 2, None, lr=float("nan"), momentum=0.0, nesterov=False)
    with pytest.raises(ValueError, match="total must be a numpy array of shape"):
        outer_sgd(x, np.zeros(3, np.float32), 2, None, lr=1.0, momentum=0.0, nesterov=False)
    with pytest.raises(TypeError, match="total must have dtype float32"):
        outer_sgd(x, np.zeros(4), 2, None, lr=1.0, momentum=0.0, nesterov=False)
    with pytest.raises(ValueError, match="params and out must not overlap"):
        outer_sgd(x, total, 2, None, lr=1.0, momentum=0.0, nesterov=False, out=x)
    assert array_module(x) is np
