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
