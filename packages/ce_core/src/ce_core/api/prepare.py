"""What every entry point does before the backend runs: place inputs, choose a backend, make labels safe.

The loss (:mod:`ce_core.api.loss`) and the log-probabilities (:mod:`ce_core.api.log_probs`) are both built
from row statistics of the same logits; this module turns validated arguments into a
:class:`PreparedCall` holding everything those statistics need.

Temperature is applied here, not in the backends: ``cap_c(z) / T == cap_{c/T}(z / T)`` and
``z / T = (x / T) @ w``, so scaling ``x`` by ``1/T`` and the soft cap by ``1/T`` gives exactly the
tempered logits ``cap(x . w) / T``, on every backend, for the cost of one ``[N, H]`` product.

A per-token temperature (an array) travels as a traced ``"tokens"`` array beside the weights. Without
a soft cap the rows of ``x`` are scaled by ``1 / T_i`` the same way; with one, ``cap_c`` cannot absorb a
different ``T_i`` per row, so the backend gets ``row_scale = 1 / T_i`` instead (contract version 3:
``z_ij = s_i cap(x_i . w_j)``). The temperature is never differentiated; a traced value that is not
finite and positive makes that token's result NaN (``nan_if_bad``), as a bad label does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from ce_core.api import validation
from ce_core.api.options import Options
from ce_core.contract.backend import Backend, Problem, RowStats, StatsSpec
from ce_core.contract.registry import select_backend
from ce_core.contract.varying import align_varying
from ce_core.sharded import ops
from ce_core.sharded.flat_tokens import FlatTokens
from ce_core.sharded.placement import Placement
from ce_core.sharded.vocab_parallel import vocab_shards


@dataclasses.dataclass
class PreparedCall:
    """Inputs laid out for ``placement``, the chosen backend, and the per-token bookkeeping.

    ``labels`` are safe to hand to a backend (ignored and out-of-vocab tokens map to 0);
    ``counted`` marks tokens whose label is not ``ignore_index``; ``nan_if_bad`` is NaN at counted
    tokens whose label lies outside ``[0, V)`` or whose (traced) temperature is not finite and
    positive (under ``jit`` they cannot raise) and 0 elsewhere. ``row_scale`` is the per-token scale
    the backend applies after the cap (``spec.with_row_scale``), else ``None``. ``live`` marks the tokens
    whose statistics the call needs, for a backend that can skip the others (contract version 4; ``None``
    for older backends): the counted ones, unless the entry point narrows it or drops it.
    """

    x: jax.Array
    w: jax.Array
    labels: jax.Array
    counted: jax.Array
    nan_if_bad: jax.Array
    weights: jax.Array | None
    backend: Backend
    spec: StatsSpec
    placement: Placement
    vocab: int
    flat: FlatTokens | None = None
    row_scale: jax.Array | None = None
    live: jax.Array | None = None

    def restore(self, per_token: jax.Array) -> jax.Array:
        """A per-token result in the shape of the caller's labels (undoing the placement's flattening)."""
        return per_token if self.flat is None else self.flat.restore(per_token)

    def row_stats(self) -> RowStats:
        """Statistics over the whole vocabulary, shaped like the labels; differentiable in x and w."""
        if self.labels.size == 0:  # nothing to stream over; every backend would need a special case
            empty = jnp.zeros(self.labels.shape, jnp.float32)
            argmax = self.spec.with_argmax
            return RowStats(empty, empty, empty if self.spec.with_sum else None,
                            empty if self.spec.with_expected else None, empty if argmax else None,
                            jnp.zeros(self.labels.shape, jnp.int32) if argmax else None)
        return ops.row_stats(self.backend, self.spec, self.placement, self.x, self.w, self.labels, self.row_scale,
                             self.live)

    def argmax_out(self, argmax: jax.Array | None) -> jax.Array:
        """The per-token argmax in the labels' shape: int32, ``-1`` where the label is ``ignore_index``."""
        assert argmax is not None  # asked for with with_argmax=True
        return self.restore(jnp.where(self.counted, argmax, -1).astype(jnp.int32))


