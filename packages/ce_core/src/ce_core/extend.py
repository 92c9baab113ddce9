"""The declared surface for backend authors and tools: everything a backend package may import.

A backend (and ``ce-bench``) imports ``ce_core`` and this module only; every other ``ce_core``
module is private and may change without notice (``tests/test_architecture.py`` fails when a package
imports one). What is here, by role:

- **The contract** (:mod:`ce_core.contract.backend`): :class:`Backend` and the types it is called with
  (:class:`Problem`, :class:`StatsSpec`, :class:`RowStats`, ``CotangentFn``), the version a backend
  declares (:data:`CONTRACT_VERSION`), the placements it may be told (:data:`PLACEMENTS`),
  :func:`localize_cotangent` and :func:`inert_dead_rows`. :class:`BlockSizes`, :class:`TileReport`
  and :class:`PassTiles` for tile sizes; the pair statistics of version 5 (:mod:`ce_core.contract.pair`:
  :class:`PairSpec`, :class:`PairStats` and the elementwise :func:`scaled_logits`, :func:`pair_logits`,
  :func:`pair_stats_of`, :func:`pair_delta`); :class:`UnsupportedError` to decline a call (a fallback chain
  then moves on).
- **Registration**: :func:`register_backend`, :func:`unregister_backend`, :func:`get_backend`
  (installed backends register through the ``ce_core.backends`` entry-point group instead).
- **Inside ``shard_map``**: the varying-axes helpers a backend needs when it builds arrays of its own
  inside the caller's ``shard_map`` (:func:`vary`, :func:`vary_like`, :func:`varying_axes_of`).
- **Compiling**: :class:`CompileResult` and :func:`compile_program` (what a compile needed, and how
  long it took), :func:`first_line` of an error; :func:`quiet_libtpu_without_tpu` and
  :func:`host_has_tpu` for tools that compile for TPU on machines without one.
- **Testing** (:mod:`ce_core.testing`, loaded on first use): float64 oracles, random problems with
  logits of order 1, and :func:`compare_with_oracle`, which runs a backend through the public API
  against the oracle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ce_core.contract.backend import (
    CONTRACT_VERSION,
    PLACEMENTS,
    SUPPORTED_CONTRACT_VERSIONS,
    W_LAYOUTS,
    Backend,
    CotangentFn,
    Problem,
    RowStats,
    StatsSpec,
    inert_dead_rows,
    localize_cotangent,
)
from ce_core.contract.block_sizes import BlockSizes
from ce_core.contract.compiled import CompileResult, compile_program, first_line
from ce_core.contract.errors import FallbackWarning, UnsupportedError
from ce_core.contract.pair import (
    PAIR_DIVERGENCES,
    PAIR_VERSION,
    PairSpec,
    PairStats,
    pair_delta,
    pair_logits,
    pair_stats_of,
    scaled_logits,
)
from ce_core.contract.registry import get_backend, register_backend, unregister_backend
from ce_core.contract.tile_report import PassTiles, TileReport
from ce_core.contract.tpu_host import host_has_tpu, quiet_libtpu_without_tpu
from ce_core.contract.varying import vary, vary_like, varying_axes_of

if TYPE_CHECKING:
    from ce_core.testing import (
        IGNORED_PATTERNS,
        TOLERANCES,
        Case,
        compare_with_oracle,
        distillation_oracle,
        ignored_labels,
        log_probs_oracle,
        max_rel_error,
        oracle,
        random_problem,
        stats_oracle,
    )

#: Names served from :mod:`ce_core.testing`, imported on first use so a backend's runtime never loads it.
_TESTING = frozenset({"IGNORED_PATTERNS", "TOLERANCES", "Case", "compare_with_oracle", "distillation_oracle",
                      "ignored_labels", "log_probs_oracle", "max_rel_error", "oracle", "random_problem",
                      "stats_oracle"})


def __getattr__(name: str) -> Any:
    if name in _TESTING:
        from ce_core import testing

        return getattr(testing, name)
    raise AttributeError(f"module 'ce_core.extend' has no attribute {name!r}")

__all__ = [
    "CONTRACT_VERSION",
    "IGNORED_PATTERNS",
    "PAIR_DIVERGENCES",
    "PAIR_VERSION",
    "PLACEMENTS",
    "SUPPORTED_CONTRACT_VERSIONS",
    "TOLERANCES",
    "W_LAYOUTS",
    "Backend",
    "BlockSizes",
    "Case",
    "CompileResult",
    "CotangentFn",
    "FallbackWarning",
    "PairSpec",
    "PairStats",
    "PassTiles",
    "Problem",
    "RowStats",
    "StatsSpec",
    "TileReport",
    "UnsupportedError",
    "compare_with_oracle",
    "compile_program",
    "distillation_oracle",
    "first_line",
    "get_backend",
    "host_has_tpu",
    "ignored_labels",
    "inert_dead_rows",
    "localize_cotangent",
    "log_probs_oracle",
    "max_rel_error",
    "oracle",
    "pair_delta",
    "pair_logits",
    "pair_stats_of",
    "quiet_libtpu_without_tpu",
    "random_problem",
    "register_backend",
    "scaled_logits",
    "stats_oracle",
    "unregister_backend",
    "vary",
    "vary_like",
    "varying_axes_of",
]
