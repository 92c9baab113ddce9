"""Fused linear cross-entropy for JAX: ``CE(x @ w, labels)`` without the ``[tokens, vocab]`` logits.

Importing this package imports no backend; a backend is loaded the first time its name is used.
"""

from ce_core import policy
from ce_core.api.distillation import linear_distillation_loss
from ce_core.api.log_probs import linear_log_probs
from ce_core.api.loss import linear_cross_entropy
from ce_core.api.objective import TokenFn, TokenObjectiveOptions, linear_token_objective
from ce_core.api.options import (
    LogitOptions,
    LogProbsOptions,
    LossOptions,
    LossTerms,
    PlacementOptions,
    ShardedLossOptions,
)
from ce_core.api.sharding import sharded_linear_cross_entropy
from ce_core.contract.backend import (
    CONTRACT_VERSION,
    SUPPORTED_CONTRACT_VERSIONS,
    Backend,
    CotangentFn,
    Problem,
    RowStats,
    StatsSpec,
    localize_cotangent,
)
from ce_core.contract.block_sizes import BlockSizes
from ce_core.contract.errors import FallbackWarning, UnsupportedError
from ce_core.contract.registry import (
    available_backends,
    default_chain,
    get_backend,
    installed_backends,
    register_backend,
    unregister_backend,
)
from ce_core.contract.tile_report import PassTiles, TileReport

__version__ = "0.2.0"

__all__ = [
    "CONTRACT_VERSION",
    "SUPPORTED_CONTRACT_VERSIONS",
    "Backend",
    "BlockSizes",
    "CotangentFn",
    "FallbackWarning",
    "LogProbsOptions",
    "LogitOptions",
    "LossOptions",
    "LossTerms",
    "PassTiles",
    "PlacementOptions",
    "Problem",
    "RowStats",
    "ShardedLossOptions",
    "StatsSpec",
    "TileReport",
    "TokenFn",
    "TokenObjectiveOptions",
    "UnsupportedError",
    "available_backends",
    "default_chain",
    "get_backend",
    "installed_backends",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_log_probs",
    "linear_token_objective",
    "localize_cotangent",
    "policy",
    "register_backend",
    "sharded_linear_cross_entropy",
    "unregister_backend",
]
