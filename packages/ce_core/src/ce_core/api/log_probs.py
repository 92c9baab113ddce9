"""Per-token log-probabilities and entropies of the LM head's softmax, for RL objectives.

GRPO, PPO and their relatives need, per sampled token, ``log p(y_i | x_i)`` under a sampling
temperature, and often the entropy of the token distribution (a bonus, or a metric). Both come from
row statistics of the tempered logits ``z = cap(x @ w) / T`` without the ``[N, V]`` logits:

    logp_i    = z_{i, y_i} - lse_i
    entropy_i = -sum_j p_ij log p_ij = lse_i - sum_j p_ij z_ij       (p_i = softmax(z_i))

The second needs the expected logit ``sum_j p_ij z_ij``, a statistic backends stream alongside the
logsumexp only when asked (``StatsSpec.with_expected``), so the plain loss never pays for it.
"""

from __future__ import annotations

from typing import Literal, Unpack, overload

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ce_core.api import validation
from ce_core.api.options import LogProbsOptions, Options
from ce_core.api.prepare import prepare, run_placed
from ce_core.sharded.placement import Placement, find_placement


@overload
def linear_log_probs(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_entropy: Literal[False] = ...,
                     **options: Unpack[LogProbsOptions]) -> jax.Array: ...


@overload
def linear_log_probs(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_entropy: Literal[True],
                     **options: Unpack[LogProbsOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def linear_log_probs(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_entropy: bool,
                     **options: Unpack[LogProbsOptions]) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def linear_log_probs(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, return_entropy: bool = False,
                     **options: Unpack[LogProbsOptions]) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probability of each label under ``softmax(cap(x @ w) / temperature)``, never materialising the logits.

    Args:
      x: ``[..., H]`` hidden states (bf16, f16 or f32).
      labels: ``[...]`` integer token ids in ``[0, V)`` (the sampled tokens), or ``ignore_index``.
      w: ``[H, V]`` output projection, or ``[V, H]`` with ``w_layout="vh"``.
      return_entropy: also return each token distribution's entropy (costs one more streamed
        statistic; off by default so plain log-probabilities pay nothing for it).
      **options: keyword options (:class:`ce_core.LogProbsOptions`, each documented there):
        ``temperature=1.0`` (the sampling temperature: a number, or an array broadcastable to
        ``labels``, per token or per sequence; not differentiated), ``logit_soft_cap=None`` (applied before the
        temperature), ``ignore_index=-100`` (such tokens' ``logp`` and entropy are 0, and they
        receive no gradient), ``implementation``, ``block_sizes``, ``precision``,
        ``w_layout``, ``vocab_axis_name`` and ``in_specs`` as for :func:`ce_core.linear_cross_entropy`; the call
        follows the shardings of its inputs the same way.

    Returns:
      float32 ``logp`` with the shape of ``labels``, and the float32 entropy of the same shape when
      ``return_entropy``. Both are differentiable in ``x`` and ``w`` (gradients in their dtypes), so
      any objective built on them (clipped ratios, KL to a reference policy, an entropy bonus)
      trains through them.

    Raises:
      ValueError: a bad shape, dtype or option (the message names it), or concrete labels outside
        ``[0, V)``; under ``jit`` such a token's ``logp`` is NaN instead. Labels are never clamped.
      UnsupportedError: the named backend cannot run this call.
    """
    settings, _, temperature = Options.of("linear_log_probs", LogProbsOptions, options)
    if not isinstance(return_entropy, bool):
        raise ValueError(f"return_entropy must be a bool, got {return_entropy!r}")
    x, labels, w, _ = validation.input_arrays(x, labels, w, None, settings.w_layout)
    temperature_tokens = None if temperature is None else validation.temperature_tokens(temperature, labels.shape)
    placement = find_placement(x, labels, w, settings.vocab_axis_name, settings.in_specs, settings.w_layout)
    return run_placed(_log_probs, x, labels, w, placement, temperature_tokens=temperature_tokens, options=settings,
                      return_entropy=return_entropy)


def _log_probs(x: jax.Array, labels: jax.Array, w: jax.Array, placement: Placement, *, weights: None,
               temperature_tokens: jax.Array | None, options: Options,
               return_entropy: bool) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`linear_log_probs` on validated arguments, run as ``placement`` says."""
    call = prepare(x, labels, w, placement, weights=weights, options=options, with_sum=False,
                   with_expected=return_entropy, temperature_tokens=temperature_tokens)
    stats = call.row_stats()
    logp = jnp.where(call.counted, stats.label - stats.lse, 0.0) + call.nan_if_bad
    if not return_entropy:
        return call.restore(logp)
    assert stats.expected is not None  # asked for with with_expected=True
    entropy = jnp.where(call.counted, stats.lse - stats.expected, 0.0) + call.nan_if_bad
    return call.restore(logp), call.restore(entropy)
