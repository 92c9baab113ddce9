"""Small grids with a full-size kernel's tiles, and the bilinear fit that scales them back up.

Walking a full-size grid through libtpu's static profile takes more than ten minutes, but one
TensorCore's total (cycles, bundles, bytes) over a grid of ``kb`` token blocks by ``kv`` vocab
blocks is bilinear in ``(kb, kv)``: a step's cost depends only on whether it is the first, an
interior or the last block along each axis, so ``total = a + b*kb + c*kv + d*kb*kv`` holds from
``kb, kv >= 2`` on. Compiling the kernel at ``kb, kv in {2, 3}`` with the same tiles and the same
raggedness (last token block, last vocab block, a core left one block short) pins the four
coefficients; the fit predicts a 5x4 grid within 0.02%.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ce_pallas_tpu.common import KernelConfig


def small_grid(cfg: KernelConfig, kb: int, kv: int) -> KernelConfig:
    """``cfg`` with ``kb`` token blocks and ``kv`` vocab blocks per core, ragged like ``cfg``."""
    last_rows = cfg.n - (cfg.nb - 1) * cfg.block_b
    last_cols = cfg.v - (cfg.nv - 1) * cfg.block_v
    missing = cfg.num_cores * cfg.nv_per_core - cfg.nv  # blocks the last core lacks
    blocks = cfg.num_cores * kv - missing
    small = dataclasses.replace(cfg, n=(kb - 1) * cfg.block_b + last_rows, v=(blocks - 1) * cfg.block_v + last_cols)
    assert (small.nb, small.nv_per_core) == (kb, kv), (small, kb, kv)
    return small


def grid_points(cfg: KernelConfig) -> list[tuple[int, int]]:
    """The ``(token blocks, vocab blocks per core)`` grids to compile: 2 and 3 of each, or fewer."""
    kbs = sorted({min(2, cfg.nb), min(3, cfg.nb)})
    kvs = sorted({min(2, cfg.nv_per_core), min(3, cfg.nv_per_core)})
    return list(itertools.product(kbs, kvs))


def _basis(points: list[tuple[int, int]], kb: float, kv: float) -> list[float]:
    vary_b = len({p[0] for p in points}) > 1
    vary_v = len({p[1] for p in points}) > 1
    row = [1.0]
    if vary_b:
        row.append(kb)
    if vary_v:
        row.append(kv)
    if vary_b and vary_v:
        row.append(kb * kv)
    return row


@dataclasses.dataclass(frozen=True)
class BilinearFit:
    """``total(kb, kv)`` from the totals measured at a few small grids."""

    points: tuple[tuple[int, int], ...]
    coefficients: tuple[float, ...]

    @classmethod
    def of(cls, totals: dict[tuple[int, int], float]) -> BilinearFit:
        points = sorted(totals)
        matrix = np.array([_basis(points, *p) for p in points])
        values = np.array([totals[p] for p in points], dtype=np.float64)
        coefficients, *_ = np.linalg.lstsq(matrix, values, rcond=None)
        return cls(tuple(points), tuple(float(c) for c in coefficients))

    def total(self, kb: int, kv: int) -> float:
        return float(np.dot(_basis(list(self.points), kb, kv), self.coefficients))

    def interior(self) -> float | None:
        """Cost of one more step in the middle of the grid (the ``kb * kv`` coefficient), if fitted."""
        return self.coefficients[3] if len(self.coefficients) == 4 else None
