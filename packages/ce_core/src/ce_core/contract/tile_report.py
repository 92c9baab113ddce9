"""What a backend reports about the tiles it would use for a problem (``Backend.block_sizes_for``).

One typed report for every backend, so that tools (the bench, a user's logs) print any backend's
plan the same way without knowing its internal plan types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from ce_core.contract.block_sizes import BlockSizes


@dataclasses.dataclass(frozen=True)
class PassTiles:
    """The tiles of one pass of a backend (a kernel, or a loop over chunks).

    ``block_sizes`` holds the token (b), hidden (h) and vocab (v) tile of the pass, ``None`` where
    the pass does not block that dimension; ``grid`` the number of steps along each grid axis, when
    the pass has one.
    """

    name: str
    block_sizes: BlockSizes
    grid: tuple[int, ...] | None = None

    def describe(self) -> str:
        """``'forward b=512 h=- v=1024 grid=2x16x63x1'``."""
        sizes = self.block_sizes
        parts = [self.name, *(f"{label}={'-' if size is None else size}" for label, size in
                              (("b", sizes.b_block_size), ("h", sizes.h_block_size), ("v", sizes.v_block_size)))]
        if self.grid is not None:
            parts.append("grid=" + "x".join(str(steps) for steps in self.grid))
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class TileReport:
    """The passes of a backend for one problem, where their tiles came from, and further facts.

    ``source`` says how the tiles were chosen (for example ``"explicit"`` for ``block_sizes`` given
    by the caller, ``"table:v5p/llama3"``, ``"inferred"``); ``details`` holds backend-specific facts
    as text (for example the xla backend's ``gradient_order``).
    """

    passes: tuple[PassTiles, ...]
    source: str
    details: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        names = [tiles.name for tiles in self.passes]
        if len(set(names)) != len(names):
            raise ValueError(f"TileReport.passes must have distinct names, got {names}")
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))

    def __getitem__(self, name: str) -> PassTiles:
        """The pass called ``name``."""
        for tiles in self.passes:
            if tiles.name == name:
                return tiles
        raise KeyError(f"no pass {name!r}; this report has {[tiles.name for tiles in self.passes]}")

    def describe(self) -> str:
        """One line: each pass, the source, the details."""
        parts = [tiles.describe() for tiles in self.passes]
        parts.append(f"source={self.source}")
        parts += [f"{key}={value}" for key, value in self.details.items()]
        return "; ".join(parts)
