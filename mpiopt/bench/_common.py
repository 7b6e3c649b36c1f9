"""Small helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, List


def comma_list(kind: type) -> Callable[[str], List[Any]]:
    """An argparse ``type`` for comma-separated values of ``kind`` ("1,2,4")."""

    def parse(text: str) -> List[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None

    return parse


def save_figure(fig: Any, path: str) -> None:
    """Write a matplotlib figure to ``path`` (making its folder) and free it."""
    import matplotlib.pyplot as plt

    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
