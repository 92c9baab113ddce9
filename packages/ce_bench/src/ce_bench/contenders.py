"""The implementations the bench compares: every ``ce_core`` backend and tokamax's implementations.

A *contender* is a name and a loss function ``loss(x, labels, w)`` with ``x: [N, H]``,
``labels: [N]``, ``w: [H, V]``. ``ce_core`` backends are found through the public registry
(:func:`ce_core.available_backends`), so a backend package installed later is picked up without
touching the bench. tokamax (optional extra ``ce-bench[tokamax]``) contributes
``tokamax:xla``, ``tokamax:chunked_xla`` and ``tokamax:mosaic_tpu``.

tokamax's API, read from the installed package (0.0.17,
``tokamax/_src/ops/linear_softmax_cross_entropy_loss/api.py``)::

    tokamax.linear_softmax_cross_entropy_loss(x: [B, H], labels: [B], weights: [H, V], *,
        reduction="sum" | "mean" | "none" = "sum", precision=None,
        implementation="xla" | "chunked_xla" | "mosaic_tpu" | None = None)

Same argument order and the same ``[H, V]`` weight layout as ``ce_core``. Differences: the default
reduction is ``"sum"`` (ce_core: ``"mean"``), so the bench always passes ``reduction`` explicitly;
``"mean"`` divides by B, every label counts (no ``ignore_index``: a label outside ``[0, V)`` adds
``lse`` to the loss rather than being skipped), and there are no weights, z-loss, soft cap or label
smoothing. The bench therefore draws labels that are all valid, where both define the same plain
cross-entropy. ``mosaic_tpu`` refuses non-TPU devices ("Not supported on cpu") unless tokamax's
``cross_compile`` option is on (the AOT report turns it on).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

import ce_core
from ce_bench import objectives

TOKAMAX_PREFIX = "tokamax:"
TokamaxImplementation = Literal["xla", "chunked_xla", "mosaic_tpu"]
TokamaxReduction = Literal["mean", "sum", "none"]
TOKAMAX_IMPLEMENTATIONS: tuple[TokamaxImplementation, ...] = ("xla", "chunked_xla", "mosaic_tpu")
TOKAMAX_REDUCTIONS: tuple[TokamaxReduction, ...] = ("mean", "sum", "none")

LossFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

#: Methods a ce_core backend may define to say which block sizes it would pick for a Problem.
#: None is part of the ce_core contract; the bench asks duck-typed and shows "-" otherwise.


def tokamax_installed() -> bool:
    """Whether the optional tokamax package can be imported (without importing it)."""
    return importlib.util.find_spec("tokamax") is not None


@dataclasses.dataclass(frozen=True)
class Contender:
    """One implementation under test: ``name`` as shown in tables, and how to call it."""

    name: str

    @property
    def is_tokamax(self) -> bool:
        """Whether this is one of tokamax's implementations (``tokamax:<impl>``)."""
        return self.name.startswith(TOKAMAX_PREFIX)

    @property
    def tokamax_implementation(self) -> str:
        """The tokamax implementation name (``xla``, ``chunked_xla``, ``mosaic_tpu``)."""
        return self.name[len(TOKAMAX_PREFIX):]

    def loss_fn(self, reduction: str) -> LossFn:
        """``f(x, labels, w)``: the plain cross-entropy with ``reduction``, or the ``rl`` objective
        (see :mod:`ce_bench.objectives`)."""
        if self.is_tokamax:
            if reduction == "rl":
                raise ce_core.UnsupportedError("tokamax has no per-token log-probability or entropy API")
            if reduction in ("distill", "distill_dense"):
                raise ce_core.UnsupportedError("tokamax has no distillation loss")
            if reduction not in TOKAMAX_REDUCTIONS:
                raise ValueError(f"unknown reduction {reduction!r} for tokamax; known: {list(TOKAMAX_REDUCTIONS)}")
            implementation = self.tokamax_implementation
            if implementation not in TOKAMAX_IMPLEMENTATIONS:
                raise ValueError(f"unknown tokamax implementation {implementation!r}; "
                                 f"known: {list(TOKAMAX_IMPLEMENTATIONS)}")
            import tokamax  # optional dependency, imported on use

            def tokamax_loss(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
                return tokamax.linear_softmax_cross_entropy_loss(
                    x, labels, w, reduction=reduction, implementation=implementation)

            return tokamax_loss

        return objectives.ce_core_objective(self.name, reduction)

    def programs(self, reduction: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(fwd, fwd_bwd)``: ``fwd(x, labels, w) -> loss`` and
        ``fwd_bwd(x, labels, w) -> (loss, (dx, dw))``, the gradient of the loss (of its sum for
        ``reduction="none"``)."""
        loss_fn = self.loss_fn(reduction)

        def fwd(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
            return loss_fn(x, labels, w)

        def fwd_bwd(x: jax.Array, labels: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            def objective(x_: jax.Array, w_: jax.Array) -> tuple[jax.Array, jax.Array]:
                loss = loss_fn(x_, labels, w_)
                return (jnp.sum(loss) if loss.ndim else loss), loss

            (_, loss), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(x, w)
            return loss, grads

        return fwd, fwd_bwd

    def block_sizes(self, n: int, h: int, v: int, dtype: Any) -> str | None:
        """Best-effort description of the tile sizes this implementation picks for the shape.

        Called inside the AOT target's context for TPU targets. ``None`` when not known.
        """
        try:
            if self.is_tokamax:
                return _tokamax_block_sizes(self.tokamax_implementation, n, h, v, dtype)
            backend = ce_core.get_backend(self.name)
            problem = ce_core.Problem(n, h, v, jnp.dtype(dtype), jnp.dtype(dtype), ce_core.StatsSpec())
            return format_block_sizes(backend.block_sizes_for(problem))
        except Exception:  # informational only
            return None


def tokamax_unsupported_reason(contender: Contender, device: Any) -> str | None:
    """Why tokamax itself declares ``contender`` unsupported on ``device`` (its ``supported_on``), or
    None. Used by the AOT report, where tokamax's own device check is lifted to cross-compile."""
    if not contender.is_tokamax:
        return None
    try:
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import api

        op = api.IMPLEMENTATIONS.get(contender.tokamax_implementation)
        if op is not None and not op.supported_on(device):
            return (f"tokamax declares {contender.tokamax_implementation} unsupported on {device.device_kind} "
                    f"({type(op).__name__}.supported_on is False)")
    except Exception:  # no verdict: let the compiler decide
        return None
    return None


def format_block_sizes(value: Any) -> str | None:
    """One line for a backend's :class:`ce_core.TileReport`, a ``ce_core.BlockSizes``, or a tokamax
    config (which has the same three ``*_block_size`` fields)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, ce_core.TileReport):
        return value.describe()
    fields = ("b_block_size", "h_block_size", "v_block_size")
    if not all(hasattr(value, field) for field in fields):
        return str(value)
    parts = [f"{field[0]}={'-' if getattr(value, field) is None else getattr(value, field)}" for field in fields]
    buffers = getattr(value, "buffer_count", None)
    if buffers is not None:
        parts.append(f"buf={buffers}")
    return " ".join(parts)


def _tokamax_block_sizes(implementation: str, n: int, h: int, v: int, dtype: Any) -> str | None:
    if implementation == "chunked_xla":
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

        config = chunked_xla.Config()
        return f"b={config.b_block_size} v={config.v_block_size}"
    if implementation == "mosaic_tpu":
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import (
            pallas_mosaic_tpu_kernel as kernel,
        )

        fwd = kernel.get_heuristic_fwd_config(n, h, v, dtype=jnp.dtype(dtype))
        bwd = kernel.get_heuristic_bwd_config(n, h, v, dtype=jnp.dtype(dtype))
        return f"fwd {format_block_sizes(fwd)}; bwd {format_block_sizes(bwd)}"
    return None


def default_names(*, include_tokamax: bool = True) -> list[str]:
    """Every ce_core backend available on this platform, then tokamax's implementations."""
    names = list(ce_core.available_backends())
    if include_tokamax and tokamax_installed():
        names += [TOKAMAX_PREFIX + implementation for implementation in TOKAMAX_IMPLEMENTATIONS]
    return names


def known_names() -> list[str]:
    """Every name ``--backends`` accepts: the installed ce_core backends (whether or not they can run
    here; those that cannot get a row that says why) and tokamax's implementations."""
    return [*ce_core.installed_backends(), *(TOKAMAX_PREFIX + impl for impl in TOKAMAX_IMPLEMENTATIONS)]


def parse_names(spec: str | None, *, include_tokamax: bool = True) -> list[str]:
    """Contender names from ``--backends`` (comma-separated; ``all`` or empty for the default).

    ``tokamax`` alone expands to its three implementations. Unknown names are kept: the run gives
    them a row that says why they cannot run.
    """
    items = [item.strip() for item in (spec or "").split(",") if item.strip()]
    if not items or items == ["all"]:
        return default_names(include_tokamax=include_tokamax)
    names: list[str] = []
    for item in items:
        expanded = ([TOKAMAX_PREFIX + impl for impl in TOKAMAX_IMPLEMENTATIONS] if item == "tokamax"
                    else default_names(include_tokamax=include_tokamax) if item == "all" else [item])
        names += [name for name in expanded if name not in names]
    return names
