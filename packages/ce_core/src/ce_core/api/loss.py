"""The public loss: every loss feature built once from a backend's row statistics.

With ``z_ij = cap(x_i . w_j)``, ``lse_i = logsumexp_j z_ij``, ``eps = label_smoothing`` and
``lam = logsumexp_weight``::

    l_i = (1 - eps) * (lse_i - z_{i,y_i}) + eps * (lse_i - mean_j z_ij) + lam * lse_i**2
    a_i = weights_i * [y_i != ignore_index]
    "none": a_i * l_i    "sum": sum_i a_i l_i    "mean": sum_i a_i l_i / sum_i a_i (0 when that is 0)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Unpack, overload

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ce_core.api import validation
from ce_core.api.options import LossOptions, Options
from ce_core.api.prepare import prepare, run_placed
from ce_core.contract.backend import Backend, RowStats, StatsSpec
from ce_core.sharded import ops
from ce_core.sharded.placement import Placement, find_placement


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static coefficients that turn row statistics into per-token losses."""

    label_smoothing: float
    logsumexp_weight: float
    vocab_size: int


def token_losses(stats: RowStats, config: LossConfig) -> jax.Array:
    """Unweighted per-token loss ``l_i`` from the row statistics (float32 ``[N]``)."""
    eps, lam = config.label_smoothing, config.logsumexp_weight
    loss = stats.lse - stats.label
    if eps:
        if stats.sum is None:
            raise ValueError("label smoothing needs the logit sum; compute the statistics with with_sum=True")
        loss = (1.0 - eps) * loss + eps * (stats.lse - stats.sum / config.vocab_size)
    if lam:
        loss = loss + lam * jnp.square(stats.lse)
    return loss


@overload
def linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_lse: Literal[False] = ...,
                         return_argmax: Literal[False] = ..., **options: Unpack[LossOptions]) -> jax.Array: ...


@overload
def linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_lse: Literal[True],
                         return_argmax: Literal[False] = ...,
                         **options: Unpack[LossOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_lse: Literal[False] = ...,
                         return_argmax: Literal[True],
                         **options: Unpack[LossOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_lse: Literal[True],
                         return_argmax: Literal[True],
                         **options: Unpack[LossOptions]) -> tuple[jax.Array, jax.Array, jax.Array]: ...


@overload
def linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_lse: bool = ...,
                         return_argmax: bool = ...,
                         **options: Unpack[LossOptions]) -> jax.Array | tuple[jax.Array, ...]: ...


def linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_lse: bool = False,
                         return_argmax: bool = False,
                         **options: Unpack[LossOptions]) -> jax.Array | tuple[jax.Array, ...]:
    """Cross-entropy of the logits ``x @ w`` against ``labels``, never materialising the logits.

    Args:
      x: ``[..., H]`` hidden states (bf16, f16 or f32).
      labels: ``[...]`` integer class ids in ``[0, V)``, or ``ignore_index``.
      w: ``[H, V]`` output projection, or ``[V, H]`` with ``w_layout="vh"`` (a tied embedding table).
      return_lse: also return the per-token logsumexp (float32, shape of ``labels``).
      return_argmax: also return the per-token argmax of the final logits (after the soft cap and
        the temperature): int32 in the shape of ``labels``, the lowest index of the maximum, ``-1``
        where the label is ``ignore_index``; not differentiated. ``argmax == labels`` gives the
        token accuracy.
      **options: keyword options (:class:`ce_core.LossOptions`, each documented there):
        ``reduction="mean"``, ``weights=None``, ``ignore_index=-100``, ``logsumexp_weight=0.0``,
        ``logit_soft_cap=None``, ``label_smoothing=0.0``, ``temperature=1.0`` (a number, or an
        array broadcastable to ``labels``; not differentiated), ``w_layout="hv"``,
        ``implementation=None``, ``block_sizes=None``, ``precision=None``, ``vocab_axis_name=None``,
        ``in_specs=None``.

    Returns:
      The float32 loss (a scalar, or the shape of ``labels`` for ``reduction="none"``); with
      ``return_lse`` or ``return_argmax`` a tuple: the loss, then the lse if asked, then the argmax
      if asked. Gradients have the dtypes (and ``dw`` the layout) of ``x`` and ``w``.

    Raises:
      ValueError: a bad shape, dtype or option (the message names it), an unknown backend name,
        or concrete labels outside ``[0, V)`` (or a concrete temperature that is not finite and
        positive). Under ``jit`` such values cannot be checked: that token's loss is NaN instead,
        so training notices. Labels are never clamped.
      UnsupportedError: the named backend cannot run this call.
    """
    settings, weights, temperature = Options.of("linear_cross_entropy", LossOptions, options)
    x, labels, w, weights = validation.input_arrays(x, labels, w, weights, settings.w_layout)
    temperature_tokens = None if temperature is None else validation.temperature_tokens(temperature, labels.shape)
    placement = find_placement(x, labels, w, settings.vocab_axis_name, settings.in_specs, settings.w_layout)
    outputs = run_placed(loss_with_placement, x, labels, w, placement, weights=weights,
                         temperature_tokens=temperature_tokens, options=settings, return_lse=bool(return_lse),
                         return_argmax=bool(return_argmax))
    return packed(outputs)


