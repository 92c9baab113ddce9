"""A policy loss summed over tokens, with ``dx`` and ``dw`` formed in the forward pass.

RL objectives (GRPO, PPO, DAPO, ...) are sums over sampled tokens of a per-token function of the
token's log-probability, maybe the entropy of its distribution, and per-token data (old log-probs,
advantages, reference log-probs, aggregation weights). Written on top of
:func:`ce_core.linear_log_probs`, the loss's cotangents of ``logp`` and ``entropy`` reach the library
only in the backward pass, which must recompute the logits (8NHV of matmul work, plus the entropy's
second weighted pass). Here the per-token function is handed to the library instead::

    loss = sum_i [y_i != ignore_index] * token_fn(logp_i, entropy_i, inputs_i)

For a scalar loss every token's cotangent is known as soon as its statistics are, so the call is a
``jax.custom_vjp`` whose forward pass asks the backend for the statistics *and* ``dx``, ``dw``
(:meth:`ce_core.Backend.row_stats_and_grads`, chunk by chunk, with ``jax.grad`` of ``token_fn``
through ``logp = label - lse`` and ``entropy = lse - expected`` as the statistics' cotangents),
exactly as the cross-entropy loss does; the backward pass only scales them. On the pallas_tpu
backend with ``keep_logits=True`` that is 6NHV.

``token_fn`` is mapped over the tokens (``jax.vmap``: it sees one token's values, scalars), so its
result cannot depend on how a backend chunks the tokens; aggregation across tokens (a per-sequence
mean) is therefore expressed as per-token weights among the inputs, computed from the mask beforehand
(:func:`ce_core.policy.token_weights`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, Unpack, overload

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.typing import ArrayLike

from ce_core.api import validation
from ce_core.api.options import LogitOptions, Options, PlacementOptions
from ce_core.api.prepare import PreparedCall, prepare, run_placed
from ce_core.contract.backend import Backend, RowStats, StatsSpec
from ce_core.sharded import ops
from ce_core.sharded.placement import Placement, find_placement

#: ``token_fn(logp, entropy, inputs) -> loss`` of one token: float32 scalars ``logp`` and ``entropy``,
#: ``inputs`` the caller's pytree with each array replaced by that token's value.
TokenFn = Callable[[jax.Array, jax.Array, Any], jax.Array]


class TokenObjectiveOptions(LogitOptions, PlacementOptions, total=False):
    """The options of :func:`ce_core.linear_token_objective`: the logit and placement options, and ``keep_logits``.

    Attributes:
      keep_logits: how the backend forms the gradient, as for :func:`ce_core.linear_cross_entropy`
        (:class:`ce_core.LossTerms`): ``True`` keeps each token chunk's logits between the statistics and
        the gradient (6NHV, no recompute), ``False`` recomputes them (8NHV, least memory), ``None`` lets
        the backend's plan choose. Backends without a no-recompute path ignore it.
    """

    keep_logits: bool | None


@overload
def linear_token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = ...,
                           *, return_log_probs: Literal[False] = ..., return_entropy: Literal[False] = ...,
                           **options: Unpack[TokenObjectiveOptions]) -> jax.Array: ...


@overload
def linear_token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = ...,
                           *, return_log_probs: Literal[True], return_entropy: Literal[False] = ...,
                           **options: Unpack[TokenObjectiveOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def linear_token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = ...,
                           *, return_log_probs: Literal[False] = ..., return_entropy: Literal[True],
                           **options: Unpack[TokenObjectiveOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def linear_token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = ...,
                           *, return_log_probs: Literal[True], return_entropy: Literal[True],
                           **options: Unpack[TokenObjectiveOptions]) -> tuple[jax.Array, jax.Array, jax.Array]: ...


@overload
def linear_token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = ...,
                           *, return_log_probs: bool = ..., return_entropy: bool = ...,
                           **options: Unpack[TokenObjectiveOptions]) -> jax.Array | tuple[jax.Array, ...]: ...


def linear_token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = None,
                           *, return_log_probs: bool = False, return_entropy: bool = False,
                           **options: Unpack[TokenObjectiveOptions]) -> jax.Array | tuple[jax.Array, ...]:
    """``sum_i token_fn(logp_i, entropy_i, inputs_i)`` over the counted tokens, never materialising the logits.

    ``logp_i = log softmax(cap(x_i @ w) / T_i)[y_i]`` and ``entropy_i`` are those of
    :func:`ce_core.linear_log_probs`. The loss is a scalar, so the backend forms ``dx`` and ``dw`` in
    its forward pass (three matmul passes instead of four on backends that fuse; see the module
    docstring); that is why the per-token function is given to the call rather than applied to
    per-token outputs. A GRPO step::

        from ce_core import linear_token_objective
        from ce_core.policy import PolicyInputs, PolicyLoss, token_weights

        labels = jnp.where(mask, tokens, -100)                  # prompt and padding ignored
        inputs = PolicyInputs(old_logp=old_logp,                 # [B, T], from the sampler
                              advantages=advantages[:, None],    # [B, 1]: broadcast per token
                              weights=token_weights(mask, "sequence"),  # GRPO's per-sequence mean
                              ref_logp=ref_logp)
        loss = linear_token_objective(hidden, labels, head, PolicyLoss(kl_coefficient=0.04), inputs,
                                      temperature=0.9)

    Args:
      x: ``[..., H]`` hidden states (bf16, f16 or f32).
      labels: ``[...]`` integer token ids in ``[0, V)`` (the sampled tokens), or ``ignore_index``:
        such tokens contribute nothing, get no gradient, and ``token_fn``'s value there is discarded
        (even a NaN).
      w: ``[H, V]`` output projection, or ``[V, H]`` with ``w_layout="vh"``.
      token_fn: ``token_fn(logp, entropy, inputs) -> loss`` of one token. It is mapped over the tokens
        with ``jax.vmap``, so it sees float32 scalars ``logp`` and ``entropy`` and ``inputs`` shaped like
        ``token_inputs`` with each array replaced by the token's value, and must return one float
        (jnp arithmetic; any code written elementwise on arrays works unchanged). The entropy statistic
        is computed only when ``token_fn`` reads ``entropy`` (found by tracing it; otherwise it gets
        zeros) or ``return_entropy``. It must be hashable (a function, or a frozen dataclass such as
        :class:`ce_core.policy.PolicyLoss`: it is static, like the options) and must not close over
        traced arrays: pass those in ``token_inputs``.
      token_inputs: a pytree (``None``, a dict, a ``NamedTuple``, ...) of arrays broadcastable to the shape
        of ``labels`` (advantages per sequence as ``[B, 1]``); floating ones are used as float32. They
        are data: not differentiated (their gradient is zero, as under ``jax.lax.stop_gradient``).
        Aggregation over tokens belongs here as weights that ``token_fn`` multiplies by, computed
        from the mask beforehand (:func:`ce_core.policy.token_weights`): under a placement that splits
        the tokens they must be the global weights (from the whole batch's mask).
      return_log_probs: also return ``logp`` per token (float32, the shape of ``labels``, 0 where
        ignored; not differentiated): for metrics and the next step's old log-probs, at no cost.
      return_entropy: also return the entropy per token (as ``logp``; computes the statistic if
        ``token_fn`` does not read it).
      **options: keyword options (:class:`ce_core.TokenObjectiveOptions`): ``temperature=1.0`` (a number,
        or an array broadcastable to ``labels``; not differentiated), ``logit_soft_cap=None``,
        ``ignore_index=-100``, ``keep_logits=None``, ``implementation``, ``block_sizes``, ``precision``,
        ``w_layout``, ``vocab_axis_name`` and ``in_specs`` as for :func:`ce_core.linear_log_probs`,
        with every placement it supports.

    Returns:
      The float32 scalar loss; with ``return_log_probs`` or ``return_entropy`` a tuple: the loss, then
      ``logp`` if asked, then the entropy if asked. Gradients have the dtypes (and ``dw`` the layout)
      of ``x`` and ``w``.

    Raises:
      ValueError: a bad shape, dtype or option (the message names it), ``token_inputs`` not
        broadcastable to the labels, a ``token_fn`` that does not map one token's values to one
        float, or concrete labels outside ``[0, V)`` (under ``jit`` the loss is NaN instead).
      UnsupportedError: the named backend cannot run this call.
    """
    return token_objective(x, labels, w, token_fn, token_inputs, return_log_probs=return_log_probs,
                           return_entropy=return_entropy, **options)


def token_objective(x: ArrayLike, labels: ArrayLike, w: ArrayLike, token_fn: TokenFn, token_inputs: Any = None,
                    *, return_log_probs: bool = False, return_entropy: bool = False, label_and_lse: bool = False,
                    **options: Unpack[TokenObjectiveOptions]) -> jax.Array | tuple[jax.Array, ...]:
    """:func:`linear_token_objective`; with ``label_and_lse`` ``token_fn`` sees the label's logit and the lse
    (``token_fn(label, lse, inputs)``, no entropy) instead of ``logp`` and the entropy, so that a loss may
    weigh them apart (``ce_core.linear_distillation_loss``: the teacher's mass on the lse, the hard label's
    weight on the label) with no cancelling terms in its gradient."""
    settings, _, temperature = Options.of("linear_token_objective", TokenObjectiveOptions, options)
    for name, flag in (("return_log_probs", return_log_probs), ("return_entropy", return_entropy)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    x, labels, w, _ = validation.input_arrays(x, labels, w, None, settings.w_layout)
    temperature_tokens = None if temperature is None else validation.temperature_tokens(temperature, labels.shape)
    leaves, treedef = token_input_leaves(token_inputs, labels.shape)
    reads_entropy = not label_and_lse and inspect_token_fn(token_fn, leaves, treedef)
    placement = find_placement(x, labels, w, settings.vocab_axis_name, settings.in_specs, settings.w_layout)
    return run_placed(_objective, x, labels, w, placement, temperature_tokens=temperature_tokens, options=settings,
                      token_inputs=leaves, token_fn=token_fn, treedef=treedef,
                      with_entropy=reads_entropy or return_entropy, return_log_probs=return_log_probs,
                      return_entropy=return_entropy, label_and_lse=label_and_lse)


def token_input_leaves(token_inputs: Any, shape: tuple[int, ...]) -> tuple[tuple[jax.Array, ...], Any]:
    """The arrays of ``token_inputs`` broadcast to the labels' ``shape`` (floating ones as float32), and its treedef."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(token_inputs)
    out = []
    for path, leaf in leaves_with_paths:
        name = f"token_inputs{jax.tree_util.keystr(path)}"
        array = validation.as_array(leaf, name)
        if not (jnp.issubdtype(array.dtype, jnp.floating) or jnp.issubdtype(array.dtype, jnp.integer)
                or array.dtype == jnp.bool_):
            raise ValueError(f"{name} must be a real or boolean array, got dtype {array.dtype}")
        try:
            array = jnp.broadcast_to(array, shape)
        except ValueError:
            raise ValueError(f"{name} must be broadcastable to the shape of labels {shape}, "
                             f"got shape {array.shape}") from None
        out.append(array.astype(jnp.float32) if jnp.issubdtype(array.dtype, jnp.floating) else array)
    return tuple(out), treedef


def inspect_token_fn(token_fn: Any, leaves: tuple[jax.Array, ...], treedef: Any) -> bool:
    """Whether ``token_fn`` reads the entropy, checking that it maps one token's values to one float.

    ``token_fn`` is traced once on scalars (one token), as the call will map it over the tokens; a
    ``ValueError`` naming it when it fails there, returns something else, or closes over a tracer.
    """
    if not callable(token_fn):
        raise ValueError(f"token_fn must be callable, got {type(token_fn).__name__}")
    try:
        hash(token_fn)
    except TypeError:
        raise ValueError(f"token_fn must be hashable (a function, or a frozen dataclass), got {token_fn!r}") from None
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    inputs = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct((), leaf.dtype) for leaf in leaves])
    try:
        closed, out = jax.make_jaxpr(token_fn, return_shape=True)(scalar, scalar, inputs)
    except (TypeError, ValueError, IndexError) as error:
        raise ValueError(f"token_fn(logp, entropy, inputs) must compute one token's loss from that token's values "
                         f"(it is mapped over the tokens, so it sees scalars); calling it failed: {error}") from error
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(f"token_fn must return one float per token (a float scalar for one token's values), "
                         f"got {out}")
    if any(isinstance(const, Tracer) for const in closed.consts):
        raise ValueError("token_fn closes over a traced array; pass such per-token or step values in token_inputs")
    entropy = closed.jaxpr.invars[1]
    return (any(v is entropy for eqn in closed.jaxpr.eqns for v in eqn.invars)
            or any(v is entropy for v in closed.jaxpr.outvars))


