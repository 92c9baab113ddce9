"""The cost model of the two kernels: VMEM footprint and roofline time for a choice of tiles (estimates).

The footprints count every pipelined block with its buffer count, the scratch, and a margin for
the ``[b, v]`` float32 temporaries Mosaic keeps while it evaluates the elementwise tail (logits,
exp, masks). Blocks are rounded up to the (sublane, 128-lane) layout tiles. The coefficients were
fitted to the scoped VMEM that libtpu's compiler actually allocates (found by bisecting
``vmem_limit_bytes`` in deviceless ahead-of-time compiles on v4 and v5p) and err on the large side
by 0-30%. They are used to reject tiles that cannot fit (explicit ones with a ``ValueError``) and to
pick tiles on a table miss; the ahead-of-time compile tests check the tuned ones for real.
"""

from __future__ import annotations

import dataclasses
import math

from ce_pallas_tpu.layout import LANES, forward_column_chunk, round_up
from ce_pallas_tpu.target import ChipFacts

#: Seconds of fixed cost per grid step (pipeline bookkeeping, DMA issue), a measured ballpark.
STEP_OVERHEAD_S = 0.35e-6
#: Number of ``[b, v]`` float32 temporaries assumed live at once in the kernels' elementwise code.
FORWARD_TEMPORARIES = 7
BACKWARD_TEMPORARIES = 8
#: Internal scratch and small buffers Mosaic adds to every kernel.
FIXED_BYTES = 1536 * 1024
#: bf16 pieces Mosaic splits each float32 operand of a product into at "high"/"highest" precision
#: (it keeps them in VMEM beside the operand: 6 more bytes per element).
F32_SPLIT_PIECES = 3


def _split_bytes(shape: Shape, *operands: tuple[int, int]) -> int:
    """VMEM for the bf16 pieces of float32 product operands ``(rows, cols)`` (0 for bf16 products)."""
    if shape.mm_bytes != 4:
        return 0
    return sum(F32_SPLIT_PIECES * _tile(rows, cols, 2) for rows, cols in operands)


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


def forward_bytes(shape: Shape, block_b: int, block_h: int, block_v: int, *, single_x: bool = True,
                  mxu_side: int = 128) -> int:
    """VMEM the forward kernel needs with token block ``block_b``, hidden block ``block_h``, vocab block
    ``block_v``, on a generation with ``mxu_side``-wide MXUs (where the streamed step works in column chunks)."""
    blocked = block_h < shape.hp
    # The elementwise temporaries span one column chunk of the streamed step, or the whole block.
    columns = block_v if blocked else forward_column_chunk(mxu_side, block_v) or block_v
    # A single-buffered resident x still costs about half a buffer more (the matmul's operand copy).
    x_buffers = 2 if (blocked or not single_x) else 1.5
    stats = shape.n_stats + 2 * shape.with_argmax
    total = FIXED_BYTES + int(x_buffers * _tile(block_b, block_h, shape.x_bytes))
    total += 2 * _tile(block_h, block_v, shape.w_bytes)
    total += 2 * (1 + shape.with_row_scale) * _tile(block_b, 1, 4)  # labels (and the row scale)
    total += 2 * stats * _tile(block_b, 1, 4)  # outputs
    if blocked:
        # Running max, sum, label (, logit sum, weighted sum) per row; logits summed over hidden blocks.
        total += (stats + 1) * _tile(block_b, 1, 4) + _tile(block_b, block_v, 4)
    else:
        total += 2 * (stats + 1) * _tile(block_b, LANES, 4)  # two slots of the same per row and lane
    total += (FORWARD_TEMPORARIES + (1 if shape.capped else 0)) * _tile(block_b, columns, 4)
    total += _split_bytes(shape, (block_b, block_h), (block_h, columns))
    return total


def backward_bytes(shape: Shape, block_b: int, block_h: int, block_v: int, *, single_w: bool = True) -> int:
    """VMEM the backward kernel needs with token block ``block_b``, hidden chunk ``block_h``, vocab block
    ``block_v``."""
    w_buffers = 1 if single_w else 2
    # x-independent columns: labels, lse and the cotangents (+ the expected logit and its cotangent).
    columns = 3 + shape.n_stats + shape.with_expected
    total = 2 * _tile(block_b, shape.hp, shape.x_bytes)
    total += w_buffers * _tile(shape.hp, block_v, shape.w_bytes)  # w block
    total += w_buffers * _tile(shape.hp, block_v, shape.w_bytes)  # dw block
    total += 2 * columns * _tile(block_b, 1, 4)
    total += _tile(shape.hp, block_v, 4)  # dw accumulator
    total += 2 * _tile(block_b, shape.hp, 4)  # dx partial in / out
    temporaries = BACKWARD_TEMPORARIES + (2 if shape.capped else 0) + (1 if shape.with_expected else 0)
    total += temporaries * _tile(block_b, block_v, 4)
    total += _tile(block_b, block_v, shape.mm_bytes)  # delta in the matmul dtype
    total += _tile(block_h, block_v, 4) + _tile(block_b, block_h, 4)  # one chunk's products
    total += _split_bytes(shape, (block_b, shape.hp), (shape.hp, block_v), (block_b, block_v))
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
