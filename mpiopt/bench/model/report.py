"""The model's Markdown tables and plots: calibration, validation and projection."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np

from ...algorithms import ASYNCHRONOUS, algorithm_class
from .._common import markdown_table, save_figure

__all__ = ["calibration_table", "validation_table", "projection_table", "plot_projection", "plot_validation"]


def calibration_table(model: Mapping[str, Any]) -> str:
    """Per collective: alpha, beta, the rate 1/beta and the fit's errors over its points."""
    rows = []
    for op, entry in model["collectives"].items():
        errors = [abs(p["error"]) for p in entry["points"]]
        rows.append([op, f"{1e6 * entry['alpha']:.1f}", f"{1e9 * entry['beta']:.3f}", f"{8 / entry['beta'] / 1e9:.3f}",
                     len(errors), f"{100 * float(np.median(errors)):.0f} %", f"{100 * max(errors):.0f} %"])
    return markdown_table(["collective", "alpha (us)", "beta (ns/B)", "1/beta (Gbit/s)", "points", "median abs. error", "max abs. error"], rows)


def _percent(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.0f} %" if measured > 0 else "-"


def validation_table(rows: Sequence[Mapping[str, Any]], goal: float = 0.25) -> str:
    """:func:`validate`'s rows: communication and step time, measured and predicted, and whether within ``goal``."""
    body = [[r["algorithm"] + (f" ({r['mode']})" if r["mode"] else ""), r["P"], f"{r['d']:,}", f"{1e3 * r['compute']:.1f}",
             f"{1e3 * r['measured_comm']:.1f}", f"{1e3 * r['predicted_comm']:.1f}", _percent(r["predicted_comm"], r["measured_comm"]),
             f"{1e3 * r['measured']:.1f}",
             f"{1e3 * r['predicted']:.1f}", f"{100 * r['error']:+.0f} %", "yes" if abs(r["error"]) <= goal else "**no**"]
            for r in rows]
    header = ["algorithm", "P", "d", "compute ms", "comm ms (measured)", "comm ms (model)", "comm error", "step ms (measured)",
              "step ms (model)", "error", f"within {100 * goal:.0f} %"]
    return markdown_table(header, body)


def projection_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One row per (model, rate, algorithm), one column per rank count: ``step ms (speed-up x)``."""
    ranks = sorted({r["P"] for r in rows})
    keyed: Dict[Tuple[str, str, str], Dict[int, Mapping[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["rate"], r["algorithm"]), {})[r["P"]] = r
    body = [[m, rate, name, *(f"{1e3 * by_p[P]['seconds']:.0f} ({by_p[P]['speedup']:.2f}x)" for P in ranks)]
            for (m, rate, name), by_p in keyed.items()]
    return markdown_table(["model", "link", "algorithm", *(f"P={P}" for P in ranks)], body, align="lll" + "r" * len(ranks))


def plot_projection(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Speed-up over sgd against ranks: one panel per (rate, model), rates in rows, models in columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, rates = list(dict.fromkeys(r["model"] for r in rows)), list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(len(rates), len(models), figsize=(4.6 * len(models), 3.4 * len(rates) + 0.6), sharex=True, sharey=True, squeeze=False)
    for i, rate in enumerate(rates):
        for j, m in enumerate(models):
            ax, mine = axes[i][j], [r for r in rows if r["model"] == m and r["rate"] == rate]
            for name in dict.fromkeys(r["algorithm"] for r in mine):
                pts = sorted((r["P"], r["speedup"]) for r in mine if r["algorithm"] == name)
                ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", ms=3, label=name, ls="--" if algorithm_class(name).protocol == ASYNCHRONOUS else "-")
            ax.set(xscale="log", yscale="log", title=f"{m}, {rate}")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].set_ylabel("speed-up over sgd")
    for ax in axes[-1]:
        ax.set_xlabel("ranks")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save_figure(fig, path)


def plot_validation(rows: Sequence[Mapping[str, Any]], path: str, goal: float = 0.25) -> None:
    """Predicted against measured step time, one marker per point, the goal's band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for P, marker in zip(sorted({r["P"] for r in rows}), "os^Dv"):
        mine = [r for r in rows if r["P"] == P]
        ax.scatter([1e3 * r["measured"] for r in mine], [1e3 * r["predicted"] for r in mine], marker=marker, label=f"P={P}")
        for r in mine:
            ax.annotate(r["algorithm"], (1e3 * r["measured"], 1e3 * r["predicted"]), fontsize=6)
    lo = 0.8 * 1e3 * min(min(r["measured"], r["predicted"]) for r in rows)
    hi = 1.25 * 1e3 * max(max(r["measured"], r["predicted"]) for r in rows)
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * (1 - goal), xs * (1 + goal), color="gray", alpha=0.2, label=f"within {100 * goal:.0f} %")
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="model step (ms)", title="alpha-beta model vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
