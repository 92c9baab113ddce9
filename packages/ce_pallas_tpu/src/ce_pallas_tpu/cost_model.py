"""The cost model of the two kernels: VMEM footprint and roofline time for a choice of tiles (estimates).

A footprint counts every block and scratch buffer the kernel declares (with its buffer count,
rounded up to the (sublane, 128-lane) layout tiles), plus Mosaic's own working set: float32
``[b, v]`` tiles of the elementwise code and copies of the ``x`` block the products read. Those two
terms were fitted to libtpu's own figure, the scoped VMEM a compiled kernel reports using
(:mod:`ce_pallas_tpu.tooling.vmem`), over 295 kernels and tiles on v4, v5e, v5p, v6e and TPU7x (bf16
and float32, with and without a soft cap, the entropy's statistic, the argmax, the logit sum): the
model bounds every one from above, by 1-74% (the loosest: forwards at hidden sizes that are not a
multiple of 1024, where libtpu makes no copy of ``x``; ``benchmarks/tpu_vmem_model.py`` redraws them),
checked at 25 cases by the slow tier.
It rejects tiles that cannot fit (explicit ones with a ``ValueError``), bounds the rules that adapt a
table entry, and picks tiles on a table miss; the ahead-of-time compile tests check the tuned ones
for real. (Until issue 25 the model counted seven or eight whole float32 temporaries, fitted on v4
and v5p to older kernels: up to 3.7 times libtpu's figure at narrow heads, and under it in places.)
"""

from __future__ import annotations

import dataclasses
import math

from ce_pallas_tpu.layout import LANES, forward_column_chunk, round_up
from ce_pallas_tpu.target import ChipFacts

#: Seconds of fixed cost per grid step (pipeline bookkeeping, DMA issue), a measured ballpark.
STEP_OVERHEAD_S = 0.35e-6
#: Mosaic's working set beyond the declared buffers, fitted to libtpu's own figures: float32 ``[b, v]``
#: tiles of the backward's elementwise code (the logits, ``p`` and ``delta`` as they are formed, and at
#: "high"/"highest" precision the bf16 pieces of ``delta``), by the products' bytes per element; the
#: forward's, per generation: ``ChipFacts.forward_work_tiles``, one more for the entropy's product and
#: two for the argmax's running max and index...
BACKWARD_WORK_TILES = {2: 2.0, 4: 4.5}
#: ...copies of the ``x`` block, in float32 blocks, by the products' bytes per element: one copy in
#: the products' dtype (bf16: half a float32 block; the backward's is the dw product's transposed
#: operand), and at "high"/"highest" precision its bf16 pieces as well...
X_WORK = {2: 0.5, 4: 5.0}
#: ...and in the forward two more float32 ``[b, 128]`` tiles of per-row state.
FORWARD_ROW_TILES = 2
#: Small buffers Mosaic adds to every kernel (semaphores, the overflow flag, alignment).
FIXED_BYTES = 512 * 1024


def _x_work(shape: Shape, block_b: int, block_h: int) -> int:
    """Mosaic's copies of a ``[block_b, block_h]`` x block (see :data:`X_WORK`)."""
    return int(X_WORK[shape.mm_bytes] * _tile(block_b, block_h, 4))


