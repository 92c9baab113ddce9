"""TPU vector layout constants and the integer helpers every tile computation uses."""

from __future__ import annotations

#: Lanes of a vector register: the minor dimension of every VMEM tile.
LANES = 128
#: Sublanes of a 32-bit vector register: the second-minor dimension of a float32 VMEM tile.
SUBLANES = 8


def cdiv(value: int, divisor: int) -> int:
    """``ceil(value / divisor)`` for positive ints."""
    return -(-value // divisor)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``."""
    return cdiv(value, multiple) * multiple


def forward_column_chunk(mxu_side: int, block_v: int) -> int | None:
    """Vocab columns per piece of the forward's streamed step (``None``: the whole block at once).

    One MXU width where the MXUs are 256 wide (v6e, TPU7x) and the block spans several: each piece's
    product is followed in program order by its statistics, which libtpu's scheduler interleaves with
    the next piece's product. On 128-wide MXUs (v4, v5e, v5p) the whole block is left as it is
    (128-column pieces measured the same on v5e).
    """
    if mxu_side < 256 or block_v <= mxu_side or block_v % mxu_side:
        return None
    return mxu_side
