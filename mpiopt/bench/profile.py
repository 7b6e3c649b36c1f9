"""Where a step's device time goes: each variant's steps under ``torch.profiler``, for ``bench update --profile``.

Per variant: the wall time of a step (synchronized, under the profiler), the device's busy time in it, how many
kernels (and copies and fills) it queues, how often the host waits for the device inside it, and its costliest
kernels.  The profiler sees every kernel of the process, CuPy's and mpiopt's as well as torch's (CUPTI).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, Mapping

from ._common import markdown_table

__all__ = ["waits_for_device", "summarize", "profile", "markdown"]

# The synchronous copies among the runtime's and driver's calls (CuPy's read of a device scalar, ``int(x)``, is one).
_SYNCHRONOUS_COPIES = ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyDtoH")
_NAME_WIDTH = 90  # CUDA kernels' names carry their template arguments: cut for the table


def waits_for_device(name: str) -> bool:
    """Whether the runtime or driver call ``name`` blocks the host until the device has caught up."""
    return "Synchronize" in name or name in _SYNCHRONOUS_COPIES


def summarize(events: Iterable[Any], steps: int, device_type: Any, wall: float, own_waits: int = 1, top: int = 8) -> Dict[str, Any]:
    """A step's share of ``torch.profiler``'s ``key_averages()`` over ``steps`` steps that took ``wall`` seconds.

    ``device_type`` picks the events that are the device's work (``DeviceType.CUDA``); ``own_waits`` is the waits
    a step's timing adds (the benchmark's sync), not counted.  Returns ``wall_ms``, ``device_ms``, ``kernels``,
    ``waits`` (each a step's) and ``top``: ``[name, calls a step, microseconds a step]``, the costliest first.
    """
    work, waits = [], 0
    for event in events:
        if event.device_type == device_type:
            work.append(event)
        elif waits_for_device(event.key):
            waits += event.count
    on_host = device_type.name == "CPU"  # the tests profile torch's CPU ops as the device's work
    busy = sorted(((e.key, e.count, e.self_cpu_time_total if on_host else e.self_device_time_total) for e in work), key=lambda b: -b[2])
    return {
        "wall_ms": 1e3 * wall / steps,
        "device_ms": sum(us for _, _, us in busy) / 1e3 / steps,
        "kernels": sum(calls for _, calls, _ in busy) / steps,
        "waits": max(0, waits - own_waits * steps) / steps,
        "top": [[name[:_NAME_WIDTH], calls / steps, us / steps] for name, calls, us in busy[:top]],
    }


def profile(variants: Mapping[str, Callable[[], float]], steps: int) -> Dict[str, Dict[str, Any]]:
    """Each of ``variants`` (synchronized steps on a CUDA device) run ``steps`` times under the profiler: :func:`summarize`'s dict each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    results = {}
    for name, step in variants.items():
        step()  # untimed: the first call after another variant pays for its caches
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - started
        results[name] = summarize(prof.key_averages(), steps, DeviceType.CUDA, wall)
    return results


def markdown(results: Mapping[str, Mapping[str, Any]]) -> str:
    """:func:`profile`'s results as Markdown: a line per variant, then each variant's costliest kernels."""
    rows = [[name, f"{r['wall_ms']:.3f}", f"{r['device_ms']:.3f}", f"{r['kernels']:.1f}", f"{r['waits']:.1f}"] for name, r in results.items()]
    parts = [markdown_table(["variant", "wall ms/step", "device ms/step", "kernels/step", "host waits/step"], rows, align="lrrrr")]
    for name, r in results.items():
        kernels = [[f"`{kernel}`", f"{calls:.1f}", f"{us:.1f}"] for kernel, calls, us in r["top"]]
        parts += [f"### {name}", markdown_table(["kernel", "calls/step", "us/step"], kernels or [["(none)", "", ""]], align="lrr")]
    return "\n\n".join(parts) + "\n"
