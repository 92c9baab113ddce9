"""Tile sizes a backend may be told to use instead of choosing its own."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes for the token (b), hidden (h) and vocab (v) dimensions.

    A field left as ``None`` is chosen by the backend. Each backend documents which fields it
    reads and which further constraints it puts on them (for example a multiple of 128 on TPU);
    a size it cannot use is a ``ValueError`` from that backend, never a silent clamp.
    """

    b_block_size: int | None = None
    h_block_size: int | None = None
    v_block_size: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"BlockSizes.{field.name} must be a positive int or None, got {value!r}"
                )
