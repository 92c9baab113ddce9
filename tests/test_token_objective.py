"""linear_token_objective on every backend against a float64 oracle on materialised logits, and ce_core.policy."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ce_core
from ce_core import linear_log_probs, linear_token_objective
from ce_core.policy import PolicyInputs, PolicyLoss, clipped_surrogate, k3_kl, token_weights
from ce_core.testing import TOLERANCES, max_rel_error, random_problem

IGNORE = -100


def materialised(x: Any, labels: Any, w: Any, token_fn: Any, inputs: Any, *, temperature: Any = 1.0,
                 logit_soft_cap: float | None = None, w_layout: str = "hv") -> tuple[float, np.ndarray, np.ndarray]:
    """The oracle: ``(loss, dx, dw)`` in float64 from ``jax.nn.log_softmax`` of the full logits.

    ``token_fn`` is applied elementwise to the ``[...]`` arrays of logp, entropy and the inputs, and
    summed over the counted tokens.
    """
    with jax.enable_x64(True):
        labels = jnp.asarray(labels)
        counted = labels != IGNORE
        safe = jnp.where(counted, labels, 0)
        t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float64), labels.shape)[..., None]
        inputs64 = jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.float64), labels.shape), inputs)

        def loss(x_, w_):
            z = x_ @ (w_ if w_layout == "hv" else w_.T)
            if logit_soft_cap is not None:
                z = logit_soft_cap * jnp.tanh(z / logit_soft_cap)
            log_p = jax.nn.log_softmax(z / t, axis=-1)
            logp = jnp.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
            entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
            return jnp.sum(jnp.where(counted, token_fn(logp, entropy, inputs64), 0.0))

        x64, w64 = (jnp.asarray(np.asarray(a, np.float32), jnp.float64) for a in (x, w))
        value, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1))(x64, w64)
        return float(value), np.asarray(dx), np.asarray(dw)


def policy_problem(seed: int, batch_shape: tuple[int, int], hidden: int, vocab: int):
    """``x, labels, w`` and PolicyInputs whose ratios straddle the clip range (old log-probs near the current)."""
    x, labels, w = random_problem(seed, batch_shape, hidden, vocab, ignore_fraction=0.2)
    rng = np.random.default_rng(seed + 100)
    current = -np.log(vocab) + 0.3 * rng.standard_normal(batch_shape)
    inputs = PolicyInputs(
        old_logp=(current + 0.3 * rng.standard_normal(batch_shape)).astype(np.float32),
        advantages=rng.standard_normal((batch_shape[0], 1)).astype(np.float32),
        weights=token_weights(labels != IGNORE, "sequence"),
        ref_logp=(current + 0.1 * rng.standard_normal(batch_shape)).astype(np.float32),
    )
    return x, labels, w, inputs


def check(fn: Any, x: Any, labels: Any, w: Any, token_fn: Any, inputs: Any, *, dtype: str = "float32",
          **options: Any) -> None:
    """Value and ``dx``, ``dw`` of ``fn`` (a linear_token_objective call) against the float64 oracle."""
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    # The oracle first: dispatched behind an interpreted multi-device kernel still running (async dispatch),
    # its dozens of eager float64 ops fill the CPU device's in-flight slots and the interpreter's nested
    # executions wait on them, a deadlock (conftest.py, "interpreted kernels on a mesh").
    oracle_options = {k: v for k, v in options.items() if k in ("temperature", "logit_soft_cap", "w_layout")}
    expected, e_dx, e_dw = materialised(xj, labels, wj, token_fn, inputs, **oracle_options)
    value, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b: fn(a, labels, b, token_fn, inputs, **options),
                                                 argnums=(0, 1)))(xj, wj)
    assert value.dtype == jnp.float32 and value.shape == ()
    assert dx.dtype == xj.dtype and dw.dtype == wj.dtype and dw.shape == wj.shape
    value_tol, grad_tol = TOLERANCES[dtype]
    errors = {"loss": max_rel_error(value, expected), "dx": max_rel_error(dx.astype(jnp.float32), e_dx),
              "dw": max_rel_error(dw.astype(jnp.float32), e_dw)}
    assert errors["loss"] <= value_tol and max(errors["dx"], errors["dw"]) <= grad_tol, errors
    assert np.abs(e_dw).max() > 0


@pytest.mark.covering(temperature=("number", "per_token"), cap=(None, 2.0), w_layout=("hv", "vh"),
                      dtype=("float32", "bfloat16"))
def test_values_and_gradients_match_the_float64_oracle(backend_name, temperature, cap, w_layout, dtype):
    x, labels, w, inputs = policy_problem(0, (3, 11), 32, 203)  # ragged tokens and vocab, ignored tokens
    if w_layout == "vh":
        w = np.ascontiguousarray(w.T)
    temp: Any = 0.8 if temperature == "number" else np.linspace(0.6, 1.4, 33, dtype=np.float32).reshape(3, 11)
    # bf16 moves logp by ~1e-2: clipping at a kink would then differ from the oracle's, so it is off there.
    wide = dict(clip_low=10.0) if dtype == "bfloat16" else dict(clip_high=0.28)
    token_fn = PolicyLoss(kl_coefficient=0.05, entropy_coefficient=0.01, **wide)
    check(linear_token_objective, x, labels, w, token_fn, inputs, dtype=dtype, temperature=temp,
          logit_soft_cap=cap, w_layout=w_layout, implementation=backend_name)


def test_all_ignored_tokens_give_zero_and_zero_gradients(backend_name):
    x, _, w = random_problem(1, (2, 5), 16, 40)
    labels = np.full((2, 5), IGNORE, np.int32)

    def nan_where_ignored(logp, entropy, inputs):  # whatever token_fn gives at ignored tokens is discarded
        return jnp.log(inputs) * logp - entropy

    fn = jax.value_and_grad(lambda a, b: linear_token_objective(a, labels, b, nan_where_ignored, np.zeros((2, 5)),
                                                                implementation=backend_name), argnums=(0, 1))
    value, (dx, dw) = fn(x, w)
    assert float(value) == 0.0 and not np.asarray(dx).any() and not np.asarray(dw).any()


def test_the_fused_path_forms_the_gradients_in_the_forward_pass(backend_name, monkeypatch):
    """The backend's row_stats_and_grads runs (no separate backward pass), with the entropy only when read.

    ``keep_logits=True`` (pallas_tpu's 6NHV path; the other backends ignore it), checked against the oracle.
    """
    backend = ce_core.get_backend(backend_name)
    specs: list[ce_core.StatsSpec] = []
    fused = backend.row_stats_and_grads

    def recorded(x, w, labels, spec, *args, **kwargs):
        specs.append(spec)
        return fused(x, w, labels, spec, *args, **kwargs)

    def no_backward_pass(*args, **kwargs):
        raise AssertionError("row_stats_vjp ran: the gradient was not formed in the forward pass")

    monkeypatch.setattr(backend, "row_stats_and_grads", recorded)
    monkeypatch.setattr(backend, "row_stats_vjp", no_backward_pass)
    x, labels, w = random_problem(2, (13,), 16, 50)
    advantages = np.linspace(-1.0, 1.0, 13, dtype=np.float32)
    for token_fn, reads_entropy in ((lambda lp, ent, a: -a * lp, False),
                                    (lambda lp, ent, a: -a * lp - 0.1 * ent, True)):
        specs.clear()
        check(linear_token_objective, x, labels, w, token_fn, advantages, keep_logits=True,
              implementation=backend_name)
        assert [(spec.with_expected, spec.keep_logits) for spec in specs] == [(reads_entropy, True)]


def test_log_probs_and_entropy_come_back_detached():
    x, labels, w, inputs = policy_problem(3, (2, 7), 16, 60)
    token_fn = PolicyLoss()
    loss, logp, entropy = linear_token_objective(x, labels, w, token_fn, inputs, return_log_probs=True,
                                                 return_entropy=True, temperature=0.9, implementation="xla")
    e_logp, e_entropy = linear_log_probs(x, labels, w, return_entropy=True, temperature=0.9, implementation="xla")
    np.testing.assert_allclose(np.asarray(logp), np.asarray(e_logp), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(e_entropy), rtol=1e-6, atol=1e-6)
    assert loss.shape == () and logp.shape == labels.shape

    def with_metrics(b):
        value, lp = linear_token_objective(x, labels, b, token_fn, inputs, return_log_probs=True)
        return value + 100.0 * jnp.sum(lp)  # the extra outputs take no gradient

    plain = jax.grad(lambda b: linear_token_objective(x, labels, b, token_fn, inputs))(w)
    np.testing.assert_allclose(np.asarray(jax.grad(with_metrics)(w)), np.asarray(plain))


def test_bad_token_functions_and_inputs_are_clear_errors():
    x, labels, w = random_problem(4, (2, 6), 8, 16)
    with pytest.raises(ValueError, match="token_fn must return one float per token"):
        linear_token_objective(x, labels, w, lambda lp, ent, i: jnp.stack([lp, ent]))
    with pytest.raises(ValueError, match="token_fn must return one float per token"):
        linear_token_objective(x, labels, w, lambda lp, ent, i: (lp > 0).astype(jnp.int32))
    with pytest.raises(ValueError, match=r"token_fn\(logp, entropy, inputs\) must compute one token's loss"):
        linear_token_objective(x, labels, w, lambda lp, ent, i: lp * i[:, 0], np.ones((2, 6)))
    with pytest.raises(ValueError, match=r"token_inputs\['a'\] must be broadcastable to the shape of labels"):
        linear_token_objective(x, labels, w, lambda lp, ent, i: lp * i["a"], {"a": np.ones((3,))})
    with pytest.raises(ValueError, match="token_fn must be hashable"):
        linear_token_objective(x, labels, w, _Unhashable())
    with pytest.raises(ValueError, match="token_fn closes over a traced array"):
        jax.jit(lambda s: linear_token_objective(x, labels, w, lambda lp, ent, i: s * lp))(2.0)
    with pytest.raises(ValueError, match="got unexpected keyword argument"):
        linear_token_objective(x, labels, w, PolicyLoss(), reduction="sum")  # type: ignore[call-arg]


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __call__(self, logp, entropy, inputs):
        return logp


# --- a sharded placement ------------------------------------------------------------------------


@pytest.mark.cpu_rows_slow
def test_over_a_mesh_splitting_tokens_and_vocab_matches_the_oracle(backend_name):
    """Explicit axes: tokens over "data", the head's vocab over "model" (4 devices for interpreted pallas_tpu)."""
    devices = 4 if backend_name == "pallas_tpu" and os.environ.get("CE_PALLAS_TPU_INTERPRET") else 8
    mesh = jax.make_mesh((2, devices // 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu")[:devices])
    x, labels, w, inputs = policy_problem(5, (4, 6), 32, 320)

    def sharded(a, y, b, token_fn, token_inputs, **options):
        a = jax.device_put(a, NamedSharding(mesh, P("data", None, None)))
        b = jax.device_put(b, NamedSharding(mesh, P(None, "model")))
        return linear_token_objective(a, y, b, token_fn, token_inputs, implementation=backend_name, **options)

    with jax.set_mesh(mesh):
        check(sharded, x, labels, w, PolicyLoss(kl_coefficient=0.05, entropy_coefficient=0.01), inputs,
              temperature=0.8, logit_soft_cap=3.0)


# --- ce_core.policy -----------------------------------------------------------------------------


def test_policy_loss_is_the_written_formula():
    rng = np.random.default_rng(6)
    logp, old, ref, entropy = (rng.standard_normal(64) * 0.3 - 2.0 for _ in range(4))
    advantages, weights = rng.standard_normal(64), rng.random(64)
    loss = PolicyLoss(clip_low=0.2, clip_high=0.28, kl_coefficient=0.1, entropy_coefficient=0.01)
    got = loss(jnp.asarray(logp), jnp.asarray(entropy), PolicyInputs(old, advantages, weights, ref))
    ratio = np.exp(logp - old)
    surrogate = -np.minimum(ratio * advantages, np.clip(ratio, 0.8, 1.28) * advantages)
    kl = np.exp(ref - logp) - (ref - logp) - 1.0
    np.testing.assert_allclose(np.asarray(got), weights * (surrogate + 0.1 * kl - 0.01 * entropy), rtol=1e-5)
    assert (np.clip(ratio, 0.8, 1.28) != ratio).any()  # the clip really bites on both sides somewhere
    np.testing.assert_allclose(np.asarray(clipped_surrogate(jnp.asarray(logp), jnp.asarray(old),
                                                            jnp.asarray(advantages))),
                               -np.minimum(ratio * advantages, np.clip(ratio, 0.8, 1.2) * advantages), rtol=1e-5)
    assert float(jnp.min(k3_kl(jnp.asarray(logp), jnp.asarray(ref)))) >= 0.0
    with pytest.raises(ValueError, match=r"needs PolicyInputs\.ref_logp"):
        loss(jnp.asarray(logp), jnp.asarray(entropy), PolicyInputs(old, advantages, weights))


def test_token_weights_give_the_token_and_sequence_means():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    per_token = np.arange(12, dtype=np.float32).reshape(3, 4)
    token = np.asarray(token_weights(mask, "token"))
    sequence = np.asarray(token_weights(mask, "sequence"))
    np.testing.assert_allclose(np.sum(token * per_token), per_token[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(np.sum(sequence * per_token), (per_token[0, :3].mean() + per_token[1, 0] + 0.0) / 3,
                               rtol=1e-6)
    assert not np.asarray(token_weights(np.zeros((2, 3)), "token")).any()
    with pytest.raises(ValueError, match="level must be"):
        token_weights(mask, "batch")  # type: ignore[arg-type]
