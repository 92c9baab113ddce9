"""Helpers that run a backend and the float64 oracle on the same inputs and compare them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ce_core import linear_cross_entropy
from ce_core.testing import max_rel_error, oracle

TOLERANCES = {  # (loss, gradients), relative to the largest magnitude of the oracle's value
    "float32": (1e-5, 1e-4),
    "bfloat16": (2e-2, 2e-2),
    "float16": (5e-3, 5e-3),
}


@dataclasses.dataclass(frozen=True)
class Case:
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
    loss_fn: Callable[..., Any] = linear_cross_entropy,
) -> dict[str, float]:
    """Loss and gradients of ``backend`` vs the oracle; asserts tolerances and dtypes, returns errors.

    ``loss_fn`` is called like :func:`ce_core.linear_cross_entropy` (for example a partial of
    :func:`ce_core.sharded_linear_cross_entropy` with its mesh).
    """
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
