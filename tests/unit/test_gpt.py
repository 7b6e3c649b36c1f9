"""The GPT-style transformer (mpiopt.tasks.gpt): sizes, initialisation, causality, tied weights, it learns."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpiopt.tasks.gpt import GPT, GPT_DEFAULTS, gpt_parameter_count  # noqa: E402
from mpiopt.tasks.models import build_model  # noqa: E402


def tiny(seed: int = 0, **sizes) -> GPT:
    torch.manual_seed(seed)
    return build_model("gpt", input_shape=(sizes.pop("block_size", 16),), num_classes=256, **{"n_layer": 2, "n_embd": 32, "n_head": 4, **sizes})


def test_the_default_and_a_larger_size_have_the_counted_parameters():
    torch.manual_seed(0)
    default = build_model("gpt", input_shape=(GPT_DEFAULTS["block_size"],), num_classes=256)
    count = sum(p.numel() for p in default.parameters())
    assert count == gpt_parameter_count(256, 2, 128, 128) == 445_952
    # A ~20-50M configuration (not built here): 8 layers of 512, context 512.
    assert gpt_parameter_count(256, 8, 512, 512) == 25_613_312


def test_the_output_layer_is_the_token_embedding():
    model = tiny()
    assert model.lm_head.weight is model.token_embedding.weight
    assert sum(1 for p in model.parameters() if p is model.token_embedding.weight) == 1


def test_initialisation_is_gpt2s_and_a_function_of_the_seed():
    a, b, c = tiny(seed=1), tiny(seed=1), tiny(seed=2)
    flat = [torch.nn.utils.parameters_to_vector(m.parameters()) for m in (a, b, c)]
    assert torch.equal(flat[0], flat[1]) and not torch.equal(flat[0], flat[2])
    big = tiny(n_layer=8, n_embd=64, block_size=64).requires_grad_(False)
    assert abs(float(big.token_embedding.weight.std()) - 0.02) < 0.002
    assert abs(float(big.blocks[0].mlp_proj.weight.std()) - 0.02 / 4) < 0.0005  # 0.02 / sqrt(2 * 8 layers)
    assert float(big.blocks[0].qkv.bias.abs().max()) == 0.0


def test_a_later_token_does_not_change_earlier_logits():
    model = tiny().eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert before.shape == (2, 16, 256)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_a_tiny_gpt_learns_a_fixed_batch():
    model = tiny()
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(5.545, abs=0.1)  # ln 256 at the start: the small initialisation is near uniform
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.parametrize("sizes, message", [
    (dict(n_embd=30, n_head=4), "n_embd must be divisible by n_head, got n_embd=30, n_head=4"),
    (dict(n_layer=0), "n_layer"),
    (dict(width=8), "model .gpt. takes --n-embd, not width"),
])
def test_bad_sizes_are_named(sizes, message):
    with pytest.raises(ValueError, match=message):
        tiny(**sizes)


def test_a_sequence_longer_than_the_block_is_refused():
    with pytest.raises(ValueError, match="longer than block_size 16"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))