def prepare(
    x: jax.Array,
    labels: jax.Array,
    w: jax.Array,
    placement: Placement,
    *,
    weights: jax.Array | None,
    options: Options,
    with_sum: bool,
    with_expected: bool,
    temperature_tokens: jax.Array | None = None,
    with_argmax: bool = False,
) -> PreparedCall:
    """A :class:`PreparedCall` from validated arguments.

    ``temperature_tokens``: a per-token temperature in the labels' shape (float32), else ``None``
    (the static ``options.temperature`` applies).
    """
    ignore_index, logit_soft_cap, temperature = options.ignore_index, options.logit_soft_cap, options.temperature
    hidden, local_vocab = w.shape if options.w_layout == "hv" else w.shape[::-1]
    if placement.kind == "local" and placement.vocab_axes:
        vocab = local_vocab * vocab_shards(placement.vocab_axes)
    else:
        vocab = local_vocab
        validation.check_concrete_labels(labels, vocab, ignore_index)
    flat = FlatTokens.over(labels.shape, placement.token_shards()) if placement.flat_tokens else None
    if flat is not None:
        x, labels = flat.rows(x), flat.tokens(labels, ignore_index)
        weights = None if weights is None else flat.tokens(weights, 0)
        temperature_tokens = None if temperature_tokens is None else flat.tokens(temperature_tokens, 1.0)
    x, labels, w = placement.lay_out(x, "x"), placement.lay_out(labels, "tokens"), placement.lay_out(w, "w")
    weights = None if weights is None else placement.lay_out(weights, "tokens")
    if temperature != 1.0:
        x = x * jnp.asarray(1.0 / temperature, x.dtype)
        logit_soft_cap = None if logit_soft_cap is None else logit_soft_cap / temperature
    row_scale, bad_temperature = None, None
    if temperature_tokens is not None:
        t = jax.lax.stop_gradient(placement.lay_out(temperature_tokens, "tokens"))
        good = jnp.isfinite(t) & (t > 0)
        bad_temperature = ~good
        inverse = 1.0 / jnp.where(good, t, 1.0)
        if logit_soft_cap is None:
            x = x * inverse[..., None].astype(x.dtype)
        else:
            row_scale = inverse

    spec = StatsSpec(
        logit_soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
        with_sum=with_sum,
        block_sizes=options.block_sizes,
        with_expected=with_expected,
        precision=options.precision,
        w_layout=options.w_layout,
        with_argmax=with_argmax,
        with_row_scale=row_scale is not None,
        keep_logits=options.keep_logits,
    )
    problem = Problem(labels.size // placement.token_shards(), hidden, local_vocab // placement.vocab_shards(),
                      x.dtype, w.dtype, spec, placement.kind)
    backend = select_backend(options.implementation, problem)

    y = labels.astype(jnp.int32)
    counted = y != ignore_index
    in_vocab = (y >= 0) & (y < vocab)
    bad = counted & ~in_vocab
    if bad_temperature is not None:
        bad = bad | (counted & bad_temperature)
    nan_if_bad = jnp.where(bad, jnp.nan, 0.0).astype(jnp.float32)
    safe_y = jnp.where(counted & in_vocab, y, 0)
    if placement.typed:  # inside the caller's shard_map: see ce_core.contract.varying.align_varying
        x, w, safe_y, row_scale = align_varying(x, w, safe_y, row_scale)
    live = counted if backend.takes_live_rows else None
    return PreparedCall(x, w, safe_y, counted, nan_if_bad, weights, backend, spec, placement, vocab, flat, row_scale,
                        live)


def run_placed(fn: Callable[..., Any], x: jax.Array, labels: jax.Array, w: jax.Array, placement: Placement, *,
               weights: jax.Array | None = None, temperature_tokens: jax.Array | None = None,
               token_inputs: tuple[jax.Array, ...] | None = None, options: Options, **static: Any) -> Any:
    """``fn(x, labels, w, placement, weights=..., temperature_tokens=..., options=..., **static)``, jitted where needed.

    Under Auto axes the mesh of a call made outside ``jit`` is often only the abstract one of its
    traced inputs (``jax.grad`` of an eager call): the inputs cannot be laid out on it op by op, so
    the call is compiled as one program, as the caller's own ``jit`` would (the labels are checked
    first, while they are still concrete). ``weights``, ``temperature_tokens`` and ``token_inputs`` (per-token
    arrays of :func:`ce_core.linear_token_objective`, passed to ``fn`` only when given) are traced; ``options``
    and ``static`` are static.
    """
    traced: dict[str, Any] = dict(weights=weights, temperature_tokens=temperature_tokens)
    if token_inputs is not None:
        traced["token_inputs"] = token_inputs
    if placement.kind != "shard_map" or not isinstance(placement.mesh, AbstractMesh) or placement.mesh.explicit_axes:
        return fn(x, labels, w, placement, options=options, **traced, **static)
    validation.check_concrete_labels(labels, w.shape[validation.vocab_dim(options.w_layout)], options.ignore_index)
    return _jitted(fn, tuple(sorted(static)))(x, labels, w, placement, options=options, **traced, **static)


@functools.lru_cache(maxsize=64)
def _jitted(fn: Callable[..., Any], static_names: tuple[str, ...]) -> Callable[..., Any]:
    return jax.jit(fn, static_argnums=(3,), static_argnames=("options", *static_names))
