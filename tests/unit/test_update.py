"""The fused SGD update (C loop and array code) against a plain numpy reference and torch.optim.SGD."""

import shutil

import numpy as np
import pytest

from mpiopt.algorithms.local import LocalSGD
from mpiopt.kernels import threads, update
from mpiopt.kernels.update import fused_update_available, sgd_update

SIZES = [0, 1, 7, 1_000_003]
DTYPES = [np.float32, np.float64]
# (momentum, dampening, nesterov, weight_decay, grad_divisor): every combination torch.optim.SGD
# accepts (dampening only with momentum, where it means something), with and without the
# division of an average
RULES = [
    (momentum, dampening, nesterov, weight_decay, divisor)
    for momentum in (0.0, 0.9)
    for dampening in (0.0, 0.3)
    for nesterov in (False, True)
    for weight_decay in (0.0, 1e-2)
    for divisor in (1, 3)
    if (momentum or not dampening) and (not nesterov or (momentum and not dampening))
]
TORCH_RULES = [rule[:4] for rule in RULES if rule[4] == 1]
LR = 0.1


@np.errstate(all="ignore")
def reference(x, g, b, momentum, dampening, nesterov, weight_decay, first_step, divisor=1):
    """torch.optim.SGD's rule as numpy expressions, each operation rounded to x's dtype."""
    t = x.dtype.type
    if divisor != 1:
        g = g / t(divisor)
    d = x * t(weight_decay) + g if weight_decay else g
    s = d
    if momentum:
        if first_step:
            b = d.copy()
        else:
            b = b * t(momentum) + (d * t(1.0 - dampening) if dampening else d)
        s = d + b * t(momentum) if nesterov else b
    return x - s * t(LR), b


def awkward(rng, size, dtype, special):
    """Random values with NaN, +-inf and +-0.0 sprinkled in where ``special``."""
    values = (rng.standard_normal(size) * 3).astype(dtype)
    if special and size:
        spots = rng.integers(0, size, max(1, size // 50))
        values[spots] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], dtype=dtype), spots.size)
    return values


def assert_same_bits(actual, expected):
    """Equal bit for bit, except that any NaN matches any NaN (payloads are not part of the contract)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[actual.dtype.itemsize]
    np.testing.assert_array_equal(actual[~nan].view(bits), expected[~nan].view(bits))


def run_steps(size, dtype, rule, special, steps=3):
    """``steps`` steps of sgd_update and of the reference from the same inputs; asserts they agree."""
    momentum, dampening, nesterov, weight_decay, divisor = rule
    rng = np.random.default_rng([size, np.dtype(dtype).itemsize, *(int(v * 10) for v in rule)])
    x = awkward(rng, size, dtype, special)
    b = np.empty_like(x) if momentum else None
    want_x, want_b = x.copy(), None
    for step in range(steps):
        g = awkward(rng, size, dtype, special)
        g_before = g.copy()
        finite = sgd_update(
            x, g, b, lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov,
            weight_decay=weight_decay, first_step=step == 0, grad_divisor=divisor, check_finite=True,
        )
        want_x, want_b = reference(want_x, g, want_b, momentum, dampening, nesterov, weight_decay, step == 0, divisor)
        assert finite is bool(np.isfinite(g).all())
        assert_same_bits(g, g_before)  # grad is read only
        assert_same_bits(x, want_x)
        if momentum:
            assert_same_bits(b, want_b)
    return x, b


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size", SIZES)
def test_update_equals_reference(size, dtype, rule):
    run_steps(size, dtype, rule, special=True, steps=2 if size > 1000 else 3)


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size", [0, 7, 10_007])
def test_array_code_equals_reference_and_c_loop(size, dtype, rule, monkeypatch):
    """The array code (forced) gives the reference's bits, and so the C loop's."""
    fused = run_steps(size, dtype, rule, special=True)
    monkeypatch.setattr(update, "_updatec", None)
    assert not fused_update_available(np.zeros(1, dtype))
    array_code = run_steps(size, dtype, rule, special=True)
    for got, want in zip(array_code, fused):
        if want is not None:
            assert_same_bits(got, want)


def test_c_extension_built_when_compiler_present():
    if shutil.which("cc") or shutil.which("gcc"):
        assert update._updatec is not None, "mpiopt.kernels._updatec was not built although a C compiler is present"
    if update._updatec is None:
        pytest.skip("mpiopt.kernels._updatec not built (no C compiler): the array code runs everywhere")
    assert fused_update_available(np.zeros(3, np.float32)) and fused_update_available(np.zeros(3, np.float64))
    assert not fused_update_available(np.zeros(3, np.float16))


def test_check_finite_is_optional_and_exact(monkeypatch):
    x, b = np.ones(5, np.float32), np.zeros(5, np.float32)
    g = np.array([1, 2, 3, 4, 5], np.float32)
    assert sgd_update(x, g, lr=LR) is None
    for c_loop in (True, False):
        if not c_loop:
            monkeypatch.setattr(update, "_updatec", None)
        assert sgd_update(x, g, b, lr=LR, momentum=0.5, first_step=True, check_finite=True) is True
        for bad in (np.nan, np.inf, -np.inf):
            g[3] = bad
            assert sgd_update(x.copy(), g, b.copy(), lr=LR, momentum=0.5, check_finite=True) is False
        g[3] = np.finfo(np.float32).max  # the largest finite value is finite
        assert sgd_update(x, g, b, lr=LR, momentum=0.5, check_finite=True) is True


def test_other_dtypes_and_strides_take_the_array_code():
    """float16 and a strided gradient still follow the reference (through the array code)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(33).astype(np.float16)
    g = rng.standard_normal(33).astype(np.float16)
    want, _ = reference(x.copy(), g, None, 0.0, 0.0, False, 0.5, False)
    sgd_update(x, g, lr=LR, weight_decay=0.5)
    assert_same_bits(x, want)
    x = rng.standard_normal(10)
    g = rng.standard_normal(20)[::2]
    want, _ = reference(x.copy(), g, None, 0.0, 0.0, False, 0.0, False)
    sgd_update(x, g, lr=LR)
    assert_same_bits(x, want)