def _objective(x: jax.Array, labels: jax.Array, w: jax.Array, placement: Placement, *, weights: None,
               temperature_tokens: jax.Array | None, options: Options, token_inputs: tuple[jax.Array, ...],
               token_fn: TokenFn, treedef: Any, with_entropy: bool, return_log_probs: bool,
               return_entropy: bool, label_and_lse: bool) -> jax.Array | tuple[jax.Array, ...]:
    """:func:`linear_token_objective` on validated arguments, run as ``placement`` says."""
    call = prepare(x, labels, w, placement, weights=weights, options=options, with_sum=False,
                   with_expected=with_entropy, temperature_tokens=temperature_tokens)
    counted = call.counted.astype(jnp.float32)
    params = (counted, *(_lay_out_tokens(call, leaf) for leaf in token_inputs))
    if call.labels.size == 0:  # nothing to stream over (as the loss does: no backend special case)
        empty = jnp.zeros(call.labels.shape, jnp.float32)
        loss, logp, entropy = jnp.zeros((), jnp.float32), empty, empty
    else:
        fused = _fused_objective(call.backend, call.spec, call.placement, token_fn, treedef, call.live is not None,
                                 label_and_lse)
        per_token = ops.per_token_args(call.row_scale, call.live)
        loss, logp, entropy = fused(call.x, call.w, call.labels, params, *per_token)
    outputs = [loss + jnp.sum(call.nan_if_bad)]
    for asked, values in ((return_log_probs, logp), (return_entropy, entropy)):
        if asked:
            assert values is not None  # the entropy is computed whenever it is returned
            per_token = jnp.where(call.counted, jax.lax.stop_gradient(values), 0.0) + call.nan_if_bad
            outputs.append(call.restore(per_token))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _lay_out_tokens(call: PreparedCall, values: jax.Array) -> jax.Array:
    """A per-token input laid out as ``prepare`` lays out the labels (flattened and padded where they are)."""
    if call.flat is not None:
        values = call.flat.tokens(values, 0)
    return call.placement.lay_out(values, "tokens")


