"""Issue 23's features (``w_layout="vh"``, ``return_argmax``, per-token temperature) on every placement.

Each case runs one feature combination through one placement (local; inside the caller's
``shard_map`` with ``vocab_axis_name``; Explicit axes; Auto axes with the default layout; Auto axes
with stated ``in_specs``; the ``sharded_linear_cross_entropy`` wrapper) on 8 simulated CPU devices,
and checks the loss, ``dx``, ``dw`` (in ``w``'s layout) and the argmax against the float64 oracle.
A backend still below contract version 3 is skipped (``skip_below_v3``), and picked up once it
declares version 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ce_core
from ce_core import UnsupportedError, linear_cross_entropy, linear_log_probs, sharded_linear_cross_entropy
from ce_core.testing import log_probs_oracle, max_rel_error, oracle, random_problem

#: 8 simulated devices: interpreted pallas_tpu is left out here (tests/conftest.py).
EIGHT_DEVICE_MESHES = True

PLACEMENTS = ("local", "shard_map", "explicit", "auto_default", "auto_stated", "wrapper")
B, S, H, V = 4, 6, 16, 64


@contextlib.contextmanager
def skip_below_v3(backend: str):
    """Skip (only) when the registry refuses ``backend`` for its contract version."""
    try:
        yield
    except UnsupportedError as error:
        if "contract version" in str(error):
            pytest.skip(f"{backend} is below contract version 3: {error}")
        raise


@dataclasses.dataclass(frozen=True)
class Feature:
    """One combination of the new features (and the paths they take)."""

    layout: str = "vh"
    cap: float | None = None
    temperature: str = "token"  # "scalar", "token" ([B, S]) or "sequence" ([B, 1])
    reduction: str = "sum"
    argmax: bool = True
    lse: bool = False

    def __str__(self) -> str:
        return f"{self.layout}-cap{self.cap}-T{self.temperature}-{self.reduction}{'-lse' if self.lse else ''}"


FEATURES = [
    Feature(),  # x rows scaled by 1/T_i, fused reduced path with argmax
    Feature(cap=2.0, temperature="sequence", reduction="none", lse=True),  # row_scale, per-token path
    Feature(layout="hv", cap=2.0, temperature="token"),  # row_scale on the fused path
    Feature(cap=3.0, temperature="scalar", reduction="mean"),
]


def temperature_of(feature: Feature, seed: int = 3) -> Any:
    rng = np.random.default_rng(seed)
    if feature.temperature == "scalar":
        return 0.7
    shape = (B, S) if feature.temperature == "token" else (B, 1)
    return rng.uniform(0.5, 2.0, shape).astype(np.float32)


def expected_argmax(x, labels, w_hv, cap, temperature, ignore_index=-100):
    """float64 argmax of the final logits, -1 for ignored tokens."""
    z = np.asarray(x, np.float64) @ np.asarray(w_hv, np.float64)
    if cap is not None:
        z = cap * np.tanh(z / cap)
    z = z / np.broadcast_to(np.asarray(temperature, np.float64), labels.shape)[..., None]
    return np.where(labels != ignore_index, np.argmax(z, -1), -1)


def make_mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2, devices=jax.devices("cpu")[:8])


def w_spec(layout: str) -> P:
    """``w`` split on its vocab dimension over "model" (tensor/vocab parallel)."""
    return P(None, "model") if layout == "hv" else P("model", None)


def run_placement(placement: str, backend: str, feature: Feature, x, labels, w, temperature, cotangent):
    """``(objective, outputs), (dx, dw)`` of one call placed as ``placement`` says."""
    options: dict[str, Any] = dict(implementation=backend, w_layout=feature.layout, logit_soft_cap=feature.cap,
                                   return_argmax=feature.argmax, return_lse=feature.lse)
    t_static = isinstance(temperature, float)
    t_arg = None if t_static else jnp.asarray(temperature)
    if t_static:
        options["temperature"] = temperature

    def objective_of(outputs):
        loss = outputs[0] if isinstance(outputs, tuple) else outputs
        value = jnp.sum(loss * cotangent) if feature.reduction == "none" else loss
        return value, outputs

    def with_t(t):
        return {} if t_static else {"temperature": t}

    if placement == "shard_map":
        # Inside the caller's own shard_map: tokens split over "data", w's vocab dim over "model".
        mesh = make_mesh()
        reduction = "sum" if feature.reduction != "none" else "none"

        def body(x_, l_, w_, t_):
            out = linear_cross_entropy(x_, l_, w_, vocab_axis_name="model", reduction=reduction, **options,
                                       **with_t(t_))
            if reduction == "sum":
                out = (jax.lax.psum(out[0], "data"), *out[1:]) if isinstance(out, tuple) else jax.lax.psum(out, "data")
            return out

        n_out = 1 + feature.lse + feature.argmax
        loss_spec = P() if reduction == "sum" else P("data")
        out_specs = loss_spec if n_out == 1 else (loss_spec,) + (P("data"),) * (n_out - 1)
        t_spec = P("data") if t_arg is None or t_arg.shape[1] > 1 else P("data", None)
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), w_spec(feature.layout), t_spec),
                               out_specs=out_specs)

        def fn(x_, w_):
            t_ = jnp.ones((B, S)) if t_arg is None else t_arg
            return objective_of(mapped(x_, labels, w_, t_))

        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
        return step(jax.device_put(x, NamedSharding(mesh, P("data"))),
                    jax.device_put(w, NamedSharding(mesh, w_spec(feature.layout))))

    reduction = feature.reduction
    if placement == "local":
        def fn(x_, w_, t_):
            return objective_of(linear_cross_entropy(x_, labels, w_, reduction=reduction, **options, **with_t(t_)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(x, w, t_arg)

    if placement == "wrapper":
        mesh = make_mesh()

        def fn(x_, w_, t_):
            return objective_of(sharded_linear_cross_entropy(x_, labels, w_, mesh=mesh, batch_axes="data",
                                                             vocab_axis="model", reduction=reduction, **options,
                                                             **with_t(t_)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(x, w, t_arg)

    explicit = placement == "explicit"
    mesh = make_mesh(AxisType.Explicit if explicit else AxisType.Auto)
    stated = (P("data", None, None), w_spec(feature.layout)) if placement == "auto_stated" else None

    def fn(x_, w_, t_):
        return objective_of(linear_cross_entropy(x_, labels, w_, reduction=reduction, in_specs=stated, **options,
                                                 **with_t(t_)))

    context = jax.set_mesh(mesh) if explicit else contextlib.nullcontext()
    with context:
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, w_spec(feature.layout)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(xs, ws, t_arg)


@pytest.mark.parametrize("feature", FEATURES, ids=str)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_features_on_every_placement(backend_name, placement, feature):
    x, labels, w_hv = random_problem(11, (B, S), H, V)
    w = w_hv if feature.layout == "hv" else np.ascontiguousarray(w_hv.T)
    temperature = temperature_of(feature)
    cotangent = np.random.default_rng(4).standard_normal((B, S)).astype(np.float32)
    reduction = feature.reduction
    if placement == "shard_map" and reduction == "mean":
        reduction = "sum"  # inside the caller's shard_map the caller reduces (psum of sums)
    with skip_below_v3(backend_name):
        (_, outputs), (dx, dw) = run_placement(placement, backend_name, feature, x, labels, w, temperature,
                                               cotangent)
    want = oracle(x, labels, w_hv, reduction=reduction, logit_soft_cap=feature.cap, temperature=temperature,
                  cotangent=cotangent if reduction == "none" else None)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert max_rel_error(outputs[0], want["loss"]) < 1e-5
    assert dx.shape == x.shape and dw.shape == w.shape
    assert max_rel_error(dx, want["dx"]) < 1e-4
    assert max_rel_error(dw, want["dw"] if feature.layout == "hv" else want["dw"].T) < 1e-4
    rest = list(outputs[1:])
    if feature.lse:
        assert max_rel_error(rest.pop(0), want["lse"]) < 1e-5
    if feature.argmax:
        argmax = rest.pop(0)
        assert argmax.dtype == jnp.int32 and argmax.shape == labels.shape
        np.testing.assert_array_equal(argmax, expected_argmax(x, labels, w_hv, feature.cap, temperature))
        assert (np.asarray(argmax)[labels == -100] == -1).all()