def packed(outputs: tuple[jax.Array, jax.Array | None, jax.Array | None]) -> jax.Array | tuple[jax.Array, ...]:
    """The loss alone, or ``(loss[, lse][, argmax])`` when either was asked for."""
    loss, lse, argmax = outputs
    extras = tuple(v for v in (lse, argmax) if v is not None)
    return (loss, *extras) if extras else loss


def loss_with_placement(x: jax.Array, labels: jax.Array, w: jax.Array, placement: Placement, *,
                        weights: jax.Array | None, options: Options, return_lse: bool,
                        temperature_tokens: jax.Array | None = None,
                        return_argmax: bool = False) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(loss, lse, argmax)`` of :func:`linear_cross_entropy` on validated arrays, run as ``placement`` says.

    ``lse`` is ``None`` unless ``return_lse``, ``argmax`` unless ``return_argmax``.
    """
    call = prepare(x, labels, w, placement, weights=weights, options=options,
                   with_sum=options.label_smoothing > 0, with_expected=False,
                   temperature_tokens=temperature_tokens, with_argmax=return_argmax)
    config = LossConfig(float(options.label_smoothing), float(options.logsumexp_weight), call.vocab)
    token_weights = call.counted.astype(jnp.float32)
    if call.weights is not None:
        token_weights = token_weights * call.weights.astype(jnp.float32)

    reduction = options.reduction
    if return_lse:  # every token's lse is returned, ignored ones included
        call.live = None
    # A zero weight on a valid label stays live: the loss's gradient in that weight is the token's loss.
    if reduction == "none" or return_lse or call.labels.size == 0:
        stats = call.row_stats()
        per_token = token_weights * token_losses(stats, config) + call.nan_if_bad
        if reduction == "none":
            loss = call.restore(per_token)
        elif reduction == "sum":
            loss = jnp.sum(per_token)
        else:
            loss = jnp.sum(per_token) / _safe_total(token_weights)
        return (loss, call.restore(stats.lse) if return_lse else None,
                call.argmax_out(stats.argmax) if return_argmax else None)

    if reduction == "mean":
        token_weights = token_weights / _safe_total(token_weights)
    reduced = _reduced_loss_fn(call.backend, call.spec, config, call.placement, call.live is not None)
    per_token = ops.per_token_args(call.row_scale, call.live)
    loss, argmax = reduced(call.x, call.w, call.labels, token_weights, *per_token)
    return loss + jnp.sum(call.nan_if_bad), None, call.argmax_out(argmax) if return_argmax else None


def _safe_total(token_weights: jax.Array) -> jax.Array:
    """The mean's denominator; 1 when all weights are 0, so an all-ignored batch gives loss 0."""
    total = jnp.sum(token_weights)
    return jnp.where(total == 0, 1.0, total)


@functools.lru_cache(maxsize=256)
def _reduced_loss_fn(backend: Backend, spec: StatsSpec, config: LossConfig, placement: Placement, with_live: bool):
    """``(sum_i c_i l_i, argmax or None)`` with a VJP whose dx and dw are formed in the forward pass.

    For a scalar loss every per-token cotangent is known once that token's statistics are, up to
    the final scalar cotangent ``g``; the backend computes dx and dw alongside the statistics
    (``Backend.row_stats_and_grads``, on each shard) and the backward pass only scales them by ``g``.
    The argmax (``spec.with_argmax``) comes out of the same pass and takes no cotangent. After the
    coefficients come the row scale (``spec.with_row_scale``) and the live mask (``with_live``).
    """

    def split(per_token: tuple[jax.Array, ...]) -> tuple[jax.Array | None, jax.Array | None]:
        return ops.split_per_token(spec, with_live, per_token)

    def weighted_sum(stats: RowStats, coefficients: jax.Array) -> jax.Array:
        return jnp.sum(coefficients * token_losses(stats, config))

    weighted_sum_grad = jax.grad(weighted_sum)

    def cotangent_fn(stats: RowStats, coefficients: jax.Array) -> RowStats:
        # max and argmax carry no cotangent (and an int32 argmax cannot be differentiated), so a
        # backend may hand over its statistics whole.
        return weighted_sum_grad(stats._replace(max=None, argmax=None), coefficients)

    @jax.custom_vjp
    def reduced(x, w, labels, coefficients, *per_token):
        stats = ops.row_stats(backend, spec, placement, x, w, labels, *split(per_token))
        return weighted_sum(stats, coefficients), stats.argmax

    def forward(x, w, labels, coefficients, *per_token):
        stats, dx, dw = ops.row_stats_and_grads(backend, spec, placement, cotangent_fn, x, w, labels, coefficients,
                                                *split(per_token))
        losses = token_losses(stats, config)
        return (jnp.sum(coefficients * losses), stats.argmax), (dx, dw, losses)

    def backward(residuals: Any, cotangents: Any):
        dx, dw, losses = residuals
        g = cotangents[0]
        no_grads = (None,) * (spec.with_row_scale + with_live)
        return ((g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, g * losses, *no_grads)

    reduced.defvjp(forward, backward)
    return reduced
