"""Memory accounting: what this machine has, and the sizes a run will need, so that a run that would
not fit is refused with a number instead of crashing.

What a compiled program needs comes from :class:`ce_core.testing.CompileResult`
(``compiled.memory_analysis()``). The bench's "temp" column is the *temporaries* of the
forward+backward program: the memory a backend needs beyond its inputs and gradients, which is what
a fused loss is supposed to keep small.
"""

from __future__ import annotations

import os
from typing import Any

GIB = 1024**3


def available_bytes() -> int | None:
    """Memory this process could still allocate: ``MemAvailable`` (Linux), else total physical."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device: Any) -> int | None:
    """Memory of an accelerator (``bytes_limit`` of ``device.memory_stats()``), None on CPU."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def input_bytes(n: int, h: int, v: int, itemsize: int) -> int:
    """Bytes of ``x``, ``w``, int32 ``labels`` and the gradients ``dx``, ``dw`` on the device."""
    return 2 * (n * h + h * v) * itemsize + 4 * n


def host_input_bytes(n: int, h: int, v: int) -> int:
    """Bytes of the float32 NumPy inputs drawn on the host before they are put on the device."""
    return 4 * (n * h + h * v) + 4 * n


def oracle_bytes(n: int, h: int, v: int) -> int:
    """Peak of the float64 oracle (``ce_core.testing.oracle``): about ten ``[N, V]`` float64 arrays
    (logits, cap gradient, softmax, one-hot, cotangents, temporaries) plus float64 copies of the
    inputs and gradients."""
    return 10 * 8 * n * v + 2 * 8 * (n * h + h * v)


def gib(nbytes: float | None) -> str:
    """``'1.23 GiB'`` (or ``'?'``)."""
    return "?" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def human_bytes(nbytes: float | None) -> str:
    """Compact size for tables: ``'512 B'``, ``'3.1 MiB'``, ``'7.9 GiB'``; ``'-'`` when unknown."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
