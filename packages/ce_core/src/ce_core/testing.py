"""A toolkit for checking backends: float64 oracles, random problems, and a parity check.

:func:`oracle` and :func:`log_probs_oracle` share no code with ce_core's loss: they materialise the
logits in float64 and apply the formulas of the README directly, so backends (and ce_core itself) can be
checked against them; :func:`distillation_oracle` does the same for a distillation loss between a
student head and a teacher head (:mod:`ce_core.distillation_oracle` states its conventions).
:func:`random_problem` draws inputs whose logits are of order 1, :func:`max_rel_error` compares, and
:func:`compare_with_oracle` runs a backend through the public loss with every option of a :class:`Case`
and asserts it matches the oracle (value, gradients, dtypes) within :data:`TOLERANCES`. A new backend's
test suite can be a loop over cases. :class:`CompileResult` and :func:`compile_program` time a compile
and read the memory it needs, which tests can bound exactly (``memory_analysis()`` is deterministic).
:func:`covering_array` turns a product of options into the few rows that still meet every pair of values
once.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ce_core.api.loss import linear_cross_entropy
from ce_core.contract.compiled import CompileResult, compile_program
from ce_core.distillation_oracle import distillation_oracle

__all__ = [
    "IGNORED_PATTERNS",
    "TOLERANCES",
    "Case",
    "CompileResult",
    "compare_with_oracle",
    "compile_program",
    "covering_array",
    "distillation_oracle",
    "ignored_labels",
    "log_probs_oracle",
    "max_rel_error",
    "oracle",
    "random_problem",
    "stats_oracle",
]


def oracle(
    x: Any,
    labels: Any,
    w: Any,
    *,
    reduction: str = "mean",
    weights: Any = None,
    ignore_index: int = -100,
    logsumexp_weight: float = 0.0,
    logit_soft_cap: float | None = None,
    label_smoothing: float = 0.0,
    temperature: Any = 1.0,
    cotangent: Any = None,
) -> dict[str, np.ndarray]:
    """Loss, per-token lse and the gradients ``dx``, ``dw``, ``dweights``, all float64.

    Gradients are of ``loss`` for scalar reductions, and of ``sum(cotangent * loss)`` for
    ``reduction="none"`` (``cotangent`` defaults to ones). The logits are ``cap(x @ w) / temperature``;
    ``temperature`` is a number or an array broadcastable to ``labels`` (one per token).
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    labels = np.asarray(labels)
    batch_shape, hidden = x.shape[:-1], x.shape[-1]
    vocab = w.shape[1]
    x2 = x.reshape(-1, hidden)
    y = labels.reshape(-1)
    n = y.shape[0]
    eps, lam = float(label_smoothing), float(logsumexp_weight)

    logits, cap_grad = _tempered_logits(x2, w, logit_soft_cap, _per_row(temperature, batch_shape))
    row_max = logits.max(axis=1)
    lse = row_max + np.log(np.exp(logits - row_max[:, None]).sum(axis=1))
    counted = y != ignore_index
    safe_y = np.where(counted, y, 0)
    label_logit = logits[np.arange(n), safe_y]
    per_token = (1 - eps) * (lse - label_logit) + eps * (lse - logits.mean(axis=1)) + lam * lse**2

    token_weight = counted.astype(np.float64)
    if weights is not None:
        token_weight = token_weight * np.asarray(weights, np.float64).reshape(-1)
    total = token_weight.sum()
    if reduction == "none":
        loss = (token_weight * per_token).reshape(batch_shape)
        ct = np.ones(n) if cotangent is None else np.asarray(cotangent, np.float64).reshape(-1)
        coefficient = ct * token_weight
        dweights = ct * counted * per_token
    elif reduction == "sum":
        loss = np.asarray((token_weight * per_token).sum())
        coefficient = token_weight
        dweights = counted * per_token
    elif reduction == "mean":
        norm = total if total != 0 else 1.0
        loss = np.asarray((token_weight * per_token).sum() / norm)
        coefficient = token_weight / norm
        # d/dweights_k of sum_i a_i l_i / sum_i a_i, with a_k = weights_k [y_k counted].
        dweights = counted * (per_token - loss) / norm if total != 0 else np.zeros(n)
    else:
        raise ValueError(f"unknown reduction {reduction!r}")

    softmax = np.exp(logits - lse[:, None])
    one_hot = np.zeros_like(logits)
    one_hot[np.arange(n), safe_y] = 1.0
    dlogits = (1 + 2 * lam * lse)[:, None] * softmax - (1 - eps) * one_hot - eps / vocab
    delta = coefficient[:, None] * dlogits * cap_grad
    return {
        "loss": loss,
        "lse": lse.reshape(batch_shape),
        "dx": (delta @ w.T).reshape(x.shape),
        "dw": x2.T @ delta,
        "dweights": dweights.reshape(batch_shape),
    }