def _tile(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a ``[rows, cols]`` VMEM buffer laid out in (sublane, lane) tiles."""
    sublanes = 8 * max(1, 4 // itemsize)
    return round_up(max(rows, 1), sublanes) * round_up(max(cols, 1), LANES) * itemsize



@dataclasses.dataclass(frozen=True)
class Shape:
    """A problem as the tile rules see it (hidden already padded to 128)."""

    n: int
    hp: int
    v: int
    x_bytes: int
    w_bytes: int
    with_sum: bool
    capped: bool
    mxu_bytes: int | None = None  # bytes per element of the products' operands (None: from the inputs)
    with_expected: bool = False
    with_argmax: bool = False  # the forward's max logit and its index (two more statistics)
    with_row_scale: bool = False  # a [N, 1] float32 input column beside the labels

    @property
    def n_stats(self) -> int:
        """Statistics per row (lse, label logit, and the optional logit sum and expected logit)."""
        return 2 + self.with_sum + self.with_expected

    @property
    def mm_bytes(self) -> int:
        """Bytes per element of the matmul operands (bf16 at "default" precision, else f32)."""
        if self.mxu_bytes is not None:
            return self.mxu_bytes
        return 2 if self.x_bytes == 2 and self.w_bytes == 2 else 4


def forward_bytes(shape: Shape, block_b: int, block_h: int, block_v: int, *, chip: ChipFacts) -> int:
    """VMEM the forward kernel needs with token block ``block_b``, hidden block ``block_h``, vocab block
    ``block_v`` on a core of ``chip`` (its MXU width sets the streamed step's column chunks): its declared
    buffers, and Mosaic's working set as fitted to libtpu's figures (module docs)."""
    blocked = block_h < shape.hp
    # The elementwise work spans one column chunk of the streamed step, or the whole block.
    columns = block_v if blocked else forward_column_chunk(chip.mxu_side, block_v) or block_v
    x_buffers = 2 if blocked else 1  # a resident x (the hidden dimension whole) is single-buffered
    stats = shape.n_stats + 2 * shape.with_argmax
    total = FIXED_BYTES + x_buffers * _tile(block_b, block_h, shape.x_bytes)
    total += 2 * _tile(block_h, block_v, shape.w_bytes)
    total += 2 * (1 + shape.with_row_scale) * _tile(block_b, 1, 4)  # labels (and the row scale)
    total += 2 * stats * _tile(block_b, 1, 4)  # outputs
    if blocked:
        # Running max, sum, label (, logit sum, weighted sum) per row; logits summed over hidden blocks.
        total += (stats + 1) * _tile(block_b, 1, 4) + _tile(block_b, block_v, 4)
    else:
        # The same per row and lane, in two slots but the reference, which has one.
        total += (2 * (stats + 1) - 1) * _tile(block_b, LANES, 4)
    work_tiles = chip.forward_work_tiles + shape.with_expected + 2 * shape.with_argmax
    total += int(work_tiles * _tile(block_b, columns, 4))
    total += FORWARD_ROW_TILES * _tile(block_b, LANES, 4)
    total += _x_work(shape, block_b, block_h)
    return total


def backward_bytes(shape: Shape, block_b: int, block_h: int, block_v: int, *, single_w: bool = True) -> int:
    """VMEM the backward kernel needs with token block ``block_b``, hidden chunk ``block_h``, vocab block
    ``block_v``: its declared buffers, and Mosaic's working set as fitted to libtpu's figures (module docs).

    ``block_h`` (the chunk of the dx/dw products) does not move libtpu's figure: the products go
    straight into the dw accumulator and the dx rows.
    """
    del block_h
    w_buffers = 1 if single_w else 2
    # The per-row columns: labels, lse, the cotangents of lse and of the label logit, then the optional
    # ones (the cotangent of the logit sum; the expected logit and its cotangent; the row scale).
    columns = 4 + shape.with_sum + 2 * shape.with_expected + shape.with_row_scale
    total = FIXED_BYTES + 2 * _tile(block_b, shape.hp, shape.x_bytes)  # x block
    # w's blocks, and dw's one staging block (the ragged last block's remainder buffer is small)
    total += (w_buffers + 1) * _tile(shape.hp, block_v, shape.w_bytes)
    total += 2 * columns * _tile(block_b, 1, 4)
    total += _tile(shape.hp, block_v, 4)  # dw accumulator
    total += 2 * _tile(block_b, shape.hp, 4)  # dx partial rows: two slots
    total += int(BACKWARD_WORK_TILES[shape.mm_bytes] * _tile(block_b, block_v, 4))
    total += _x_work(shape, block_b, shape.hp)
    return total


def forward_seconds(shape: Shape, facts: ChipFacts, num_cores: int, block_b: int, block_h: int,
                    block_v: int) -> float:
    """Roofline time of the forward: max(compute, HBM traffic) per core plus per-step overhead."""
    nb, nv, nh = math.ceil(shape.n / block_b), math.ceil(shape.v / block_v), shape.hp // block_h
    nv_core = math.ceil(nv / num_cores)
    flops = 2 * nb * block_b * shape.hp * nv_core * block_v
    w_traffic = nb * shape.hp * nv_core * block_v * shape.w_bytes
    x_traffic = nb * block_b * shape.hp * shape.x_bytes * (nv_core if nh > 1 else 1)
    busy = max(flops * _passes(shape) / facts.bf16_flops, (w_traffic + x_traffic) / facts.hbm_bytes_per_s)
    return busy + nb * nv_core * nh * STEP_OVERHEAD_S


def backward_seconds(shape: Shape, facts: ChipFacts, num_cores: int, block_b: int, block_v: int) -> float:
    """Roofline time of the backward per core: 3 matmuls per tile, x and the dx partial per tile."""
    nb, nv = math.ceil(shape.n / block_b), math.ceil(shape.v / block_v)
    nv_core = math.ceil(nv / num_cores)
    flops = 6 * nb * block_b * shape.hp * nv_core * block_v
    per_vocab_block = nb * block_b * shape.hp * (shape.x_bytes + 8) + 2 * shape.hp * block_v * shape.w_bytes
    traffic = nv_core * per_vocab_block
    busy = max(flops * _passes(shape) / facts.bf16_flops, traffic / facts.hbm_bytes_per_s)
    return busy + nb * nv_core * STEP_OVERHEAD_S


def _passes(shape: Shape) -> int:
    """MXU passes per product: float32 at full precision takes about six bf16 passes."""
    return 1 if shape.mm_bytes == 2 else 6
