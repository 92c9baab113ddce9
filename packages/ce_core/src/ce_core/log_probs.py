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

from collections.abc import Sequence
from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ce_core import validation
from ce_core.block_sizes import BlockSizes
from ce_core.placement import InSpecs, Placement, find_placement
from ce_core.prepare import prepare, run_placed


@overload
def linear_log_probs(
    x: ArrayLike,
    labels: ArrayLike,
    w: ArrayLike,
    *,
    temperature: float = ...,
    logit_soft_cap: float | None = ...,
    return_entropy: Literal[False] = ...,
    ignore_index: int = ...,
    implementation: str | Sequence[str] | None = ...,
    block_sizes: BlockSizes | None = ...,
    vocab_axis_name: str | None = ...,
    in_specs: InSpecs | None = ...,
    precision: str | jax.lax.Precision | None = ...,
) -> jax.Array: ...


@overload
def linear_log_probs(
    x: ArrayLike,
    labels: ArrayLike,
    w: ArrayLike,
    *,
    temperature: float = ...,
    logit_soft_cap: float | None = ...,
    return_entropy: Literal[True],
    ignore_index: int = ...,
    implementation: str | Sequence[str] | None = ...,
    block_sizes: BlockSizes | None = ...,
    vocab_axis_name: str | None = ...,
    in_specs: InSpecs | None = ...,
    precision: str | jax.lax.Precision | None = ...,
) -> tuple[jax.Array, jax.Array]: ...


@overload
def linear_log_probs(
    x: ArrayLike,
    labels: ArrayLike,
    w: ArrayLike,
    *,
    temperature: float = ...,
    logit_soft_cap: float | None = ...,
    return_entropy: bool = ...,
    ignore_index: int = ...,
    implementation: str | Sequence[str] | None = ...,
    block_sizes: BlockSizes | None = ...,
    vocab_axis_name: str | None = ...,
    in_specs: InSpecs | None = ...,
    precision: str | jax.lax.Precision | None = ...,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def linear_log_probs(
    x: ArrayLike,
    labels: ArrayLike,
    w: ArrayLike,
    *,
    temperature: float = 1.0,
    logit_soft_cap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    implementation: str | Sequence[str] | None = None,
    block_sizes: BlockSizes | None = None,
    vocab_axis_name: str | None = None,
    in_specs: InSpecs | None = None,
    precision: str | jax.lax.Precision | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probability of each label under ``softmax(cap(x @ w) / temperature)``, never materialising the logits.

    Args:
      x: ``[..., H]`` hidden states (bf16, f16 or f32).
      labels: ``[...]`` integer token ids in ``[0, V)`` (the sampled tokens), or ``ignore_index``.
      w: ``[H, V]`` output projection.
      temperature: ``T > 0``, the sampling temperature: the logits are ``cap(x . w) / T``.
      logit_soft_cap: ``c``: ``cap(z) = c * tanh(z / c)``, applied before the temperature.
      return_entropy: also return each token distribution's entropy (costs one more streamed
        statistic; off by default so plain log-probabilities pay nothing for it).
      ignore_index: label of tokens that count for nothing: their ``logp`` and entropy are 0, and
        they receive no gradient.
      implementation, block_sizes, vocab_axis_name, in_specs, precision: as for :func:`ce_core.linear_cross_entropy`;
        the call follows the shardings of its inputs the same way.

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
    x, labels, w, _ = validation.input_arrays(x, labels, w)
    validation.check_ignore_index(ignore_index)
    validation.check_soft_cap(logit_soft_cap)
    validation.check_temperature(temperature)
    validation.check_vocab_axis_name(vocab_axis_name)
    if not isinstance(return_entropy, bool):
        raise ValueError(f"return_entropy must be a bool, got {return_entropy!r}")
    return run_placed(_log_probs, x, labels, w, find_placement(x, labels, w, vocab_axis_name, in_specs),
                      ignore_index=ignore_index, logit_soft_cap=logit_soft_cap, temperature=temperature,
                      return_entropy=return_entropy, implementation=implementation, block_sizes=block_sizes,
                      precision=validation.check_precision(precision))


def _log_probs(x: jax.Array, labels: jax.Array, w: jax.Array, placement: Placement, *, ignore_index: int,
               logit_soft_cap: float | None, temperature: float, return_entropy: bool,
               implementation: str | Sequence[str] | None, block_sizes: BlockSizes | None,
               precision: str | None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`linear_log_probs` on validated arguments, run as ``placement`` says."""
    call = prepare(x, labels, w, placement, weights=None, ignore_index=ignore_index, logit_soft_cap=logit_soft_cap,
                   temperature=temperature, with_sum=False, with_expected=return_entropy,
                   implementation=implementation, block_sizes=block_sizes, precision=precision)
    stats = call.row_stats()
    logp = jnp.where(call.counted, stats.label - stats.lse, 0.0) + call.nan_if_bad
    if not return_entropy:
        return call.restore(logp)
    assert stats.expected is not None  # asked for with with_expected=True
    return call.restore(logp), call.restore(jnp.where(call.counted, stats.lse - stats.expected, 0.0))