def _per_row(temperature: Any, batch_shape: tuple[int, ...]) -> Any:
    """A number as it is; an array broadcast to the tokens and flattened to a ``[N, 1]`` column."""
    if np.ndim(temperature) == 0 and not isinstance(temperature, np.ndarray | jax.Array):
        return float(temperature)
    return np.broadcast_to(np.asarray(temperature, np.float64), batch_shape).reshape(-1, 1)


def _tempered_logits(x2: np.ndarray, w: np.ndarray, cap: float | None, temperature: Any):
    """``(z, dz/draw)`` for ``z = cap(x2 @ w) / temperature`` in float64 (a number or a ``[N, 1]`` column)."""
    raw = x2 @ w
    if cap is None:
        return raw / temperature, np.full_like(raw, 1.0 / temperature)
    t = np.tanh(raw / cap)
    return cap * t / temperature, (1.0 - t**2) / temperature


def stats_oracle(
    x: Any,
    w: Any,
    labels: Any,
    *,
    w_layout: str = "hv",
    logit_soft_cap: float | None = None,
    row_scale: Any = None,
    cotangent: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """The backend contract's row statistics and their VJP, from the definitions, in float64.

    ``x [N, H]``, ``w [H, V]`` (or ``[V, H]`` for ``w_layout="vh"``), int ``labels [N]`` (a label
    outside ``[0, V)`` has label logit 0); logits ``z_ij = s_i cap(x_i . w_j)`` with ``s = row_scale``
    (ones when ``None``). Returns ``lse``, ``label``, ``sum``, ``expected``, ``max``, ``argmax`` (the
    lowest index of the maximum) and, for ``cotangent`` (a dict with any of ``lse``, ``label``,
    ``sum``, ``expected``, each ``[N]``, missing ones 0), ``dx [N, H]`` and ``dw`` in ``w``'s layout.
    """
    x2 = np.asarray(x, np.float64)
    head = np.asarray(w, np.float64)
    if w_layout not in ("hv", "vh"):
        raise ValueError(f"w_layout must be 'hv' or 'vh', got {w_layout!r}")
    w_hv = head if w_layout == "hv" else head.T
    y = np.asarray(labels).reshape(-1)
    n, vocab = x2.shape[0], w_hv.shape[1]
    scale = np.ones(n) if row_scale is None else np.asarray(row_scale, np.float64).reshape(-1)
    capped, dcap = _tempered_logits(x2, w_hv, logit_soft_cap, 1.0)
    z = scale[:, None] * capped
    top = z.max(axis=1)
    lse = top + np.log(np.exp(z - top[:, None]).sum(axis=1))
    p = np.exp(z - lse[:, None])
    in_vocab = (y >= 0) & (y < vocab)
    safe_y = np.where(in_vocab, y, 0)
    expected = (p * z).sum(axis=1)
    result = {
        "lse": lse,
        "label": np.where(in_vocab, z[np.arange(n), safe_y], 0.0),
        "sum": z.sum(axis=1),
        "expected": expected,
        "max": top,
        "argmax": np.argmax(z, axis=1).astype(np.int32),
    }
    if cotangent is not None:
        g = {name: np.asarray(cotangent.get(name, np.zeros(n)), np.float64).reshape(-1, 1)
             for name in ("lse", "label", "sum", "expected")}
        one_hot = np.zeros_like(z)
        one_hot[np.arange(n)[in_vocab], safe_y[in_vocab]] = 1.0
        dz = (g["lse"] * p + g["label"] * one_hot + g["sum"]
              + g["expected"] * p * (1.0 + z - expected[:, None]))
        delta = dz * scale[:, None] * dcap
        result["dx"] = delta @ w_hv.T
        result["dw"] = x2.T @ delta if w_layout == "hv" else delta.T @ x2
    return result


def log_probs_oracle(
    x: Any,
    labels: Any,
    w: Any,
    *,
    temperature: Any = 1.0,
    logit_soft_cap: float | None = None,
    ignore_index: int = -100,
    logp_cotangent: Any = None,
    entropy_cotangent: Any = None,
) -> dict[str, np.ndarray]:
    """``logp``, ``entropy`` and the gradients ``dx``, ``dw`` of ``sum(g_logp logp + g_ent entropy)``, float64.

    From the definitions: ``p = softmax(z)``, ``logp_i = log p_{i, y_i}``, ``entropy_i = -sum_j p_ij log p_ij``
    (0 for ignored tokens), with ``dz`` of the entropy ``-p (log p + entropy)``. Cotangents default to ones.
    ``temperature`` is a number or an array broadcastable to ``labels``.
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    labels = np.asarray(labels)
    batch_shape, hidden = x.shape[:-1], x.shape[-1]
    x2, y = x.reshape(-1, hidden), labels.reshape(-1)
    n = y.shape[0]
    logits, dz_draw = _tempered_logits(x2, w, logit_soft_cap, _per_row(temperature, batch_shape))
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    p = np.exp(log_p)
    counted = y != ignore_index
    safe_y = np.where(counted, y, 0)
    logp = np.where(counted, log_p[np.arange(n), safe_y], 0.0)
    entropy = np.where(counted, -(p * log_p).sum(axis=1), 0.0)
    g_logp = np.ones(n) if logp_cotangent is None else np.asarray(logp_cotangent, np.float64).reshape(-1)
    g_ent = np.ones(n) if entropy_cotangent is None else np.asarray(entropy_cotangent, np.float64).reshape(-1)
    g_logp, g_ent = g_logp * counted, g_ent * counted
    one_hot = np.zeros_like(logits)
    one_hot[np.arange(n), safe_y] = 1.0
    dz = g_logp[:, None] * (one_hot - p) - g_ent[:, None] * p * (log_p + entropy[:, None])
    delta = dz * dz_draw
    return {
        "logp": logp.reshape(batch_shape),
        "entropy": entropy.reshape(batch_shape),
        "dx": (delta @ w.T).reshape(x.shape),
        "dw": x2.T @ delta,
    }


#: The ignored-token patterns :func:`ignored_labels` makes: what RL and completion-only batches hold.
IGNORED_PATTERNS = ("none", "all", "prompts", "padding", "random", "one")


def ignored_labels(pattern: str, shape: tuple[int, ...], vocab: int, *, seed: int = 0,
                   ignore_index: int = -100) -> np.ndarray:
    """Random int32 labels below ``vocab`` of ``shape`` (``[..., sequence]``), with the tokens ``pattern``
    names set to ``ignore_index``: ``"none"``; ``"all"``; ``"prompts"`` (each sequence's first third to two
    thirds, its own length); ``"padding"`` (each sequence's tail after a length of its own, at least 1);
    ``"random"`` (each token with probability 1/2); ``"one"`` (all but the flat token 17)."""
    if pattern not in IGNORED_PATTERNS:
        raise ValueError(f"pattern must be one of {IGNORED_PATTERNS}, got {pattern!r}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, vocab, shape).astype(np.int32)
    positions = np.arange(shape[-1])
    if pattern == "all":
        labels[...] = ignore_index
    elif pattern == "prompts":
        prompt = rng.integers(shape[-1] // 3, 2 * shape[-1] // 3, shape[:-1])
        labels[positions < prompt[..., None]] = ignore_index
    elif pattern == "padding":
        length = rng.integers(1, shape[-1], shape[:-1])
        labels[positions >= length[..., None]] = ignore_index
    elif pattern == "random":
        labels[rng.random(shape) < 0.5] = ignore_index
    elif pattern == "one":
        keep = labels.reshape(-1)[17]
        labels[...] = ignore_index
        labels.reshape(-1)[17] = keep
    return labels


def random_problem(
    seed: int,
    batch_shape: tuple[int, ...],
    hidden: int,
    vocab: int,
    *,
    dtype: Any = np.float32,
    ignore_fraction: float = 0.1,
    ignore_index: int = -100,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fresh ``x, labels, w`` whose logits have standard deviation about 1.

    ``dtype`` is applied by the caller for bf16 (NumPy has none): the arrays are float32 then.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*batch_shape, hidden)).astype(np.float32)
    w = (rng.standard_normal((hidden, vocab)) / np.sqrt(hidden)).astype(np.float32)
    labels = rng.integers(0, vocab, size=batch_shape)
    labels = np.where(rng.random(batch_shape) < ignore_fraction, ignore_index, labels).astype(np.int32)
    if np.dtype(dtype) != np.float32 and np.dtype(dtype).kind == "f":
        x, w = x.astype(dtype), w.astype(dtype)
    return x, labels, w


def max_rel_error(actual: Any, expected: Any, *, floor: float = 0.0) -> float:
    """``max|actual - expected| / max(max|expected|, floor)`` in float64.

    ``floor`` is the magnitude below which values count as zero: a quantity that is analytically
    0 comes out as rounding noise, which is only small relative to its natural scale. The error
    is absolute when the scale is 0.
    """
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {actual.shape} vs {expected.shape}")
    if expected.size == 0:
        return 0.0
    scale = max(float(np.abs(expected).max()), floor)
    error = np.abs(actual - expected).max()
    return float(error / scale) if scale > 0 else float(error)


TOLERANCES = {  # (loss, gradients), relative to the largest magnitude of the oracle's value
    "float32": (1e-5, 1e-4),
    "bfloat16": (2e-2, 2e-2),
    "float16": (5e-3, 5e-3),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One combination of the loss's options, for :func:`compare_with_oracle`."""

    reduction: str = "mean"
    use_weights: bool = False
    logsumexp_weight: float = 0.0
    logit_soft_cap: float | None = None
    label_smoothing: float = 0.0
    temperature: float = 1.0

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = dict(
            reduction=self.reduction,
            logsumexp_weight=self.logsumexp_weight,
            logit_soft_cap=self.logit_soft_cap,
            label_smoothing=self.label_smoothing,
        )
        if self.temperature != 1.0:
            options["temperature"] = self.temperature
        return options


def compare_with_oracle(
    backend: str,
    case: Case,
    x: np.ndarray,
    labels: np.ndarray,
    w: np.ndarray,
    *,
    dtype: str = "float32",
    seed: int = 0,
    block_sizes: Any = None,
    jit: bool = True,
    loss_fn: Callable[..., Any] | None = None,
) -> dict[str, float]:
    """Loss and gradients of ``backend`` vs the oracle; asserts tolerances and dtypes, returns errors.

    ``loss_fn`` is called like :func:`ce_core.linear_cross_entropy` (the default; for example a
    partial of :func:`ce_core.sharded_linear_cross_entropy` with its mesh).
    """
    loss_fn = linear_cross_entropy if loss_fn is None else loss_fn
    rng = np.random.default_rng(seed + 1)
    weights = rng.uniform(0.5, 2.0, labels.shape).astype(np.float32) if case.use_weights else None
    cotangent = rng.standard_normal(labels.shape).astype(np.float32) if case.reduction == "none" else None
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    options = case.options()

    def objective(x_, w_, weights_):
        loss = loss_fn(x_, labels, w_, weights=weights_, implementation=backend, block_sizes=block_sizes, **options)
        return (jnp.sum(loss * cotangent) if cotangent is not None else loss), loss

    grad_fn = jax.value_and_grad(objective, argnums=(0, 1, 2) if weights is not None else (0, 1), has_aux=True)
    if jit:
        grad_fn = jax.jit(grad_fn)
    (_, loss), grads = grad_fn(xj, wj, None if weights is None else jnp.asarray(weights))
    expected = oracle(np.asarray(xj.astype(jnp.float32)), labels, np.asarray(wj.astype(jnp.float32)),
                      weights=weights, cotangent=cotangent, **options)

    assert loss.dtype == jnp.float32, loss.dtype
    assert grads[0].dtype == xj.dtype and grads[1].dtype == wj.dtype, (grads[0].dtype, grads[1].dtype)
    assert grads[0].shape == x.shape and grads[1].shape == w.shape
    errors = {
        "loss": max_rel_error(loss, expected["loss"]),
        "dx": max_rel_error(grads[0].astype(jnp.float32), expected["dx"]),
        "dw": max_rel_error(grads[1].astype(jnp.float32), expected["dw"]),
    }
    if weights is not None:
        # d loss / d weights_k is (l_k - mean) / sum(a) for "mean": exactly 0 for a single token, so
        # measure it against its natural scale, a token's share of the loss, not against itself.
        scale = float(np.abs(expected["loss"]).max()) / max(1, labels.size)
        errors["dweights"] = max_rel_error(grads[2], expected["dweights"], floor=scale)
    loss_tol, grad_tol = TOLERANCES[dtype]
    for name, error in errors.items():
        tol = loss_tol if name == "loss" else grad_tol
        assert error <= tol, f"{backend} {case} {dtype}: {name} rel error {error:.3g} > {tol:g} ({errors})"
    return errors


def covering_array(factors: Mapping[str, Sequence[Any]], *,
                   require: Sequence[Sequence[str]] = ()) -> list[dict[str, Any]]:
    """Rows (one value per factor) in which every pair of values of any two factors meets at least once.

    A test over the full product of ``factors`` grows as the product of their sizes; these rows grow
    roughly as the product of the two largest, and still catch every fault that needs two options
    together. ``require`` names groups of factors whose full product must appear as well (for example
    ``("backend", "placement", "reduction")``, so every reduction runs on every backend in every
    placement). Deterministic: the same arguments give the same rows, in an order that puts the first
    value of every factor in the first row (greedy, in the manner of AETG, with ties broken by order).
    """
    names = list(factors)
    values = {name: list(options) for name, options in factors.items()}
    for name, options in values.items():
        if not options:
            raise ValueError(f"covering_array: factor {name!r} has no values")
    groups = [(name,) for name in names] + [tuple(pair) for pair in itertools.combinations(names, 2)]
    for group in require:
        unknown = [name for name in group if name not in values]
        if unknown:
            raise ValueError(f"covering_array: require names {unknown}, which are not factors: {names}")
        groups.append(tuple(group))
    # What must still be covered: (group, indices of its values), as index tuples.
    uncovered = {(group, combo) for group in groups
                 for combo in itertools.product(*(range(len(values[name])) for name in group))}

    def newly_covered(row: dict[str, int]) -> set[tuple[tuple[str, ...], tuple[int, ...]]]:
        return {(group, combo) for group, combo in uncovered
                if all(name in row for name in group) and tuple(row[name] for name in group) == combo}

    rows: list[dict[str, int]] = []
    while uncovered:
        group, combo = min(uncovered, key=lambda item: (-len(item[0]), names.index(item[0][0]), item))
        row = dict(zip(group, combo, strict=True))
        for name in names:
            if name not in row:
                row[name] = max(range(len(values[name])), key=lambda i, n=name: (len(newly_covered({**row, n: i})), -i))
        uncovered -= newly_covered(row)
        rows.append(row)
    return [{name: values[name][row[name]] for name in names} for row in rows]
