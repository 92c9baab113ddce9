"""Deprecated alias of :mod:`ce_xla.tiling` (renamed in ce-xla 0.3 so that both backends name this role
alike; this alias goes in 0.4)."""

from __future__ import annotations

import warnings
from typing import Any

from ce_xla import tiling as _tiling


def __getattr__(name: str) -> Any:
    warnings.warn(f"ce_xla.chunking is now ce_xla.tiling; ce_xla.chunking.{name} goes in ce-xla 0.4",
                  DeprecationWarning, stacklevel=2)
    return getattr(_tiling, name)
