"""Pallas TPU kernels for ce_core: a streaming forward and a core-grid backward.

Registered as the ``pallas_tpu`` backend (entry point group ``ce_core.backends``). The kernels
compute the row statistics of ``cap(x @ w)`` (lse, label logit, logit sum) and their VJP without
the ``[N, V]`` logits ever leaving VMEM. ``CE_PALLAS_TPU_INTERPRET=1`` runs them in Pallas' TPU
interpret mode on CPU; ``CE_PALLAS_TPU_TARGET=v5p`` (or v4, v5e, v6e, tpu7x) targets a generation for
ahead-of-time compilation. See the package README.
"""

import warnings
from typing import Any

from ce_pallas_tpu.backend import PallasTpuBackend, make_backend
from ce_pallas_tpu.ops import make_plan, row_stats
from ce_pallas_tpu.target import Target, current_target
from ce_pallas_tpu.tile_types import KernelTiles, Tiles, TunedEntry
from ce_pallas_tpu.tiling import shape_bucket
from ce_pallas_tpu.tuned import TUNED

__version__ = "0.2.0"

__all__ = [
    "TUNED",
    "KernelTiles",
    "PallasTpuBackend",
    "Target",
    "Tiles",
    "TunedEntry",
    "current_target",
    "make_backend",
    "make_plan",
    "row_stats",
    "shape_bucket",
]

#: Names kept for one minor version after a rename: old name -> (the new object, what to use instead).
_DEPRECATED: dict[str, tuple[Any, str]] = {
    # 0.3: fitted tiles are a KernelTiles[int] (its hidden block always set).
    "FittedTiles": (KernelTiles, "KernelTiles"),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        value, instead = _DEPRECATED[name]
        warnings.warn(f"ce_pallas_tpu.{name} is deprecated and goes in the next minor version; use {instead}",
                      DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
