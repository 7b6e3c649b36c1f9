"""The streaming_diloco twin's own special cases (no MPI)."""

import numpy as np

from mpiopt.sim.streaming_diloco import simulate


def _grad(rank, step, x):
    return np.random.default_rng([3, rank, step]).standard_normal(x.shape[0])


def test_outer_identity_no_overlap_is_periodic_averaging():
    """outer lr 1, momentum 0, tau 0, alpha 0: every period the ranks' mean, fragment by fragment."""
    initial = [np.random.default_rng(r).standard_normal(12) for r in range(3)]
    got = simulate(initial, _grad, 8, lr=0.1, period=4, fragments=1, overlap_steps=0, alpha=0.0, outer_lr=1.0, outer_momentum=0.0)
    x = [np.mean(initial, axis=0)] * 3
    for t in range(1, 9):
        x = [x[r] - 0.1 * _grad(r, t, x[r]) for r in range(3)]
        if t % 4 == 0:
            x = [np.mean(x, axis=0)] * 3
    for r in range(3):
        np.testing.assert_allclose(got[r], x[r], rtol=0, atol=1e-12)


def test_alpha_one_keeps_the_local_models():
    """alpha 1: the merge keeps the local fragments, so the ranks run plain local SGD."""
    initial = [np.random.default_rng(r).standard_normal(10) for r in range(2)]
    got = simulate(initial, _grad, 9, lr=0.1, period=3, fragments=2, overlap_steps=1, alpha=1.0, outer_lr=0.7, outer_momentum=0.9)
    for r in range(2):
        x = np.mean(initial, axis=0)
        for t in range(1, 10):
            x = x - 0.1 * _grad(r, t, x)
        np.testing.assert_array_equal(got[r], x)


def test_strided_with_one_block_per_fragment_is_contiguous():
    """stride_blocks 1: F blocks, block f to fragment f, the contiguous slices themselves."""
    initial = [np.random.default_rng(r).standard_normal(13) for r in range(3)]
    common = dict(lr=0.1, momentum=0.9, period=4, fragments=3, overlap_steps=1, alpha=0.5, outer_lr=0.7, outer_momentum=0.9)
    contiguous = simulate(initial, _grad, 11, **common)
    strided = simulate(initial, _grad, 11, layout="strided", stride_blocks=1, **common)
    other = simulate(initial, _grad, 11, layout="strided", stride_blocks=3, **common)
    for r in range(3):
        np.testing.assert_array_equal(strided[r], contiguous[r])
        assert not np.array_equal(other[r], contiguous[r])  # the layout matters once the blocks interleave
