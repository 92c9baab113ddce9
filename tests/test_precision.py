"""``precision`` reaches every product of the ``reference`` and ``xla`` backends, backward included.

On CPU a float32 product is exact whatever is asked, so the tests read the lowered program: on GPU
the default is TF32 and on TPU one bf16 pass, and ``precision="highest"`` is how a float32 user gets
full products there (docs/benchmarks.md, "Correctness on the GPU").
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import ce_core

N, H, V = 48, 32, 300


def _dot_precisions(fn, *args) -> list[str]:
    """The ``precision = [...]`` of every dot_general in the lowered ``value_and_grad`` of ``fn``."""
    text = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).as_text()
    found = re.findall(r"stablehlo\.dot_general[^\n]*?precision = \[(\w+), (\w+)\]", text)
    assert found, "no product found in the lowered program"
    return [f"{a},{b}" for a, b in found]


def _calls(backend: str, precision: str | None):
    labels = jnp.arange(N) % V

    def mean(x, w):
        return ce_core.linear_cross_entropy(x, labels, w, implementation=backend, precision=precision)

    def per_token(x, w):
        losses = ce_core.linear_cross_entropy(x, labels, w, implementation=backend, precision=precision,
                                              reduction="none")
        return jnp.sum(losses * jnp.linspace(0.5, 1.5, N))

    def log_probs(x, w):
        logp, entropy = ce_core.linear_log_probs(x, labels, w, return_entropy=True, implementation=backend,
                                                 precision=precision)
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    def tied(x, w):
        return ce_core.linear_cross_entropy(x, labels, w.T, w_layout="vh", implementation=backend,
                                            precision=precision, logit_soft_cap=30.0)

    return {"mean": mean, "per_token": per_token, "log_probs": log_probs, "tied": tied}


@pytest.mark.parametrize("backend", ["reference", "xla"])
@pytest.mark.parametrize("call", ["mean", "per_token", "log_probs", "tied"])
def test_highest_precision_reaches_every_product(backend, call):
    x = jax.random.normal(jax.random.key(0), (N, H), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (H, V), jnp.float32) / H**0.5
    assert set(_dot_precisions(_calls(backend, "highest")[call], x, w)) == {"HIGHEST,HIGHEST"}
    assert "HIGHEST,HIGHEST" not in _dot_precisions(_calls(backend, None)[call], x, w)


def test_highest_precision_reaches_the_vocab_outer_gradient_pass():
    """A bf16 head whose call asks to recompute the logits (``keep_logits=False``) takes the vocab-outer
    order (its own loops)."""
    x = jnp.ones((N, 64), jnp.bfloat16)
    w = jnp.ones((64, 270_000), jnp.bfloat16)
    report = ce_core.get_backend("xla").block_sizes_for(
        ce_core.Problem(N, 64, 270_000, x.dtype, w.dtype, ce_core.StatsSpec(keep_logits=False)))
    assert report is not None and report.details["gradient_order"] == "vocab_outer"
    labels = jnp.arange(N) % V

    def mean(x_, w_):
        return ce_core.linear_cross_entropy(x_, labels, w_, implementation="xla", precision="high", keep_logits=False)

    assert set(_dot_precisions(mean, x, w)) == {"HIGH,HIGH"}
