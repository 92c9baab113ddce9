"""The tile types of the kernels and of the tuned table (apart from the rules that choose them).

Kept apart from :mod:`ce_pallas_tpu.tiling` so that the generated table (:mod:`ce_pallas_tpu.tuned`)
and the rules that read it import these types from one place, and not each other.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Token block ``block_b``, hidden block/chunk ``block_h`` (``None``: whole hidden dim), vocab block
    ``block_v``.

    ``w_buffers``: the backward's VMEM buffers for its ``w`` and ``dw`` blocks (``None``: two where
    the VMEM model says they fit, else one); the forward ignores it.
    """

    block_b: int
    block_h: int | None
    block_v: int
    w_buffers: int | None = None

    @property
    def sizes(self) -> tuple[int, int | None, int]:
        """``(block_b, block_h, block_v)``."""
        return self.block_b, self.block_h, self.block_v


@dataclasses.dataclass(frozen=True)
class FittedTiles(KernelTiles):
    """Kernel tiles fitted to one problem: the hidden block/chunk ``block_h`` is always set (it divides ``Hp``)."""

    block_h: int

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(block_b, block_h, block_v)``, all set."""
        return self.block_b, self.block_h, self.block_v


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tiles of both kernels and where they came from (``table:<gen>/<bucket>``, ``inferred``...)."""

    forward: FittedTiles
    backward: FittedTiles
    source: str


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One entry of the tuned table: both kernels' tiles and the static schedule they were kept for.

    The figures are libtpu's static schedule at the bucket's example shape in bfloat16
    (:mod:`ce_pallas_tpu.schedule`): ``*_ratio`` is the estimated cycles per grid step over the
    fewest its matmuls need on the generation's MXUs (1.0: matmul-bound), ``*_hbm_us`` and
    ``*_mxu_us`` the step's HBM traffic at the core's bandwidth and its MXU minimum, in
    microseconds. ``None`` where nothing was measured; ``note`` then says why.
    """

    forward: KernelTiles
    backward: KernelTiles
    forward_ratio: float | None = None
    backward_ratio: float | None = None
    forward_hbm_us: float | None = None
    forward_mxu_us: float | None = None
    backward_hbm_us: float | None = None
    backward_mxu_us: float | None = None
    note: str | None = None
