"""The tile types of the kernels and of the tuned table (apart from the rules that choose them).

Kept apart from :mod:`ce_pallas_tpu.tiling` so that the generated table (:mod:`ce_pallas_tpu.tuned`)
and the rules that read it import these types from one place, and not each other.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelTiles[H: (int | None)]:
    """The tiles of one kernel: token block ``block_b``, hidden block ``block_h``, vocab block ``block_v``.

    ``block_h`` is the forward's hidden block (``None``: the whole hidden dimension, ``x`` resident
    in VMEM) or the backward's hidden chunk of its ``dx``/``dw`` products (``None``: 512). As the
    table and requests state them the tiles are a ``KernelTiles[int | None]``; fitted to one problem
    (:func:`ce_pallas_tpu.tiling.fit_tiles`: no block beyond its dimension, ``block_h`` set and
    dividing ``Hp``) a ``KernelTiles[int]``.

    ``w_buffers``: the backward's VMEM buffers for its ``w`` blocks (``None``: two where the VMEM
    model says they fit, else one; ``dw`` has one staging block either way); the forward ignores it.
    """

    block_b: int
    block_h: H
    block_v: int
    w_buffers: int | None = None

    @property
    def sizes(self) -> tuple[int, H, int]:
        """``(block_b, block_h, block_v)``."""
        return self.block_b, self.block_h, self.block_v


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tiles of both kernels and where they came from (``table:<gen>/<bucket>``, ``inferred``...)."""

    forward: KernelTiles[int]
    backward: KernelTiles[int]
    source: str


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One entry of the tuned table: both kernels' tiles and the static schedule they were kept for.

    The figures are libtpu's static schedule at the bucket's example shape in bfloat16
    (:mod:`ce_pallas_tpu.tooling.schedule`): ``*_ratio`` is the estimated cycles per grid step over the
    fewest its matmuls need on the generation's MXUs (1.0: matmul-bound), ``*_hbm_us`` and
    ``*_mxu_us`` the step's HBM traffic at the core's bandwidth and its MXU minimum, in
    microseconds. ``None`` where nothing was measured; ``note`` then says why.
    """

    forward: KernelTiles[int | None]
    backward: KernelTiles[int | None]
    forward_ratio: float | None = None
    backward_ratio: float | None = None
    forward_hbm_us: float | None = None
    forward_mxu_us: float | None = None
    backward_hbm_us: float | None = None
    backward_mxu_us: float | None = None
    note: str | None = None
