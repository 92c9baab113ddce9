"""Deprecated alias of :mod:`ce_pallas_tpu.tooling.aot` (the offline tools moved apart from the kernels
in ce-pallas-tpu 0.3; this alias goes in 0.4)."""

from __future__ import annotations

import warnings
from typing import Any

from ce_pallas_tpu.tooling import aot as _aot


def __getattr__(name: str) -> Any:
    warnings.warn(f"ce_pallas_tpu.aot is now ce_pallas_tpu.tooling.aot; ce_pallas_tpu.aot.{name} goes in "
                  "ce-pallas-tpu 0.4", DeprecationWarning, stacklevel=2)
    return getattr(_aot, name)