def test_bad_arguments():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="momentum=0.9 needs a buffer"):
        sgd_update(x, x.copy(), lr=LR, momentum=0.9)
    with pytest.raises(TypeError, match="grad must have dtype float32, got float64"):
        sgd_update(x, np.zeros(4), lr=LR)
    with pytest.raises(ValueError, match=r"buffer must be a numpy array of shape \(4,\)"):
        sgd_update(x, x.copy(), np.zeros(5, np.float32), lr=LR, momentum=0.9)
    with pytest.raises(ValueError, match="params and grad must not overlap"):
        sgd_update(x, x, lr=LR)
    with pytest.raises(ValueError, match="grad and buffer must not overlap"):
        g = np.zeros(8, np.float32)
        sgd_update(x, g[:4], g[2:6], lr=LR, momentum=0.9)
    with pytest.raises(ValueError, match="lr must be a finite real number, got nan"):
        sgd_update(x, x.copy(), lr=float("nan"))
    with pytest.raises(ValueError, match="grad_divisor must be >= 1, got 0"):
        sgd_update(x, x.copy(), lr=LR, grad_divisor=0)
    with pytest.raises(TypeError, match="nesterov must be a bool, got 1"):
        sgd_update(x, x.copy(), lr=LR, nesterov=1)
    with pytest.raises(ValueError, match="params must be 1-D"):
        sgd_update(x.reshape(2, 2), x.reshape(2, 2).copy(), lr=LR)


