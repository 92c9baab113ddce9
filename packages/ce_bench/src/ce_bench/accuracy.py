"""Error of each implementation against the float64 oracle ``ce_core.testing.oracle``.

The oracle materialises ``[N, V]`` float64 arrays (about ten of them at its peak), so it is only run
when ``N * V`` is at most ``max_elements`` (default ``2**26``, about 5 GiB at the peak) and fits the
memory budget; otherwise the error is reported as *not measured* with the reason, never estimated.
It is computed once per shape and dtype, on exactly the inputs the implementations see (after the
cast to the benchmark dtype), and compared with the loss and gradients that the timed
forward+backward program returned in its warm-up call.

Error = ``max|actual - expected| / max|expected|`` (``ce_core.testing.max_rel_error``) for the loss,
``dx`` and ``dw``; ``max_rel_err`` is the largest of the three.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ce_bench.memory import gib, oracle_bytes
from ce_core.extend import max_rel_error

DEFAULT_MAX_ELEMENTS = 2**26


@dataclasses.dataclass(frozen=True)
class Errors:
    """Relative errors of loss, dx and dw (None when not measured, with ``note`` saying why)."""

    loss: float | None = None
    dx: float | None = None
    dw: float | None = None
    note: str = ""

    @property
    def max(self) -> float | None:
        """The largest of the three errors (None when not measured)."""
        values = [value for value in (self.loss, self.dx, self.dw) if value is not None]
        return max(values) if values else None


def oracle_skip_reason(n: int, h: int, v: int, *, max_elements: int, budget_bytes: int | None) -> str | None:
    """Why the oracle is not run for this shape, or None when it is."""
    if n * v > max_elements:
        return (f"error not measured: N*V = {n * v:,} > {max_elements:,} elements "
                f"(the float64 oracle holds [N, V] arrays; raise --oracle-max-elements)")
    need = oracle_bytes(n, h, v)
    if budget_bytes is not None and need > budget_bytes:
        return f"error not measured: the float64 oracle needs {gib(need)}, budget {gib(budget_bytes)}"
    return None


def compare(outputs: Any, expected: dict[str, np.ndarray]) -> Errors:
    """Errors of ``(loss, (dx, dw))`` from a forward+backward program against the oracle."""
    loss, (dx, dw) = outputs
    return Errors(
        loss=max_rel_error(np.asarray(loss, np.float64), expected["loss"]),
        dx=max_rel_error(np.asarray(dx.astype(np.float32), np.float64), expected["dx"]),
        dw=max_rel_error(np.asarray(dw.astype(np.float32), np.float64), expected["dw"]),
    )
