"""Log-probabilities, entropies and temperature on every backend, against the float64 oracle."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ce_core import linear_cross_entropy, linear_log_probs
from ce_core.testing import TOLERANCES, Case, compare_with_oracle, log_probs_oracle, max_rel_error, random_problem

TEMPERATURES = (0.7, 1.0, 1.3)


def check_log_probs(backend, x, labels, w, *, dtype="float32", return_entropy=True, jit=True, fn=None, **options):
    """logp (and entropy) and the gradients of a random combination of them, against the oracle."""
    rng = np.random.default_rng(0)
    g_logp = rng.standard_normal(labels.shape).astype(np.float32)
    g_ent = (rng.standard_normal(labels.shape).astype(np.float32) if return_entropy
             else np.zeros(labels.shape, np.float32))
    fn = fn or functools.partial(linear_log_probs, implementation=backend)

    def objective(x_, w_):
        out = fn(x_, labels, w_, return_entropy=return_entropy, **options)
        if return_entropy:
            logp, entropy = out
        else:
            assert isinstance(out, jax.Array), type(out)
            logp, entropy = out, jnp.zeros_like(out)
        return jnp.sum(g_logp * logp + g_ent * entropy), (logp, entropy)

    grad_fn = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    (_, (logp, entropy)), (dx, dw) = (jax.jit(grad_fn) if jit else grad_fn)(xj, wj)
    expected = log_probs_oracle(np.asarray(xj, np.float32), labels, np.asarray(wj, np.float32),
                                logp_cotangent=g_logp, entropy_cotangent=g_ent, **options)
    assert logp.dtype == jnp.float32 and logp.shape == labels.shape
    assert dx.dtype == xj.dtype and dw.dtype == wj.dtype
    loss_tol, grad_tol = TOLERANCES[dtype]
    errors = {"logp": max_rel_error(logp, expected["logp"]), "dx": max_rel_error(dx, expected["dx"]),
              "dw": max_rel_error(dw, expected["dw"])}
    if return_entropy:
        errors["entropy"] = max_rel_error(entropy, expected["entropy"])
    for name, error in errors.items():
        assert error <= (loss_tol if name in ("logp", "entropy") else grad_tol), (name, errors)
    return logp, entropy


@pytest.mark.covering(temperature=TEMPERATURES, cap=(None, 2.0), dtype=("float32", "bfloat16"))
def test_log_probs_and_entropy(backend_name, temperature, cap, dtype):
    if dtype == "float32":
        x, labels, w = random_problem(0, (37,), 48, 203, ignore_fraction=0.2)  # ragged N and V
    else:
        x, labels, w = random_problem(1, (3, 11), 64, 130, ignore_fraction=0.2)
    check_log_probs(backend_name, x, labels, w, dtype=dtype, temperature=temperature, logit_soft_cap=cap)


@pytest.mark.cpu_rows_slow
def test_log_probs_alone_does_not_need_the_entropy_statistic(backend_name):
    x, labels, w = random_problem(2, (2, 9), 32, 77)
    check_log_probs(backend_name, x, labels, w, return_entropy=False, temperature=0.9)
    check_log_probs(backend_name, x, labels, w, return_entropy=True, jit=False)


@pytest.mark.cpu_rows_slow
def test_ignored_tokens_give_zero_and_get_no_gradient(backend_name):
    x, _, w = random_problem(3, (6,), 16, 40)
    labels = np.array([1, -100, 3, -100, 5, 7], np.int32)
    logp, entropy = linear_log_probs(x, labels, w, return_entropy=True, implementation=backend_name)
    assert not np.asarray(logp)[labels == -100].any() and not np.asarray(entropy)[labels == -100].any()
    dx = jax.grad(lambda x_: jnp.sum(jnp.stack(linear_log_probs(x_, labels, w, return_entropy=True,
                                                                  implementation=backend_name))))(x)
    assert not np.asarray(dx)[labels == -100].any() and np.asarray(dx)[labels != -100].all()


def test_out_of_vocab_labels(backend_name):
    x, labels, w = random_problem(4, (5,), 16, 20, ignore_fraction=0.0)
    labels[2] = 20
    with pytest.raises(ValueError, match=r"labels\[2\] = 20"):
        linear_log_probs(x, labels, w, implementation=backend_name)
    logp = jax.jit(lambda y: linear_log_probs(x, y, w, implementation=backend_name))(labels)
    assert np.isnan(np.asarray(logp)[2]) and np.isfinite(np.asarray(logp)[[0, 1, 3, 4]]).all()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_in_the_loss(backend_name, temperature):
    x, labels, w = random_problem(5, (29,), 32, 101)
    for reduction in ("mean", "none"):
        case = Case(reduction=reduction, use_weights=True, logsumexp_weight=1e-3, logit_soft_cap=2.0,
                    label_smoothing=0.1, temperature=temperature)
        compare_with_oracle(backend_name, case, x, labels, w)


def test_temperature_one_and_a_scaled_head_agree(backend_name):
    """Temperature T without a cap is the same as dividing w by T: an independent check of the scaling."""
    x, labels, w = random_problem(6, (17,), 24, 50)
    tempered = linear_log_probs(x, labels, w, temperature=0.5, return_entropy=True, implementation=backend_name)
    scaled = linear_log_probs(x, labels, w / 0.5, return_entropy=True, implementation=backend_name)
    for a, b in zip(tempered, scaled, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_temperature_is_a_clear_error(value):
    x, labels, w = random_problem(7, (4,), 8, 16)
    for fn in (linear_log_probs, linear_cross_entropy):
        with pytest.raises(ValueError, match=r"temperature must be"):
            fn(x, labels, w, temperature=value)


def test_bad_options_of_log_probs():
    x, labels, w = random_problem(8, (4,), 8, 16)
    not_a_bool: Any = "yes"  # what a caller without a type checker may pass
    with pytest.raises(ValueError, match="logit_soft_cap must be None or > 0"):
        linear_log_probs(x, labels, w, logit_soft_cap=0.0)
    with pytest.raises(ValueError, match="return_entropy must be a bool"):
        linear_log_probs(x, labels, w, return_entropy=not_a_bool)
    with pytest.raises(ValueError, match="labels must have shape"):
        linear_log_probs(x, labels[:3], w)


# --- vocab parallel ----------------------------------------------------------------------------


def mesh_devices(backend_name):
    """Devices for the mesh tests: 8, or 4 for pallas_tpu in interpret mode, as in
    tests/test_sharded_step.py (the race-checked TPU interpreter hangs on 8 simulated devices)."""
    if backend_name == "pallas_tpu" and os.environ.get("CE_PALLAS_TPU_INTERPRET"):
        return 4
    return 8


@pytest.mark.parametrize("mode", ["explicit", "auto", "auto_stated"])
def test_entropy_over_a_vocab_split_mesh_matches_the_unsharded_call(backend_name, mode):
    """Explicit axes, Auto axes with the default layout, and Auto axes with the caller's layout stated."""
    devices = mesh_devices(backend_name)
    axis_type = jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, devices // 2), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu")[:devices])
    x, labels, w = random_problem(9, (4, 6), 48, 320, ignore_fraction=0.2)
    specs = (P("data", None, None), P(None, "model")) if mode == "auto_stated" else None

    def sharded_fn(x_, y_, w_, **options):
        x_ = jax.device_put(x_, NamedSharding(mesh, P("data", None, None)))
        w_ = jax.device_put(w_, NamedSharding(mesh, P(None, "model")))
        return linear_log_probs(x_, y_, w_, implementation=backend_name, in_specs=specs, **options)

    with jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext():
        check_log_probs(backend_name, x, labels, w, fn=sharded_fn, temperature=0.8, logit_soft_cap=3.0)


def test_entropy_inside_a_users_shard_map_with_vocab_axis_name(backend_name):
    devices = mesh_devices(backend_name)
    mesh = jax.make_mesh((1, devices), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices("cpu")[:devices])
    x, labels, w = random_problem(10, (12,), 16, 80)

    def fn(x_, y_, w_, return_entropy, **options):
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(None, "model")), out_specs=(P(), P()))
        def per_shard(a, y, b):
            return linear_log_probs(a, y, b, vocab_axis_name="model", return_entropy=return_entropy,
                                    implementation=backend_name, **options)
        return per_shard(x_, y_, w_)

    check_log_probs(backend_name, x, labels, w, fn=fn, temperature=1.3)