@pytest.mark.parametrize("rule", TORCH_RULES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_local_sgd_follows_torch_sgd(dtype, rule):
    """LocalSGD over several steps: the reference's bits, and torch.optim.SGD's values to rounding.

    Not torch's bits: torch computes ``param + (-lr) * step`` (and ``grad + alpha * x``) with a
    fused multiply-add, one rounding where numpy and the C loop round twice; about 10% of the
    float32 elements differ in the last bit after one step.
    """
    torch = pytest.importorskip("torch")
    momentum, dampening, nesterov, weight_decay = rule
    rng = np.random.default_rng(7)
    x = rng.standard_normal(1001).astype(dtype)
    want_x, want_b = x.copy(), None
    param = torch.tensor(x.copy(), requires_grad=True)
    opt = torch.optim.SGD([param], lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=weight_decay, foreach=False)
    local = LocalSGD(momentum, dampening, nesterov, weight_decay)
    local.allocate(x)
    for step in range(6):
        g = rng.standard_normal(x.size).astype(dtype)
        local.apply(x, g, LR)
        want_x, want_b = reference(want_x, g, want_b, momentum, dampening, nesterov, weight_decay, step == 0)
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        assert_same_bits(x, want_x)
        if momentum:
            assert_same_bits(local.buffer, want_b)
            np.testing.assert_allclose(local.buffer, opt.state[param]["momentum_buffer"].numpy(), rtol=1e-5, atol=1e-6)
        else:
            assert local.buffer is None
        tol = 1e-5 if dtype == np.float32 else 1e-13
        np.testing.assert_allclose(x, param.detach().numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_local_sgd_groups_are_each_groups_own_update_on_its_slice(dtype):
    """Parameter groups over contiguous slices: bitwise the one-group update run on each slice with that group's
    settings (one fused call per group), and torch.optim.SGD with the same groups to rounding (torch's FMA)."""
    torch = pytest.importorskip("torch")
    groups = [(0, 400), (400, 401), (401, 1001)]
    settings = [dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01),
                dict(lr=0.05, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
                dict(lr=0.2, momentum=0.5, dampening=0.25, nesterov=False, weight_decay=0.0)]
    rng = np.random.default_rng(11)
    x = rng.standard_normal(1001).astype(dtype)
    start = x.copy()
    slices = [x[a:b].copy() for a, b in groups]
    params = [torch.tensor(part.copy(), requires_grad=True) for part in slices]
    opt = torch.optim.SGD([{"params": [p], **values} for p, values in zip(params, settings)], lr=1.0, foreach=False)
    local = LocalSGD()
    local.set_groups(groups)
    local.set_group_values(settings)
    alone = [LocalSGD(**{k: v for k, v in values.items() if k != "lr"}) for values in settings]
    for step in range(5):
        g = rng.standard_normal(x.size).astype(dtype)
        local.apply(x, g, lr=1.0)
        for (a, b), part, one, values, param in zip(groups, slices, alone, settings, params):
            one.apply(part, g[a:b].copy(), values["lr"])
            param.grad = torch.from_numpy(g[a:b].copy())
        opt.step()
        for (a, b), part, param in zip(groups, slices, params):
            assert_same_bits(x[a:b], part)
            tol = 1e-5 if dtype == np.float32 else 1e-13
            np.testing.assert_allclose(x[a:b], param.detach().numpy(), rtol=tol, atol=tol)
    assert all((x[a:b] != start[a:b]).all() for a, b in groups)  # every group's parameters moved


def test_local_sgd_buffer_appears_at_the_first_step(monkeypatch):
    """The buffer is None until the first step, then the decayed gradient; scratch only for the array code, once."""
    for c_loop in (True, False):
        if not c_loop:
            monkeypatch.setattr(update, "_updatec", None)
        x = np.arange(5, dtype=np.float32)
        g = np.ones(5, np.float32)
        local = LocalSGD(momentum=0.9, nesterov=True, weight_decay=0.5)
        local.allocate(x)
        assert local.buffer is None
        want_b = x * np.float32(0.5) + g
        local.apply(x, g, LR)
        np.testing.assert_array_equal(local.buffer, want_b)
        buffer, work = local.buffer, list(local._work)
        assert len(work) == (0 if c_loop else 2)
        local.apply(x, g, LR)
        assert local.buffer is buffer  # updated in place from then on, with the same scratch
        assert len(local._work) == len(work) and all(a is b for a, b in zip(local._work, work))


def test_update_benchmark_reports_every_variant():
    """mpiopt.bench.update's dict: a median and a ratio per variant, a verdict per goal (tiny d)."""
    pytest.importorskip("torch")
    from mpiopt.algorithms import algorithm_class
    from mpiopt.bench.update import UNIT, measure

    results = measure(d=1000, rounds=1, steps=2, algorithms=["sgd", "easgd"])
    assert results["ratio"][UNIT] == 1.0
    assert set(results["goals"]) == {"sgd", "easgd"}
    for name, verdict in results["goals"].items():
        assert verdict["goal"] == algorithm_class(name).update_goal and verdict["met"] == (verdict["ratio"] <= verdict["goal"])
    assert all(count == 2 for count in results["samples"].values())



def test_the_profile_counts_a_steps_kernels_and_waits_from_the_profilers_events():
    """bench.profile.summarize on a real torch.profiler record (torch's CPU ops standing in for kernels, 4 steps of fused
    SGD) plus two host-wait events: per-step calls and times, the waits less the step's own sync, the costliest first."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from mpiopt.bench.profile import markdown, summarize

    param = torch.zeros(1000, requires_grad=True)
    param.grad = torch.ones(1000)
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, fused=True)
    opt.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            opt.step()
    events = list(prof.key_averages())
    fused = next(e for e in events if e.key == "aten::_fused_sgd_")
    assert fused.count == 4
    host_calls = [SimpleNamespace(key=key, count=count, device_type=None) for key, count in
                  [("cudaStreamSynchronize", 6), ("cudaDeviceSynchronize", 4), ("cudaMemcpy", 2), ("cudaMemcpyAsync", 5)]]
    summary = summarize(events + host_calls, 4, DeviceType.CPU, wall=0.002, own_waits=1, top=50)
    assert summary["wall_ms"] == pytest.approx(0.5)
    assert summary["waits"] == (6 + 4 + 2 - 4) / 4  # not the asynchronous copy, nor the benchmark's own sync a step
    names = [name for name, _, _ in summary["top"]]
    assert "aten::_fused_sgd_" in names and "cudaStreamSynchronize" not in names
    calls = {name: per_step for name, per_step, _ in summary["top"]}
    assert calls["aten::_fused_sgd_"] == 1.0
    assert summary["kernels"] == sum(e.count for e in events) / 4
    times = [us for _, _, us in summary["top"]]
    assert times == sorted(times, reverse=True) and summary["device_ms"] == pytest.approx(sum(times) / 1e3)
    assert sum(times) == pytest.approx(sum(e.self_cpu_time_total for e in events) / 4)
    text = markdown({"fused": summary, "empty": {**summary, "top": []}})
    assert "### fused" in text and "`aten::_fused_sgd_`" in text and "(none)" in text


def test_a_profile_on_the_cpu_is_refused_before_any_work():
    pytest.importorskip("torch")
    from mpiopt.bench.update import measure
    from mpiopt.training.config import UsageError

    with pytest.raises(UsageError, match="--profile needs --device cuda.*got --device cpu"):
        measure(d=10**12, rounds=1, steps=1, algorithms=["sgd"], profile=True)  # d that large would fail if allocated

# Long enough for 3 parts of at least 2**18 elements (mpiopt/kernels/_parallel.h), with a ragged end.
SPLIT_SIZE = 3 * 2**18 + 13


@pytest.mark.parametrize("rule", [RULES[0], (0.9, 0.0, True, 1e-2, 3), (0.9, 0.3, False, 0.0, 1)], ids=str)
@pytest.mark.parametrize("count", [2, 3, 7])
def test_threads_give_the_same_bits(count, rule, kernel_threads):
    """Split across threads, the update gives the one-thread reference's bits and the exact finite flag."""
    kernel_threads(count)
    run_steps(SPLIT_SIZE, np.float32, rule, special=True, steps=2)
    x, g = np.ones(SPLIT_SIZE, np.float32), np.ones(SPLIT_SIZE, np.float32)
    for spot in (0, SPLIT_SIZE // 2, SPLIT_SIZE - 1):  # a non-finite value in the first, a middle and the last part
        g[spot] = np.inf
        assert sgd_update(x, g, lr=LR, check_finite=True) is False
        g[spot] = 1.0
    assert sgd_update(x, g, lr=LR, check_finite=True) is True


@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_all_finite_is_exact(dtype, c_loop, kernel_threads, monkeypatch):
    """all_finite against np.isfinite(...).all(): every spot of short vectors, each quarter and part of long ones."""
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    big = np.finfo(dtype).max
    for count in (1, 3):
        kernel_threads(count)
        for size in [*range(10), 1_000_003, SPLIT_SIZE]:
            values = np.full(size, big, dtype)  # the largest finite values: their sum overflows
            values[::2] = -0.0
            assert update.all_finite(values)
            spots = range(size) if size < 10 else np.linspace(0, size - 1, 23).astype(int)
            for spot in spots:
                for bad in (np.nan, np.inf, -np.inf):
                    values[spot] = bad
                    assert not update.all_finite(values), (size, spot, bad)
                values[spot] = big


@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_divide_finite_is_numpys_division_and_an_exact_check(dtype, c_loop, kernel_threads, monkeypatch):
    """divide_finite: the bits of np.divide (into another buffer or in place) and np.isfinite(grad).all()."""
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    rng = np.random.default_rng(5)
    for count in (1, 3):
        kernel_threads(count)
        for size in (1, 7, SPLIT_SIZE):
            grad = (rng.standard_normal(size) * 1e3).astype(dtype)
            for divisor in (1, 3, 4):
                out = np.empty_like(grad)
                assert update.divide_finite(grad, divisor, out) is True
                np.testing.assert_array_equal(out, np.divide(grad, divisor))
                spot = size // 2
                for bad in (np.nan, np.inf, -np.inf):
                    dirty = grad.copy()
                    dirty[spot] = bad
                    assert update.divide_finite(dirty, divisor, out) is False, (size, bad)
            inplace = grad.copy()
            assert update.divide_finite(inplace, 3, inplace) is True
            np.testing.assert_array_equal(inplace, np.divide(grad, 3))


def test_thread_count_is_checked(kernel_threads, monkeypatch):
    for bad in (0, -1, 65, 2.0, True, "2"):
        with pytest.raises(ValueError, match="threads must be an integer in \\[1, 64\\]"):
            kernel_threads(bad)
    for text, want in (("", 1), (" 3 ", 3)):
        monkeypatch.setenv("MPIOPT_NUM_THREADS", text)
        assert threads._from_environment() == want
    for text in ("0", "two", "1.5"):
        monkeypatch.setenv("MPIOPT_NUM_THREADS", text)
        with pytest.raises(ValueError, match=f"MPIOPT_NUM_THREADS must be an integer in \\[1, 64\\], got '?{text}'?"):
            threads._from_environment()


# -- copy_to: the updated parameters also written into a second array -------------------------------


@pytest.mark.parametrize("copies", [1, 2], ids=["one", "two"])
@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("rule", [RULES[0], (0.9, 0.0, True, 1e-2, 3), (0.9, 0.3, False, 0.0, 1)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size, count", [(0, 1), (1, 1), (7, 1), (SPLIT_SIZE, 1), (SPLIT_SIZE, 3)])
def test_copy_to_receives_the_updated_params(size, count, dtype, rule, c_loop, copies, kernel_threads, monkeypatch):
    """With copy_to (an array, or a tuple of two), params and buffer get the reference's bits (as without
    it) and every copy params' bits."""
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    kernel_threads(count)
    momentum, dampening, nesterov, weight_decay, divisor = rule
    rng = np.random.default_rng([size, count, np.dtype(dtype).itemsize])
    x = awkward(rng, size, dtype, special=True)
    b = awkward(rng, size, dtype, special=True) if momentum else None
    want_x, want_b = x.copy(), None if b is None else b.copy()
    targets = [np.full(size, 7.0, dtype) for _ in range(copies)]
    copy_to = targets[0] if copies == 1 else tuple(targets)
    for step in range(2):
        g = awkward(rng, size, dtype, special=True)
        finite = sgd_update(
            x, g, b, lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
            first_step=step == 0, grad_divisor=divisor, check_finite=True, copy_to=copy_to if step else None,
        )
        want_x, want_b = reference(want_x, g, want_b, momentum, dampening, nesterov, weight_decay, step == 0, divisor)
        assert finite is bool(np.isfinite(g).all())
        assert_same_bits(x, want_x)
        if momentum:
            assert_same_bits(b, want_b)
        if not step:
            assert all(np.all(copy == 7.0) for copy in targets)  # untouched without copy_to
    for copy in targets:
        assert_same_bits(copy, want_x)


def test_copy_to_is_checked():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="params and copy_to must not overlap"):
        sgd_update(x, x.copy(), lr=LR, copy_to=x)
    with pytest.raises(TypeError, match="copy_to must have dtype float32, got float64"):
        sgd_update(x, x.copy(), lr=LR, copy_to=np.zeros(4))
    with pytest.raises(ValueError, match=r"copy_to must be a numpy array of shape \(4,\)"):
        sgd_update(x, x.copy(), lr=LR, copy_to=np.zeros(3, np.float32))
    copy = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"copy_to\[0\] and copy_to\[1\] must not overlap"):
        sgd_update(x, x.copy(), lr=LR, copy_to=(copy, copy))
    with pytest.raises(ValueError, match="copy_to takes at most 2 arrays .*, got 3"):
        sgd_update(x, x.copy(), lr=LR, copy_to=[np.zeros(4, np.float32) for _ in range(3)])


# -- merge_average: DaSGD's merge ---------------------------------------------------------------------

MERGE_CASES = [("delayed", 0.25), ("proportion", 0.3), ("proportion", 0.0), ("proportion", 1.0)]


@np.errstate(all="ignore")
def merge_reference(x, snapshot, total, world_size, rule, proportion):
    """DaSGD's merge as out-of-place numpy expressions, each operation rounded to x's dtype."""
    t = x.dtype.type
    average = total / t(world_size)
    if rule == "delayed":
        return (x - snapshot) + average
    return x * t(proportion) + average * t(1.0 - proportion)


@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("rule, proportion", MERGE_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size, count", [(0, 1), (1, 1), (7, 1), (SPLIT_SIZE, 1), (SPLIT_SIZE, 3)])
def test_merge_average_equals_reference(size, count, dtype, rule, proportion, c_loop, kernel_threads, monkeypatch):
    """The C loop (split across threads) and the array code give the reference's bits; snapshot is read only."""
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    kernel_threads(count)
    rng = np.random.default_rng([size, count, np.dtype(dtype).itemsize, len(rule)])
    for world_size in (1, 3):
        x, snapshot, total = (awkward(rng, size, dtype, special=True) for _ in range(3))
        want = merge_reference(x, snapshot, total, world_size, rule, proportion)
        saved_snapshot, saved_total = snapshot.copy(), total.copy()
        update.merge_average(x, snapshot, total, world_size, rule, proportion)
        assert_same_bits(x, want)
        assert_same_bits(snapshot, saved_snapshot)
        if c_loop and update._updatec is not None:
            assert_same_bits(total, saved_total)  # the C loop leaves the scratch alone


@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("rule, proportion", MERGE_CASES[:2], ids=str)
def test_merge_average_signed_zeros(rule, proportion, c_loop, monkeypatch):
    """Every combination of +-0.0 in params, snapshot and sum: the sign numpy's operations give."""
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    signs = np.array([(a, b, c) for a in (0.0, -0.0) for b in (0.0, -0.0) for c in (0.0, -0.0)], np.float32)
    x, snapshot, total = (np.ascontiguousarray(column) for column in signs.T)
    want = merge_reference(x, snapshot, total, 2, rule, proportion)
    update.merge_average(x, snapshot, total, 2, rule, proportion)
    assert_same_bits(x, want)
    if rule == "delayed":  # (x - s) + a is -0.0 only where x is -0, s is +0 and a is -0
        assert list(np.signbit(x)) == [False] * 5 + [True] + [False] * 2


def test_merge_average_matches_float64_closed_form():
    """Against the rules' values in float64 (not the same roundings: to float32 precision)."""
    rng = np.random.default_rng(3)
    x, snapshot, total = (rng.standard_normal(1001).astype(np.float32) for _ in range(3))
    x64, s64, t64 = (a.astype(np.float64) for a in (x, snapshot, total))
    delayed, proportion = x.copy(), x.copy()
    update.merge_average(delayed, snapshot, total.copy(), 4, "delayed")
    update.merge_average(proportion, snapshot, total.copy(), 4, "proportion", 0.3)
    np.testing.assert_allclose(delayed, t64 / 4 + x64 - s64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(proportion, 0.3 * x64 + 0.7 * t64 / 4, rtol=1e-6, atol=1e-6)


def test_merge_average_other_dtypes_and_strides_take_the_array_code():
    rng = np.random.default_rng(4)
    x, snapshot, total = (rng.standard_normal(33).astype(np.float16) for _ in range(3))
    want = merge_reference(x, snapshot, total, 3, "proportion", 0.3)
    update.merge_average(x, snapshot, total, 3, "proportion", 0.3)
    assert_same_bits(x, want)
    x, snapshot, total = rng.standard_normal(10), rng.standard_normal(20)[::2], rng.standard_normal(10)
    want = merge_reference(x, snapshot, total, 3, "delayed", 0.0)
    update.merge_average(x, snapshot, total, 3, "delayed")
    assert_same_bits(x, want)


def test_merge_average_bad_arguments():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="rule must be one of \\('delayed', 'proportion'\\), got 'mean'"):
        update.merge_average(x, x.copy(), x.copy(), 2, "mean")
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        update.merge_average(x, x.copy(), x.copy(), 0)
    with pytest.raises(ValueError, match="proportion must be a finite real number, got nan"):
        update.merge_average(x, x.copy(), x.copy(), 2, "proportion", float("nan"))
    with pytest.raises(ValueError, match="params and snapshot must not overlap"):
        update.merge_average(x, x, x.copy(), 2)
    with pytest.raises(ValueError, match="params and total must not overlap"):
        update.merge_average(x, x.copy(), x, 2, "proportion")
    with pytest.raises(TypeError, match="total must have dtype float32, got float64"):
        update.merge_average(x, x.copy(), np.zeros(4), 2)
    with pytest.raises(ValueError, match=r"snapshot must be a numpy array of shape \(4,\)"):
        update.merge_average(x, np.zeros(5, np.float32), x.copy(), 2)
    update.merge_average(x, None, np.ones(4, np.float32), 2, "proportion", 0.5)  # the proportion rule reads no snapshot
    np.testing.assert_array_equal(x, np.full(4, 0.25, np.float32))


def test_training_gives_the_kernels_torchs_thread_count(kernel_threads, monkeypatch):
    """mpiopt train's --threads sets torch's intra-op threads and the C kernels' alike."""
    torch = pytest.importorskip("torch")
    from mpiopt.training.config import TrainConfig
    from mpiopt.training.loop import _set_threads

    class OneRankNode:  # what _set_threads asks of the world without --threads
        size = 1

        def Split_shared(self, name):
            return self

        def Free(self):
            pass

    saved = torch.get_num_threads()
    try:
        _set_threads(TrainConfig(threads=3), world=None)  # an explicit count asks no communicator
        assert torch.get_num_threads() == 3 and threads.get_num_threads() == 3
        kernel_threads(5)
        monkeypatch.setenv("MPIOPT_NUM_THREADS", "5")
        _set_threads(TrainConfig(), world=OneRankNode())  # torch takes the cores; the environment's count stays
        assert threads.get_num_threads() == 5
        monkeypatch.delenv("MPIOPT_NUM_THREADS")
        _set_threads(TrainConfig(), world=OneRankNode())
        assert threads.get_num_threads() == min(torch.get_num_threads(), threads.MAX_THREADS)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("rule, proportion", MERGE_CASES[:2], ids=str)
@pytest.mark.parametrize("update_rule", [RULES[0], (0.9, 0.0, True, 1e-2, 3), (0.9, 0.3, False, 0.0, 1)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size, count", [(0, 1), (1, 1), (7, 1), (SPLIT_SIZE, 1), (SPLIT_SIZE, 3)])
def test_update_with_merge_equals_update_then_merge(size, count, dtype, update_rule, rule, proportion, c_loop,
                                                    kernel_threads, monkeypatch):
    """sgd_update(merge=...) gives the bits of the update's reference followed by the merge's."""
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    kernel_threads(count)
    momentum, dampening, nesterov, weight_decay, divisor = update_rule
    rng = np.random.default_rng([size, count, np.dtype(dtype).itemsize, len(rule), int(10 * momentum)])
    x, g, snapshot, total = (awkward(rng, size, dtype, special=True) for _ in range(4))
    b = awkward(rng, size, dtype, special=True) if momentum else None
    want_x, want_b = reference(x.copy(), g, None if b is None else b.copy(), momentum, dampening, nesterov, weight_decay, False, divisor)
    want_x = merge_reference(want_x, snapshot, total, 3, rule, proportion)
    saved_snapshot = snapshot.copy()
    finite = sgd_update(
        x, g, b, lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
        grad_divisor=divisor, check_finite=True, merge=update.Merge(snapshot, total, 3, rule, proportion),
    )
    assert finite is bool(np.isfinite(g).all())
    assert_same_bits(x, want_x)
    if momentum:
        assert_same_bits(b, want_b)
    assert_same_bits(snapshot, saved_snapshot)


def test_update_with_merge_is_checked():
    x = np.zeros(4, np.float32)
    merge = update.Merge(np.zeros(4, np.float32), np.zeros(4, np.float32), 2)
    with pytest.raises(ValueError, match="copy_to and merge exclude each other"):
        sgd_update(x, x.copy(), lr=LR, copy_to=np.zeros(4, np.float32), merge=merge)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        sgd_update(x, x.copy(), lr=LR, merge=merge._replace(world_size=0))
    with pytest.raises(ValueError, match="rule must be one of"):
        sgd_update(x, x.copy(), lr=LR, merge=merge._replace(rule="mean"))
    with pytest.raises(ValueError, match="params and total must not overlap"):
        sgd_update(x, x.copy(), lr=LR, merge=merge._replace(total=x))
    with pytest.raises(ValueError, match=r"snapshot must be a numpy array of shape \(4,\)"):
        sgd_update(x, x.copy(), lr=LR, merge=merge._replace(snapshot=np.zeros(3, np.float32)))


@np.errstate(all="ignore")
def pull_reference(x, center, total, world_size, alpha, beta):
    """EASGD's pull as out-of-place numpy expressions, each operation rounded to x's dtype."""
    t = x.dtype.type
    mean = total / t(world_size)
    return x - (x - center) * t(alpha), center + (mean - center) * t(beta)


@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size, count", [(0, 1), (1, 1), (7, 1), (SPLIT_SIZE, 1), (SPLIT_SIZE, 3)])
def test_elastic_pull_equals_reference(size, count, dtype, c_loop, kernel_threads, monkeypatch):
    """The C loop (split across threads) and the array code give the reference's bits (NaN, inf, +-0.0 included)."""
    if c_loop and update._updatec is None:
        pytest.skip("built without the C loop")
    if not c_loop:
        monkeypatch.setattr(update, "_updatec", None)
    kernel_threads(count)
    rng = np.random.default_rng([size, count, np.dtype(dtype).itemsize])
    for world_size, alpha, beta in ((1, 0.3, 0.3), (3, 0.1, 0.9), (4, 0.0, 1.0)):
        x, center, total = (awkward(rng, size, dtype, special=True) for _ in range(3))
        want_x, want_center = pull_reference(x, center, total, world_size, alpha, beta)
        saved_total = total.copy()
        update.elastic_pull(x, center, total, world_size, alpha, beta)
        assert_same_bits(x, want_x)
        assert_same_bits(center, want_center)
        if c_loop:
            assert_same_bits(total, saved_total)  # the C loop leaves the scratch alone


def test_elastic_pull_matches_float64_closed_form_and_is_checked():
    rng = np.random.default_rng(5)
    x, center, total = (rng.standard_normal(1001).astype(np.float32) for _ in range(3))
    x64, c64, t64 = (a.astype(np.float64) for a in (x, center, total))
    update.elastic_pull(x, center, total, 4, 0.1, 0.4)
    np.testing.assert_allclose(x, x64 - 0.1 * (x64 - c64), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(center, c64 + 0.4 * (t64 / 4 - c64), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="center and total must not overlap"):
        update.elastic_pull(x, center, center, 4, 0.1, 0.4)
    with pytest.raises(ValueError, match="alpha must be a finite real number, got nan"):
        update.elastic_pull(x, center, total, 4, float("nan"), 0.4)
    with pytest.raises(ValueError, match="world_size"):
        update.elastic_pull(x, center, total, 0, 0.1, 0.4)


def sparse_gradient(rng, size, dtype, support_size):
    """A gradient that is +0.0 outside a random support (holding 0.0, -0.0, NaN and inf too), and that support."""
    support = np.sort(rng.choice(size, support_size, replace=False)).astype(np.int32)
    for edge in (0, 1023, 1024, size - 1):  # the first and last entries, and both sides of a 1024-entry block boundary
        if 0 <= edge < size and support_size and edge not in support:
            support[rng.integers(support_size)] = edge
    support = np.unique(support).astype(np.int32)
    grad = np.zeros(size, dtype)
    grad[support] = awkward(rng, support.size, dtype, special=True)
    return grad, support


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size, support_size", [(1, 0), (2000, 0), (2000, 5), (2000, 600), (SPLIT_SIZE, 40_000)])
def test_a_sparse_gradient_read_at_its_support_gives_the_dense_bits(size, support_size, dtype, rule, count, kernel_threads):
    """grad_support=(indices, values) for a gradient that is +0.0 elsewhere: the dense update's bits and finite flag."""
    kernel_threads(count)
    momentum, dampening, nesterov, weight_decay, divisor = rule
    rng = np.random.default_rng([size, support_size, np.dtype(dtype).itemsize])
    x = awkward(rng, size, dtype, special=True)
    x[: size // 3] = -0.0  # -0.0 - lr * s is -0.0 for s = +0.0 but +0.0 for s = -0.0: the zeros must be positive
    dense_x, dense_b = x.copy(), np.empty_like(x)
    sparse_x, sparse_b = x.copy(), np.empty_like(x)
    for step in range(3):
        grad, support = sparse_gradient(rng, size, dtype, support_size)
        values = grad[support]
        hyper = dict(lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                     first_step=step == 0, grad_divisor=divisor, check_finite=True)
        want = sgd_update(dense_x, grad, dense_b, **hyper)
        # The promise is the caller's: a support small enough is read instead of grad (poisoned here to show it).
        given = grad
        if 8 * support.size < size:
            given = np.full(size, np.nan, dtype)
            given[support] = values
        got = sgd_update(sparse_x, given, sparse_b, **hyper, grad_support=(support, values))
        assert got is want
        assert_same_bits(sparse_x, dense_x)
        if momentum:
            assert_same_bits(sparse_b, dense_b)


def test_grad_support_is_checked():
    x, g = np.zeros(100, np.float32), np.zeros(100, np.float32)
    values = np.ones(2, np.float32)
    for support in ([5, 5], [7, 3], [-1, 3], [3, 100]):
        with pytest.raises(ValueError, match="support must be int32 positions, unique, ascending and in \\[0, 100\\)"):
            sgd_update(x, g, lr=LR, grad_support=(np.array(support, np.int32), values))
    with pytest.raises((TypeError, ValueError), match="grad_support's indices"):
        sgd_update(x, g, lr=LR, grad_support=(np.array([1, 2]), values))
    with pytest.raises((TypeError, ValueError), match="grad_support's values"):
        sgd_update(x, g, lr=LR, grad_support=(np.array([1, 2], np.int32), values.astype(np.float64)))
    with pytest.raises(ValueError, match="grad_support's values must match its indices' shape \\(3,\\), got \\(2,\\)"):
        sgd_update(x, g, lr=LR, grad_support=(np.array([1, 2, 3], np.int32), values))
