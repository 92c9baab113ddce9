"""The float64 oracle of a distillation loss between a student head and a teacher head (issue 42).

It materialises both heads' logits in float64 and applies the definitions below directly, sharing no
code with any backend, so the fused implementations can be checked against it. Conventions (the
README's distillation section will state the same):

- Logits: ``a = cap_s(x @ w) / T`` (student), ``b = cap_t(teacher_x @ teacher_w) / T`` (teacher), over
  the first ``vocab_size`` columns of both heads (default: both heads' vocabulary, which must agree);
  ``T`` is one number or one per token. ``p = softmax(a)``, ``q = softmax(b)``.
- ``"forward_kl"``: ``KL(q || p) = sum_j q_j (log q_j - log p_j)``: mass-covering, the usual distillation.
- ``"reverse_kl"``: ``KL(p || q)``: mode-seeking (on-policy distillation).
- ``"jsd"`` with ``0 < beta < 1``: ``beta KL(q || m) + (1 - beta) KL(p || m)``, ``m = beta q + (1 - beta) p``
  (the generalised JSD of GKD, TRL's convention); ``beta = 0`` is taken as the forward KL and ``beta = 1``
  as the reverse KL (as TRL and Liger do: the mixture's limit itself vanishes there).
- No ``T**2`` factor: scale the loss yourself if you want Hinton's.
- ``hard_label_weight`` adds that multiple of the usual cross-entropy of the student's logits at
  temperature 1 (``cap_s(x @ w)``) on ``labels``.
- A sparse teacher (``teacher_indices``/``teacher_log_probs [..., k]``, e.g. a teacher's top-k saved
  offline) replaces ``q`` by its ``k`` entries as given: ``D = sum_k q_k (log q_k - log p_{i_k})`` with
  ``q_k = exp(teacher_log_probs_k)``, the student's ``log p`` over its whole vocabulary; the teacher's
  mass outside the ``k`` entries counts for nothing (nothing is renormalised), and ``T`` scales the
  student only (the log-probs are the teacher's as saved). An entry with log-prob ``-inf`` is padding.
  With every entry (``k = V``) this is the forward KL exactly.
- Tokens count where ``labels != ignore_index`` (every token when ``labels`` is None); the per-token losses
  ``l_n = D_n + hard_label_weight * CE_n`` are reduced as ``linear_cross_entropy`` reduces its own:
  ``"mean"`` divides the weighted sum by the counted tokens' weight.

Gradients are the student's only (``dx``, ``dw``): the teacher is not differentiated.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def distillation_oracle(
    x: Any,
    w: Any,
    teacher_x: Any = None,
    teacher_w: Any = None,
    labels: Any = None,
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: Any = 1.0,
    hard_label_weight: float = 0.0,
    reduction: str = "mean",
    weights: Any = None,
    ignore_index: int = -100,
    logit_soft_cap: float | None = None,
    teacher_logit_soft_cap: float | None = None,
    vocab_size: int | None = None,
    teacher_indices: Any = None,
    teacher_log_probs: Any = None,
    cotangent: Any = None,
) -> dict[str, np.ndarray]:
    """Loss, the per-token divergence, and the student's ``dx``, ``dw`` (``w`` is ``[H, V]``), in float64.

    Gradients are of ``loss`` for scalar reductions and of ``sum(cotangent * loss)`` for ``"none"``.
    Either ``teacher_x`` and ``teacher_w`` (``[Ht, Vt]``), or ``teacher_indices`` and ``teacher_log_probs``.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    x = np.asarray(x, np.float64)
    batch_shape, hidden = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, hidden)
    n = x2.shape[0]
    w = np.asarray(w, np.float64)
    sparse = teacher_indices is not None
    v = vocab_size if vocab_size is not None else w.shape[1]
    w = w[:, :v]
    temperature_rows = _per_token(temperature, batch_shape)

    raw = x2 @ w
    capped, cap_grad = _capped(raw, logit_soft_cap)
    a = capped / temperature_rows
    log_p = a - _lse(a)[:, None]
    p = np.exp(log_p)

    if sparse:
        if divergence != "forward_kl":
            raise ValueError("a sparse teacher (teacher_indices) takes divergence='forward_kl' only")
        idx = np.asarray(teacher_indices).reshape(n, -1)
        log_q = np.asarray(teacher_log_probs, np.float64).reshape(n, -1)
        q = np.exp(log_q)
        picked = np.take_along_axis(log_p, idx, axis=1)
        per_token = np.sum(q * (np.where(q > 0, log_q, 0.0) - picked), axis=1)  # padding (q = 0) adds 0
        dense_q = np.zeros_like(p)
        np.add.at(dense_q, (np.repeat(np.arange(n), idx.shape[1]), idx.reshape(-1)), q.reshape(-1))
        d_a = q.sum(axis=1, keepdims=True) * p - dense_q
    else:
        tw = np.asarray(teacher_w, np.float64)
        if vocab_size is None and tw.shape[1] != v:
            raise ValueError(f"the student's vocabulary ({v}) and the teacher's ({tw.shape[1]}) differ: pass "
                             "vocab_size= to keep the first columns of both")
        tw = tw[:, :v]
        tx = np.asarray(teacher_x, np.float64).reshape(n, -1)
        b = _capped(tx @ tw, teacher_logit_soft_cap)[0] / temperature_rows
        log_q = b - _lse(b)[:, None]
        q = np.exp(log_q)
        per_token, d_a = _divergence(divergence, float(beta), p, log_p, q, log_q)

    counted = np.ones(n, bool) if labels is None else np.asarray(labels).reshape(-1) != ignore_index
    d_raw = d_a * cap_grad / temperature_rows
    if hard_label_weight:
        if labels is None:
            raise ValueError("hard_label_weight needs labels")
        y = np.where(counted, np.asarray(labels).reshape(-1), 0)
        log_s = capped - _lse(capped)[:, None]
        ce = -log_s[np.arange(n), y]
        one_hot = np.zeros_like(capped)
        one_hot[np.arange(n), y] = 1.0
        per_token = per_token + hard_label_weight * ce
        d_raw = d_raw + hard_label_weight * (np.exp(log_s) - one_hot) * cap_grad

    token_weight = counted.astype(np.float64)
    if weights is not None:
        token_weight = token_weight * np.asarray(weights, np.float64).reshape(-1)
    if reduction == "none":
        loss = (token_weight * per_token).reshape(batch_shape)
        scale = np.ones(n) if cotangent is None else np.asarray(cotangent, np.float64).reshape(-1)
        coefficient = token_weight * scale
    elif reduction == "sum":
        loss = np.asarray((token_weight * per_token).sum())
        coefficient = token_weight
    elif reduction == "mean":
        total = token_weight.sum()
        norm = total if total != 0 else 1.0
        loss = np.asarray((token_weight * per_token).sum() / norm)
        coefficient = token_weight / norm
    else:
        raise ValueError(f"unknown reduction {reduction!r}")
    delta = coefficient[:, None] * d_raw
    return {
        "loss": loss,
        "divergence": np.where(counted, per_token, 0.0).reshape(batch_shape),
        "dx": (delta @ w.T).reshape(x.shape),
        "dw": x2.T @ delta,
    }


