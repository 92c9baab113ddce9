"""Distillation losses between a student head and a teacher, without either head's ``[tokens, vocab]`` logits.

**A dense teacher** (``teacher_x``, ``teacher_w``): both heads stream through a contract-version-5 backend's pair
statistics (:mod:`ce_core.api.dense_teacher`): the forward KL, the reverse KL or the generalised JSD per token,
a scalar loss's gradient formed in the same pass. **A sparse teacher**: its top-k per token saved offline
(``teacher_indices`` and ``teacher_log_probs``, ``[..., k]``). The forward KL over those entries is, with
``a = cap(x @ w) / T``,

    ``D = sum_k q_k (log q_k - a_{i_k} + lse(a)) = sum_k q_k log q_k - sum_k q_k a_{i_k} + Q lse(a)``,

``Q = sum_k q_k``: the lse is what every backend already streams, and ``k`` logits per token are a gather.
So the loss is one student pass (:func:`ce_core.api.objective.token_objective` with a token function of
the label logit and the lse: ``Q lse``, plus the hard-label term ``lse - a_y`` at temperature 1; a scalar
reduction forms ``dx`` and ``dw`` in the forward pass on every backend) beside :func:`gathered_logits`,
token chunk by token chunk (``[chunk, k, H]`` of ``w`` at a time). No term of the gradient cancels another
(the design note's ``(sum_k q_k) p - q``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.typing import ArrayLike

from ce_core.api import validation
from ce_core.api.dense_teacher import PairRun, pair_backend, per_token_divergence, weighted_divergence
from ce_core.api.gathered import gathered_logits
from ce_core.api.loss import linear_cross_entropy
from ce_core.api.objective import token_objective
from ce_core.api.options import LogitOptions
from ce_core.contract.block_sizes import BlockSizes
from ce_core.contract.pair import PairSpec
from ce_core.sharded.placement import find_placement

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
UNCOUNTED = -1


def linear_distillation_loss(
    x: ArrayLike,
    w: ArrayLike,
    teacher_x: ArrayLike | None = None,
    teacher_w: ArrayLike | None = None,
    labels: ArrayLike | None = None,
    *,
    teacher_indices: ArrayLike | None = None,
    teacher_log_probs: ArrayLike | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float | ArrayLike = 1.0,
    hard_label_weight: float = 0.0,
    reduction: str = "mean",
    weights: ArrayLike | None = None,
    ignore_index: int = -100,
    logit_soft_cap: float | None = None,
    teacher_logit_soft_cap: float | None = None,
    vocab_size: int | None = None,
    w_layout: str = "hv",
    teacher_w_layout: str = "hv",
    implementation: str | Sequence[str] | None = None,
    block_sizes: BlockSizes | None = None,
    precision: str | jax.lax.Precision | None = None,
    keep_logits: bool | None = None,
) -> jax.Array:
    """A distillation loss of the student head ``a = cap(x @ w) / T`` against a teacher, never holding either
    head's logits.

    A dense teacher is ``teacher_x`` and ``teacher_w`` (logits ``b = cap_t(teacher_x @ teacher_w) / T``), compared
    by ``divergence``: ``"forward_kl"`` is ``KL(q || p)``, ``"reverse_kl"`` is ``KL(p || q)``, ``"jsd"`` is
    ``beta KL(q || m) + (1 - beta) KL(p || m)`` with ``m = beta q + (1 - beta) p`` (``beta`` 0 and 1 are taken as
    the forward and the reverse KL, as TRL and Liger do); ``p = softmax(a)``, ``q = softmax(b)``. It runs on a
    backend of contract version 5 (``reference``, ``xla``; older ones are refused by name) and every placement
    of the student's loss (its mesh splits the teacher's tokens and vocabulary alike). The teacher takes no
    gradient (zeros).

    A sparse teacher is its top-k per token saved offline (``teacher_indices`` and
    ``teacher_log_probs``): the loss per token is then the forward KL over those entries,
    ``sum_k q_k (log q_k - log p_{i_k})`` with ``q_k = exp(teacher_log_probs_k)`` and the student's
    ``log p`` over its whole vocabulary. The teacher's mass outside its ``k`` entries counts for nothing
    (nothing is renormalised: ``k = V`` entries give the forward KL exactly), ``T`` scales the student
    only (the log-probs are the teacher's as saved), and an entry whose log-prob is ``-inf`` is padding
    (its index must still be in ``[0, V)``).

    ``hard_label_weight`` adds that multiple of the student's cross-entropy on ``labels`` at temperature 1
    (a second pass over the student's head unless ``temperature`` is the number 1). There is no ``T**2``
    factor. Tokens count where ``labels != ignore_index`` (every token when ``labels`` is None); their
    per-token losses are weighted by ``weights`` and reduced like :func:`ce_core.linear_cross_entropy`'s
    (``"mean"`` divides by the counted tokens' weight, 0 when there are none). Only the student is
    differentiated; the teacher's arrays are data.

    Args:
      x: ``[..., H]`` the student's hidden states.
      w: ``[H, V]`` the student's head, or ``[V, H]`` with ``w_layout="vh"`` (a tied embedding).
      teacher_x: ``[..., Ht]`` a dense teacher's hidden states (x's tokens).
      teacher_w: ``[Ht, V]`` its head, or ``[V, Ht]`` with ``teacher_w_layout="vh"``.
      labels: ``[...]`` token ids or ``ignore_index`` (which tokens count; the hard-label term's targets),
        or None (every token counts).
      teacher_indices: ``[..., k]`` integer vocabulary ids of the teacher's entries, in ``[0, V)``.
      teacher_log_probs: ``[..., k]`` the teacher's log-probabilities of those entries (``-inf``: padding).
      divergence: ``"forward_kl"`` (``KL(teacher || student)``, the only one a sparse teacher takes),
        ``"reverse_kl"`` or ``"jsd"`` (a dense teacher).
      beta: the generalised JSD's mixing weight, in ``[0, 1]``.
      temperature: ``T > 0``, a number or an array broadcastable to the tokens (not differentiated).
      hard_label_weight: the weight of the cross-entropy on ``labels`` (needs ``labels``).
      reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token losses, the tokens' shape, 0 where ignored).
      weights: ``[...]`` per-token weights.
      ignore_index: the label of tokens that count for nothing.
      logit_soft_cap: the student's soft cap ``c * tanh(z / c)``, before the temperature.
      teacher_logit_soft_cap: a dense teacher's soft cap, before the temperature.
      vocab_size: keep the first ``vocab_size`` vocabulary entries of the heads (a padded table; sliced, a
        copy). Without it a dense teacher's vocabulary must equal the student's.
      w_layout: ``"hv"`` or ``"vh"``, as for :func:`ce_core.linear_cross_entropy`.
      teacher_w_layout: a dense teacher's head layout, ``"hv"`` or ``"vh"``.
      implementation, block_sizes, precision, keep_logits: as for :func:`ce_core.linear_cross_entropy`
        (the student's statistics run on that backend; a scalar reduction forms the gradient in the
        forward pass where the backend does). A dense teacher's pair uses ``implementation`` and
        ``precision``; its tiles are the backend's own.

    Returns:
      The float32 loss: a scalar, or per token with ``reduction="none"``.

    Raises:
      ValueError: a bad shape or option (the message names it).
      UnsupportedError: no backend in ``implementation`` can run the call (a dense teacher needs version 5).
    """
    dense = teacher_x is not None or teacher_w is not None
    sparse = teacher_indices is not None or teacher_log_probs is not None
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if dense and sparse:
        raise ValueError("give either a dense teacher (teacher_x, teacher_w) or a sparse one (teacher_indices, "
                         "teacher_log_probs), not both")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    hard = validation.check_number("hard_label_weight", hard_label_weight)
    if hard < 0:
        raise ValueError(f"hard_label_weight must be >= 0, got {hard_label_weight}")
    if hard and labels is None:
        raise ValueError("hard_label_weight needs labels")
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    vocab_axis = validation.vocab_dim(validation.check_w_layout(w_layout))
    tokens = x.shape[:-1]
    teacher_head = None
    if dense:
        if teacher_x is None or teacher_w is None:
            raise ValueError("a dense teacher needs both teacher_x and teacher_w")
        teacher_head = jnp.asarray(teacher_w)
        vocab = _shared_vocab(w, vocab_axis, teacher_head, validation.vocab_dim(validation.check_w_layout(
            teacher_w_layout, "teacher_w_layout")), vocab_size)
    elif not sparse:
        raise ValueError("a distillation loss needs a teacher: teacher_x and teacher_w (dense), or "
                         "teacher_indices and teacher_log_probs (its top-k)")
    elif teacher_indices is None or teacher_log_probs is None:
        raise ValueError("a sparse teacher needs both teacher_indices and teacher_log_probs")
    else:
        if divergence != "forward_kl":
            raise ValueError(f"a sparse teacher takes divergence='forward_kl' only, got {divergence!r}")
        vocab = w.shape[vocab_axis] if vocab_size is None else vocab_size
    w = _first_entries(w, vocab_size, vocab_axis)
    counted, token_weight = _counted_tokens(labels, weights, tokens, ignore_index, vocab)
    if teacher_head is not None:
        return _dense_loss(x, w, jnp.asarray(teacher_x), _first_entries(teacher_head, vocab_size, validation.vocab_dim(
            teacher_w_layout)), labels, counted, token_weight, divergence=divergence, beta=beta,
            temperature=temperature, hard=hard, reduction=reduction, logit_soft_cap=logit_soft_cap,
            teacher_logit_soft_cap=teacher_logit_soft_cap, w_layout=w_layout, teacher_w_layout=teacher_w_layout,
            implementation=implementation, block_sizes=block_sizes, precision=precision, keep_logits=keep_logits)
    indices = jnp.asarray(teacher_indices)
    log_q = jnp.asarray(teacher_log_probs)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"teacher_indices must be integer vocabulary ids, got dtype {indices.dtype}")
    if indices.ndim < 1 or indices.shape[:-1] != tokens or log_q.shape != indices.shape:
        raise ValueError(f"teacher_indices and teacher_log_probs must both be [..., k] over x's tokens {tokens}, "
                         f"got {indices.shape} and {log_q.shape}")
    _check_concrete_indices(indices, w.shape[vocab_axis])

    # The student's calls mark uncounted tokens -1, whatever ignore_index is; without labels any id will do
    # (the label logit is then weighed 0).
    target = indices[..., 0] if labels is None else labels
    target = jnp.where(counted, target, UNCOUNTED).astype(jnp.int32)
    log_q = jax.lax.stop_gradient(log_q.astype(jnp.float32))
    q = jnp.exp(log_q)
    teacher_term = jnp.sum(jnp.where(q > 0, q * log_q, 0.0), axis=-1)  # padding (q = 0) adds 0
    mass = jnp.sum(q, axis=-1)
    # At temperature 1 the hard label's cross-entropy (lse - a_y) comes from the same pass as Q lse.
    one_pass = isinstance(temperature, (int, float)) and float(temperature) == 1.0
    hard_in_pass = hard if one_pass else 0.0

    student = LogitOptions(logit_soft_cap=logit_soft_cap, ignore_index=UNCOUNTED, implementation=implementation,
                           block_sizes=block_sizes, precision=precision, w_layout=w_layout)
    tempered = LogitOptions(student, temperature=temperature)
    scale = 1.0 / jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), tokens)
    x = jnp.where(counted[..., None], x, jnp.zeros((), x.dtype))  # garbage at ignored rows reaches nothing
    placement = find_placement(x, target, w, None, None, w_layout)  # where the student's pass runs too
    picked = gathered_logits(x, w, indices.astype(jnp.int32), scale, logit_soft_cap, w_layout, placement)
    vocab = w.shape[vocab_axis]
    out_of_range = jnp.any((indices < 0) | (indices >= vocab), axis=-1)  # traced ids: NaN, never clipped
    gathered_term = jnp.where(out_of_range, jnp.nan, teacher_term - jnp.sum(q * picked, axis=-1))
    rest = jnp.where(counted, gathered_term, 0.0)

    if reduction == "none":
        ce, lse = linear_cross_entropy(x, target, w, reduction="none", return_lse=True, **tempered)
        per_token = rest + mass * lse + hard_in_pass * ce
        if hard and not one_pass:
            per_token = per_token + hard * linear_cross_entropy(x, target, w, reduction="none", **student)
        return jnp.where(counted, token_weight * per_token, 0.0)

    coefficients = (token_weight * mass, token_weight * hard_in_pass)
    total = jnp.sum(token_weight * rest)
    student_pass = token_objective(x, target, w, _teacher_mass_and_hard_label, coefficients, label_and_lse=True,
                                   keep_logits=keep_logits, **tempered)
    assert not isinstance(student_pass, tuple)  # nothing but the loss asked for
    total = total + student_pass
    if hard and not one_pass:
        total = total + hard * linear_cross_entropy(x, target, w, reduction="sum", weights=token_weight,
                                                    keep_logits=keep_logits, **student)
    if reduction == "sum":
        return total
    norm = jnp.sum(token_weight)
    return total / jnp.where(norm != 0, norm, 1.0)


def _dense_loss(x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array, labels: ArrayLike | None,
                counted: jax.Array, token_weight: jax.Array, *, divergence: str, beta: float,
                temperature: float | ArrayLike, hard: float, reduction: str, logit_soft_cap: float | None,
                teacher_logit_soft_cap: float | None, w_layout: str, teacher_w_layout: str,
                implementation: str | Sequence[str] | None, block_sizes: BlockSizes | None,
                precision: str | jax.lax.Precision | None, keep_logits: bool | None) -> jax.Array:
    """The loss against a dense teacher: both heads streamed by a contract-version-5 backend."""
    tokens = x.shape[:-1]
    if teacher_x.shape[:-1] != tokens:
        raise ValueError(f"teacher_x must be [..., Ht] over x's tokens {tokens}, got {teacher_x.shape}")
    beta = validation.check_number("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if divergence == "jsd" and beta in (0.0, 1.0):  # the ends are the KLs, as TRL and Liger take them
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    validation.check_soft_cap(logit_soft_cap)
    validation.check_soft_cap(teacher_logit_soft_cap, name="teacher_logit_soft_cap")
    spec = PairSpec(divergence, beta if divergence == "jsd" else 0.5,
                    None if logit_soft_cap is None else float(logit_soft_cap),
                    None if teacher_logit_soft_cap is None else float(teacher_logit_soft_cap),
                    w_layout, teacher_w_layout, validation.check_precision(precision))
    if validation.is_static_number(temperature):
        validation.check_temperature(temperature)
        t = jnp.full(tokens, float(temperature), jnp.float32)  # type: ignore[arg-type]
    else:
        t = jax.lax.stop_gradient(validation.temperature_tokens(temperature, tokens))
    good = jnp.isfinite(t) & (t > 0)
    bad_temperature = counted & ~good  # traced values: NaN for those tokens, never clamped
    row_scale = jnp.where(counted & good, 1.0 / jnp.where(good, t, 1.0), 1.0)
    # Uncounted rows (padding may be garbage) are zeros: uniform logits, a divergence of 0, no gradient.
    zero_rows = lambda rows: jnp.where(counted[..., None], rows, jnp.zeros((), rows.dtype))  # noqa: E731
    rows, teacher_rows = zero_rows(x), zero_rows(teacher_x)
    placement = find_placement(x, counted, w, None, None, w_layout)
    run = PairRun(pair_backend(implementation, placement, x, w, spec), spec, placement)
    nan_if_bad = jnp.where(bad_temperature, jnp.nan, 0.0)
    student = LogitOptions(logit_soft_cap=logit_soft_cap, ignore_index=UNCOUNTED, implementation=implementation,
                           block_sizes=block_sizes, precision=precision, w_layout=w_layout)
    # The hard label's targets (it needs labels); without labels, any id (nothing reads it).
    target = jnp.where(counted, 0 if labels is None else jnp.asarray(labels), UNCOUNTED).astype(jnp.int32)
    if reduction == "none":
        per_token = per_token_divergence(run, rows, w, teacher_rows, teacher_w, row_scale, counted) + nan_if_bad
        if hard:
            per_token = per_token + hard * linear_cross_entropy(x, target, w, reduction="none", **student)
        return jnp.where(counted, token_weight * per_token, 0.0)
    norm = jnp.sum(token_weight) if reduction == "mean" else jnp.ones((), jnp.float32)
    norm = jnp.where(norm != 0, norm, 1.0)
    coefficient = jax.lax.stop_gradient(token_weight / norm)
    total = weighted_divergence(run, rows, w, teacher_rows, teacher_w, row_scale, counted, coefficient)
    total = total + jnp.sum(nan_if_bad)
    if hard:
        total = total + hard * linear_cross_entropy(x, target, w, reduction="sum", weights=token_weight / norm,
                                                    keep_logits=keep_logits, **student)
    return total


def _shared_vocab(w: jax.Array, vocab_axis: int, teacher_w: jax.Array, teacher_vocab_axis: int,
                  vocab_size: int | None) -> int:
    """The vocabulary both heads are compared over: ``vocab_size``, else theirs, which must then agree."""
    if teacher_w.ndim != 2:
        raise ValueError(f"teacher_w must be a 2-D head, got shape {teacher_w.shape}")
    student, teacher = w.shape[vocab_axis], teacher_w.shape[teacher_vocab_axis]
    if vocab_size is None:
        if student != teacher:
            raise ValueError(f"the student's vocabulary ({student}) and the teacher's ({teacher}) differ: pass "
                             "vocab_size= to keep the first entries of both (a padded table)")
        return student
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= min(student, teacher):
        raise ValueError(f"vocab_size must be an int in [1, {min(student, teacher)}] (both heads' vocabulary: "
                         f"student {student}, teacher {teacher}), got {vocab_size!r}")
    return vocab_size


def _counted_tokens(labels: ArrayLike | None, weights: ArrayLike | None, tokens: tuple[int, ...], ignore_index: int,
                    vocab: int) -> tuple[jax.Array, jax.Array]:
    """Which tokens count (``labels != ignore_index``; all without labels) and their float32 weights."""
    if labels is not None:
        labels = jnp.asarray(labels)
        if labels.shape != tokens:
            raise ValueError(f"labels must have x's token shape {tokens}, got {labels.shape}")
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise ValueError(f"labels must be an integer array of token ids, got dtype {labels.dtype}")
        # Checked here against the caller's ignore_index (the student's calls below mark ignored tokens -1).
        validation.check_concrete_labels(labels, vocab, ignore_index)
    counted = jnp.ones(tokens, bool) if labels is None else labels != ignore_index
    token_weight = counted.astype(jnp.float32)
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != tokens:
            raise ValueError(f"weights must have x's token shape {tokens}, got {weights.shape}")
        token_weight = token_weight * jax.lax.stop_gradient(weights.astype(jnp.float32))
    return counted, token_weight


def _teacher_mass_and_hard_label(label: jax.Array, lse: jax.Array, coefficients: tuple[jax.Array, jax.Array]
                                 ) -> jax.Array:
    """One token's ``Q lse + hard (lse - label)`` (each weighted), from the label logit and the lse."""
    mass, hard = coefficients
    return mass * lse + hard * (lse - label)


def _first_entries(w: jax.Array, vocab_size: int | None, vocab_axis: int) -> jax.Array:
    """``w`` cut to its first ``vocab_size`` vocabulary entries (all of them when None)."""
    if vocab_size is None:
        return w
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= w.shape[vocab_axis]:
        raise ValueError(f"vocab_size must be an int in [1, {w.shape[vocab_axis]}] (the head's vocabulary), "
                         f"got {vocab_size!r}")
    return jax.lax.slice_in_dim(w, 0, vocab_size, axis=vocab_axis)


def _check_concrete_indices(indices: jax.Array, vocab: int) -> None:
    """Concrete ``teacher_indices`` outside ``[0, vocab)`` are a ValueError; traced ones cannot be checked
    (their tokens' losses are NaN instead)."""
    if isinstance(indices, Tracer) or not indices.is_fully_addressable or not indices.size:
        return
    values = np.asarray(indices)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"teacher_indices must be in [0, {vocab}) (the student's vocabulary), got values in "
                         f"[{low}, {high}]")