def _mapped_over_tokens(token_fn: TokenFn, ndim: int) -> Callable[..., jax.Array]:
    """``token_fn`` applied to every token of ``ndim``-dimensional arrays (a ``vmap`` per dimension, no reshape)."""
    fn: Callable[..., jax.Array] = token_fn
    for _ in range(ndim):
        fn = jax.vmap(fn)
    return fn


@functools.lru_cache(maxsize=256)
def _fused_objective(backend: Backend, spec: StatsSpec, placement: Placement, token_fn: TokenFn, treedef: Any,
                     with_live: bool, label_and_lse: bool = False):
    """``(sum of the counted tokens' losses, logp, entropy or None)`` with a VJP formed in the forward pass.

    ``params`` is ``(counted, *input leaves)``, all per token. As in ``ce_core.api.loss._reduced_loss_fn``,
    the forward pass hands the backend ``cotangent_fn``: the gradient of the summed token losses with
    respect to a chunk's statistics (through ``logp = label - lse`` and ``entropy = lse - expected``),
    zero at ignored tokens whatever ``token_fn``'s derivative there. ``logp`` and the entropy are
    returned for the caller to detach; they take no cotangent. After ``params`` come the row scale
    (``spec.with_row_scale``) and the live mask (``with_live``: the counted tokens, which a backend may
    restrict its work to). With ``label_and_lse`` the two statistics ``token_fn`` sees are the label's logit
    and the lse themselves (each then takes its own cotangent).
    """
    with_entropy = spec.with_expected

    def split(per_token: tuple[jax.Array, ...]) -> tuple[jax.Array | None, jax.Array | None]:
        return ops.split_per_token(spec, with_live, per_token)

    def log_probs(stats: RowStats) -> tuple[jax.Array, jax.Array | None]:
        if label_and_lse:
            return stats.label, stats.lse
        logp = stats.label - stats.lse
        if not with_entropy:
            return logp, None
        assert stats.expected is not None  # asked for with with_expected=True
        return logp, stats.lse - stats.expected

    def token_losses(stats: RowStats, params: tuple[jax.Array, ...]) -> jax.Array:
        counted, *leaves = params
        logp, entropy = log_probs(stats)
        inputs = jax.tree.unflatten(treedef, leaves)
        per_token = _mapped_over_tokens(token_fn, logp.ndim)
        values = per_token(logp, jnp.zeros_like(logp) if entropy is None else entropy, inputs)
        return jnp.where(counted > 0, values.astype(jnp.float32), 0.0)

    def total(stats: RowStats, params: tuple[jax.Array, ...]) -> jax.Array:
        return jnp.sum(token_losses(stats, params))

    total_grad = jax.grad(total)

    def cotangent_fn(stats: RowStats, params: tuple[jax.Array, ...]) -> RowStats:
        cotangent = total_grad(stats._replace(max=None, argmax=None), params)
        counted = params[0] > 0
        return jax.tree.map(lambda c: jnp.where(counted, c, 0.0), cotangent)

    @jax.custom_vjp
    def objective(x, w, labels, params, *per_token):
        stats = ops.row_stats(backend, spec, placement, x, w, labels, *split(per_token))
        return (total(stats, params), *log_probs(stats))

    def forward(x, w, labels, params, *per_token):
        stats, dx, dw = ops.row_stats_and_grads(backend, spec, placement, cotangent_fn, x, w, labels, params,
                                                *split(per_token))
        return (total(stats, params), *log_probs(stats)), (dx, dw)

    def backward(residuals: Any, cotangents: Any):
        dx, dw = residuals
        g = cotangents[0]
        no_grads = (None,) * (spec.with_row_scale + with_live)
        return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None, *no_grads

    objective.defvjp(forward, backward)
    return objective