def _divergence(name: str, beta: float, p, log_p, q, log_q) -> tuple[np.ndarray, np.ndarray]:
    """The per-token divergence and its gradient in the student's scaled logits ``a``."""
    if name == "jsd" and beta == 0.0:
        name = "forward_kl"
    if name == "jsd" and beta == 1.0:
        name = "reverse_kl"
    if name == "forward_kl":
        return np.sum(q * (log_q - log_p), axis=1), p - q
    if name == "reverse_kl":
        per_token = np.sum(p * (log_p - log_q), axis=1)
        return per_token, p * (log_p - log_q - per_token[:, None])
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    log_m = np.logaddexp(np.log(beta) + log_q, np.log1p(-beta) + log_p)
    per_token = beta * np.sum(q * (log_q - log_m), axis=1) + (1 - beta) * np.sum(p * (log_p - log_m), axis=1)
    # d/dp_j of the sum is (1 - beta) log(p_j / m_j); through the softmax: p_k (g_k - sum_j p_j g_j).
    g = (1 - beta) * (log_p - log_m)
    return per_token, p * (g - np.sum(p * g, axis=1, keepdims=True))


def _per_token(temperature: Any, batch_shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(np.asarray(temperature, np.float64), batch_shape).reshape(-1, 1)


def _capped(raw: np.ndarray, cap: float | None) -> tuple[np.ndarray, np.ndarray]:
    if cap is None:
        return raw, np.ones_like(raw)
    t = np.tanh(raw / cap)
    return cap * t, 1.0 - t**2


def _lse(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=1)
    return top + np.log(np.exp(z - top[:, None]).sum(axis=1))
