"""Image classifiers for the torch front end: an MLP, a small CNN and the CIFAR ResNet-20 (and the GPT by name).

>>> torch.manual_seed(0)
>>> model = build_model("resnet20", input_shape=(3, 32, 32), num_classes=10)

Architectures and parameter counts: docs/internals-tasks.md, "Models".
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from mpiopt.kernels._backend import check_count

__all__ = ["MODELS", "LANGUAGE_MODELS", "build_model"]

#: The image classifiers.
MODELS = ("mlp", "cnn", "resnet20")
#: Models over token sequences (:mod:`mpiopt.tasks.gpt`), for the text task.
LANGUAGE_MODELS = ("gpt",)

_DEFAULT_WIDTH = {"mlp": 128, "cnn": 32, "resnet20": 16}


def build_model(
    name: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    width: int | None = None,
    dropout: float = 0.0,
    **gpt_sizes: int,
) -> nn.Module:
    """Build the model ``name`` (:data:`MODELS` or :data:`LANGUAGE_MODELS`) for inputs of ``input_shape``.

    ``width``: hidden units (``mlp``) or first channels (``cnn``, ``resnet20``); ``dropout``: before the final
    layer (``gpt``: embeddings, attention and residuals); ``gpt_sizes``: ``n_layer``, ``n_embd``, ``n_head``.
    Returns a module mapping ``(N, *input_shape)`` to logits ``(N, num_classes)``.

    Raises
    ------
    ValueError, TypeError
        Unknown ``name``, a shape the model cannot take, or a count or ``dropout`` out of range or of the wrong type.
    """
    if name not in MODELS + LANGUAGE_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(map(repr, MODELS + LANGUAGE_MODELS))}")
    if name == "gpt":
        if width is not None:
            raise ValueError(f"model 'gpt' takes --n-embd, not width (got width={width!r})")
        return _gpt(input_shape, num_classes, dropout, gpt_sizes)
    if gpt_sizes:
        raise ValueError(f"{', '.join(sorted(gpt_sizes))} apply to model 'gpt' only, not {name!r}")
    shape = _check_input_shape(name, input_shape)
    num_classes = check_count("num_classes", num_classes, 2)
    width = _DEFAULT_WIDTH[name] if width is None else check_count("width", width, 1)
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
    head_dropout = nn.Dropout(float(dropout))
    if name == "mlp":
        return _mlp(shape, num_classes, width, head_dropout)
    if name == "cnn":
        return _cnn(shape[0], num_classes, width, head_dropout)
    return ResNet20(shape[0], num_classes, width, head_dropout)


def _gpt(input_shape: Sequence[int], vocab_size: int, dropout: float, sizes: dict) -> nn.Module:
    from .gpt import GPT, GPT_DEFAULTS

    unknown = sorted(set(sizes) - {"n_layer", "n_embd", "n_head"})
    if unknown:
        raise ValueError(f"model 'gpt' takes n_layer, n_embd, n_head, not {', '.join(unknown)}")
    if len(input_shape) != 1:
        raise ValueError(f"input_shape for 'gpt' must be (block_size,), got {input_shape!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
    chosen = {k: GPT_DEFAULTS[k] if sizes.get(k) is None else sizes[k] for k in ("n_layer", "n_embd", "n_head")}
    return GPT(vocab_size, block_size=input_shape[0], dropout=float(dropout), **chosen)


def _check_input_shape(name: str, input_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(check_count("input_shape entry", size, 1) for size in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"input_shape must be a tuple of positive ints, got {input_shape!r}") from None
    if not shape or (name != "mlp" and len(shape) != 3):
        raise ValueError(f"input_shape for {name!r} must be (C, H, W), got {input_shape!r}")
    if name == "cnn" and min(shape[1:]) < 2:
        # The 2x2 max pooling needs at least two rows and columns.
        raise ValueError(f"input_shape for 'cnn' needs H and W >= 2, got {input_shape!r}")
    return shape


def _mlp(shape: tuple[int, ...], num_classes: int, width: int, head_dropout: nn.Dropout) -> nn.Module:
    inputs = 1
    for size in shape:
        inputs *= size
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(inputs, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        head_dropout,
        nn.Linear(width, num_classes),
    )


def _conv_bn(in_channels: int, out_channels: int, stride: int = 1) -> list[nn.Module]:
    """A 3x3 convolution (no bias: BatchNorm's shift replaces it) and its BatchNorm."""
    conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
    # He et al. 2015 initialisation for ReLU networks, as in the ResNet paper.
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return [conv, nn.BatchNorm2d(out_channels)]


def _cnn(channels: int, num_classes: int, width: int, head_dropout: nn.Dropout) -> nn.Module:
    return nn.Sequential(
        *_conv_bn(channels, width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        *_conv_bn(width, 2 * width),
        nn.ReLU(),
        # 2x2 keeps a little spatial layout whatever the input size (8x8 or 32x32).
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        head_dropout,
        nn.Linear(8 * width, num_classes),
    )


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an option-A shortcut (He et al. 2016, fig. 2)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(in_channels, out_channels, stride)
        self.conv2, self.bn2 = _conv_bn(out_channels, out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.stride != 1:
            # Same output size as the stride-2 convolution with padding 1: ceil(H / 2).
            shortcut = shortcut[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra_channels))
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    """ResNet-20 for CIFAR (He et al. 2016, section 4.2); build it with :func:`build_model`."""

    def __init__(self, channels: int, num_classes: int, width: int, head_dropout: nn.Dropout) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(channels, width), nn.ReLU())
        blocks = []
        in_channels = width
        for stage in range(3):
            out_channels = width * 2**stage
            for block in range(3):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(_BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = head_dropout
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.pool(self.blocks(self.stem(x))).flatten(1)
        return self.fc(self.dropout(out))
