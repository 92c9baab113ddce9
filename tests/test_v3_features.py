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


def make_mesh(axis_type=AxisType.Auto, shape: tuple[int, int] = (2, 4)):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu")[:shape[0] * shape[1]])


def w_spec(layout: str) -> P:
    """``w`` split on its vocab dimension over "model" (tensor/vocab parallel)."""
    return P(None, "model") if layout == "hv" else P("model", None)


def run_placement(placement: str, backend: str, feature: Feature, x, labels, w, temperature, cotangent,
                  mesh_shape: tuple[int, int] = (2, 4)):
    """``(objective, outputs), (dx, dw)`` of one call placed as ``placement`` says, on a data x model mesh."""
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
        mesh = make_mesh(shape=mesh_shape)
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

        def mapped_fn(x_, w_):
            t_ = jnp.ones((B, S)) if t_arg is None else t_arg
            return objective_of(mapped(x_, labels, w_, t_))

        step = jax.jit(jax.value_and_grad(mapped_fn, argnums=(0, 1), has_aux=True))
        return step(jax.device_put(x, NamedSharding(mesh, P("data"))),
                    jax.device_put(w, NamedSharding(mesh, w_spec(feature.layout))))

    reduction = feature.reduction
    if placement == "local":
        def fn(x_, w_, t_):
            return objective_of(linear_cross_entropy(x_, labels, w_, reduction=reduction, **options, **with_t(t_)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(x, w, t_arg)

    if placement == "wrapper":
        mesh = make_mesh(shape=mesh_shape)

        def fn(x_, w_, t_):
            return objective_of(sharded_linear_cross_entropy(x_, labels, w_, mesh=mesh, batch_axes="data",
                                                             vocab_axis="model", reduction=reduction, **options,
                                                             **with_t(t_)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(x, w, t_arg)

    explicit = placement == "explicit"
    mesh = make_mesh(AxisType.Explicit if explicit else AxisType.Auto, mesh_shape)
    stated = (P("data", None, None), w_spec(feature.layout)) if placement == "auto_stated" else None

    def fn(x_, w_, t_):
        return objective_of(linear_cross_entropy(x_, labels, w_, reduction=reduction, in_specs=stated, **options,
                                                 **with_t(t_)))

    context = jax.set_mesh(mesh) if explicit else contextlib.nullcontext()
    with context:
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, w_spec(feature.layout)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(xs, ws, t_arg)


@pytest.mark.covering(placement=PLACEMENTS, layout=("vh", "hv"), cap=(None, 2.0),
                      temperature=("token", "sequence", "scalar"), reduction=("sum", "none", "mean"), lse=(False, True),
                      require=[*(("backend_name", "placement", feature) for feature in
                                 ("layout", "cap", "temperature", "reduction")),
                               ("cap", "temperature", "reduction")])
def test_features_on_every_placement(backend_name, placement, layout, cap, temperature, reduction, lse):
    """Every value of every feature runs on every backend in every placement, every pair of values meets,
    and a soft cap with a per-token temperature (the row scale) meets every reduction (the fused and the
    per-token path): 39 rows instead of the full product's 1,728."""
    feature = Feature(layout, cap, temperature, reduction, lse=lse)
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


def tie_problem(layout: str):
    """Every row's two largest logits are equal, at columns 15 and 16 (vocab shards 0 and 1 of 4) for the first
    half of the rows and at 40 and 20 for the rest; the lowest index must win."""
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal((B, S, H))).astype(np.float32) + 0.1
    w = (0.1 * rng.standard_normal((H, V))).astype(np.float32)
    x[B // 2:, :, :H // 2] = 0.0  # these rows see only the second half of H, the others only the first
    x[:B // 2, :, H // 2:] = 0.0
    w[:, 15] = w[:, 16] = np.r_[np.full(H // 2, 1.0), np.zeros(H // 2)].astype(np.float32)
    w[:, 20] = w[:, 40] = np.r_[np.zeros(H // 2), np.full(H // 2, 1.0)].astype(np.float32)
    labels = rng.integers(0, V, (B, S)).astype(np.int32)
    expected = np.where(np.arange(B)[:, None] < B // 2, 15, 20) * np.ones((B, S), np.int64)
    return x, labels, (w if layout == "hv" else np.ascontiguousarray(w.T)), expected


@pytest.mark.covering(placement=("local", "shard_map", "explicit", "wrapper"), layout=("hv", "vh"))
def test_argmax_ties_take_the_lowest_global_index_across_vocab_shards(backend_name, placement, layout):
    x, labels, w, expected = tie_problem(layout)
    z = np.einsum("bsh,hv->bsv", x.astype(np.float64), w if layout == "hv" else w.T)
    assert (np.sort(z, -1)[..., -1] == np.sort(z, -1)[..., -2]).all()  # the ties are real
    feature = Feature(layout=layout, temperature="scalar")
    with skip_below_v3(backend_name):
        (_, outputs), _ = run_placement(placement, backend_name, feature, x, labels, w, 1.0, None)
    np.testing.assert_array_equal(outputs[1], expected)


@pytest.mark.covering(placement=("local", "wrapper", "auto_default"), backends="turns")
def test_all_ignored_batch_gives_zero_loss_and_minus_one_argmax(backend_name, placement):
    x, _, w_hv = random_problem(5, (B, S), H, V)
    labels = np.full((B, S), -100, np.int32)
    feature = Feature(reduction="mean")
    with skip_below_v3(backend_name):
        (_, outputs), (dx, dw) = run_placement(placement, backend_name, feature, x, labels,
                                               np.ascontiguousarray(w_hv.T), temperature_of(feature), None)
    assert float(outputs[0]) == 0.0
    np.testing.assert_array_equal(outputs[1], -np.ones((B, S)))
    assert not np.asarray(dx).any() and not np.asarray(dw).any()


def test_empty_batch_with_argmax(backend_name):
    x = jnp.zeros((0, H))
    w = jnp.ones((V, H))
    with skip_below_v3(backend_name):
        loss, argmax = linear_cross_entropy(x, jnp.zeros((0,), jnp.int32), w, w_layout="vh", return_argmax=True,
                                            temperature=jnp.ones((0,)), implementation=backend_name)
    assert float(loss) == 0.0 and argmax.shape == (0,) and argmax.dtype == jnp.int32


@pytest.mark.parametrize("cap", [None, 2.0])
def test_bf16_vh_with_per_token_temperature_and_argmax(backend_name, cap):
    x, labels, w_hv = random_problem(6, (3, 7), 32, 160)
    x16, w16 = jnp.asarray(x, jnp.bfloat16), jnp.asarray(np.ascontiguousarray(w_hv.T), jnp.bfloat16)
    t = np.random.default_rng(1).uniform(0.5, 2.0, (3, 7)).astype(np.float32)

    def loss(x_, w_):
        return linear_cross_entropy(x_, labels, w_, w_layout="vh", temperature=t, logit_soft_cap=cap,
                                    return_argmax=True, implementation=backend_name)

    with skip_below_v3(backend_name):
        (value, argmax), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x16, w16)
    x32, w32 = np.asarray(x16.astype(jnp.float32)), np.asarray(w16.astype(jnp.float32)).T
    # Without a cap the rows of x are scaled by 1/T in x's dtype (bf16), as for a scalar temperature.
    want = oracle(x32, labels, w32, logit_soft_cap=cap, temperature=t)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16 and dw.shape == (160, 32)
    assert max_rel_error(value, want["loss"]) < 2e-2
    assert max_rel_error(dx.astype(jnp.float32), want["dx"]) < 2e-2
    assert max_rel_error(dw.astype(jnp.float32), want["dw"].T) < 2e-2
    agree = np.asarray(argmax) == expected_argmax(x32, labels, w32, cap, t)
    assert agree.mean() > 0.9  # bf16 rounding of x / T may swap near-equal maxima


def test_vmap_with_argmax_vh_and_per_token_temperature(backend_name):
    xs, labels, w_hv = random_problem(2, (3, 10), 8, 32)
    w = np.ascontiguousarray(w_hv.T)
    t = np.random.default_rng(2).uniform(0.5, 2.0, (3, 10)).astype(np.float32)

    def loss(backend):
        def fn(x_, y_, w_, t_):
            return linear_cross_entropy(x_, y_, w_, w_layout="vh", temperature=t_, logit_soft_cap=2.0,
                                        return_argmax=True, implementation=backend)
        return jax.value_and_grad(fn, argnums=(0, 2), has_aux=True)

    with skip_below_v3(backend_name):
        batched = jax.vmap(loss(backend_name), in_axes=(0, 0, None, 0))(xs, labels, w, t)
    for k in range(3):
        one = loss("reference")(xs[k], labels[k], w, t[k])
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(one), strict=True):
            if got.dtype == jnp.int32:
                np.testing.assert_array_equal(got[k], want)
            else:
                assert max_rel_error(got[k], want) < 1e-5


def test_tied_embedding_gradient_matches_materialised_logits(backend_name):
    """The table is the input embedding (a gather) and the head (``w_layout="vh"``): one gradient for both."""
    rng = np.random.default_rng(8)
    vocab, hidden = 96, 16
    table = (rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(np.float32)
    proj = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    tokens = rng.integers(0, vocab, (3, 9)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t = rng.uniform(0.6, 1.5, (3, 1)).astype(np.float32)

    def model(emb, head_fn):
        h = jnp.tanh(emb[inputs] @ proj) * 3.0
        return head_fn(h, emb)

    def ours(emb):
        return model(emb, lambda h, e: linear_cross_entropy(h, targets, e, w_layout="vh", temperature=t,
                                                            logit_soft_cap=5.0, implementation=backend_name))

    def materialised(emb):
        def head(h, e):
            logits = 5.0 * jnp.tanh((h @ e.T) / 5.0) / t[..., None]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        return model(emb, head)

    with skip_below_v3(backend_name):
        value, grad = jax.jit(jax.value_and_grad(ours))(table)
    want_value, want_grad = jax.value_and_grad(materialised)(table)
    assert grad.shape == table.shape
    assert max_rel_error(value, want_value) < 1e-5
    assert max_rel_error(grad, want_grad) < 1e-4


@pytest.mark.covering(placement=("local", "explicit", "auto_stated", "shard_map"), backends="turns")
def test_log_probs_with_vh_and_per_token_temperature(backend_name, placement):
    x, labels, w_hv = random_problem(9, (B, S), H, V)
    w = np.ascontiguousarray(w_hv.T)
    t = np.random.default_rng(3).uniform(0.5, 2.0, (B, 1)).astype(np.float32)
    g_logp, g_ent = np.random.default_rng(4).standard_normal((2, B, S)).astype(np.float32)
    options: dict[str, Any] = dict(w_layout="vh", logit_soft_cap=2.5, return_entropy=True,
                                   implementation=backend_name)

    def objective(logp, entropy):
        return jnp.sum(g_logp * logp) + jnp.sum(g_ent * entropy), (logp, entropy)

    if placement == "shard_map":
        mesh = make_mesh()
        mapped = jax.shard_map(
            lambda x_, y_, w_, t_: linear_log_probs(x_, y_, w_, temperature=t_, vocab_axis_name="model", **options),
            mesh=mesh, in_specs=(P("data"), P("data"), P("model", None), P("data", None)),
            out_specs=(P("data"), P("data")))

        def fn(x_, w_):
            return objective(*mapped(x_, labels, w_, t))
        xs, ws = (jax.device_put(x, NamedSharding(mesh, P("data"))),
                  jax.device_put(w, NamedSharding(mesh, P("model", None))))
        context: Any = contextlib.nullcontext()
    else:
        stated = (P("data", None, None), P("model", None)) if placement == "auto_stated" else None
        mesh = make_mesh(AxisType.Explicit if placement == "explicit" else AxisType.Auto)

        def fn(x_, w_):
            return objective(*linear_log_probs(x_, labels, w_, temperature=t, in_specs=stated, **options))
        xs, ws = x, w
        context = contextlib.nullcontext()
        if placement != "local":
            xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
            ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
            if placement == "explicit":
                context = jax.set_mesh(mesh)
    with skip_below_v3(backend_name), context:
        (_, (logp, entropy)), (dx, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(xs, ws)
    want = log_probs_oracle(x, labels, w_hv, temperature=t, logit_soft_cap=2.5, logp_cotangent=g_logp,
                            entropy_cotangent=g_ent)
    assert max_rel_error(logp, want["logp"]) < 1e-5
    assert max_rel_error(entropy, want["entropy"]) < 1e-5
    assert max_rel_error(dx, want["dx"]) < 1e-4
    assert max_rel_error(dw, want["dw"].T) < 1e-4


def test_return_order_and_types():
    x, labels, w = random_problem(1, (5,), 8, 12)
    assert isinstance(linear_cross_entropy(x, labels, w, implementation="reference"), jax.Array)
    loss, lse = linear_cross_entropy(x, labels, w, return_lse=True, implementation="reference")
    loss2, argmax = linear_cross_entropy(x, labels, w, return_argmax=True, implementation="reference")
    _loss3, lse3, argmax3 = linear_cross_entropy(x, labels, w, return_lse=True, return_argmax=True,
                                                implementation="reference")
    assert lse.shape == argmax.shape == labels.shape and argmax.dtype == jnp.int32
    assert max_rel_error(loss, loss2) < 1e-6 and max_rel_error(lse, lse3) < 1e-6
    np.testing.assert_array_equal(argmax, argmax3)
    np.testing.assert_array_equal(argmax, expected_argmax(x, labels, w, None, 1.0))


def test_temperature_is_not_differentiated():
    x, labels, w = random_problem(1, (2, 5), 8, 12)

    def loss(t):
        return linear_cross_entropy(x, labels, w, temperature=t, logit_soft_cap=3.0, implementation="reference")

    assert not np.asarray(jax.grad(loss)(jnp.full((2, 5), 1.5))).any()


def test_traced_bad_temperature_gives_nan_for_that_token_only():
    x, labels, w = random_problem(1, (2, 5), 8, 12, ignore_fraction=0.0)
    t = np.ones((2, 5), np.float32)
    t[0, 1], t[1, 3] = 0.0, np.nan

    @jax.jit
    def per_token(t_):
        return (linear_cross_entropy(x, labels, w, temperature=t_, reduction="none", implementation="reference"),
                linear_log_probs(x, labels, w, temperature=t_, logit_soft_cap=2.0, implementation="reference"))

    loss, logp = per_token(t)
    bad = np.zeros((2, 5), bool)
    bad[0, 1] = bad[1, 3] = True
    for values in (np.asarray(loss), np.asarray(logp)):
        assert np.isnan(values[bad]).all() and np.isfinite(values[~bad]).all()
    mean = jax.jit(lambda t_: linear_cross_entropy(x, labels, w, temperature=t_, implementation="reference"))(t)
    assert np.isnan(mean)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(w_layout="hw"), r"w_layout must be one of \('hv', 'vh'\)"),
        (dict(w_layout=None), r"w_layout must be one of"),
        (dict(w_layout="vh", w=np.zeros((8, 12), np.float32)),
         r"hidden sizes differ: .*\(H=12, w_layout='vh': w is \[V, H\]\)"),
        (dict(temperature=np.array([[1.0, -1.0, 1.0, 1.0, 1.0]] * 2)),
         r"temperature must be finite and > 0 everywhere; temperature\[0, 1\] = -1.0"),
        (dict(temperature=np.array([1.0, np.inf])[:, None]), r"temperature must be finite and > 0"),
        (dict(temperature=np.ones((3,))), r"temperature of shape \(3,\) does not broadcast to the labels' shape"),
        (dict(temperature="hot"), r"temperature must be a number > 0 or an array"),
        (dict(temperature=float("nan")), r"temperature must be finite"),
        (dict(temperature=-2.0), r"temperature must be > 0"),
    ],
)
def test_bad_new_arguments_are_named(kwargs, match):
    x, labels, w = random_problem(1, (2, 5), 8, 12)
    arguments: dict[str, Any] = dict(x=x, labels=labels, w=w)
    arguments.update((k, kwargs.pop(k)) for k in ("w",) if k in kwargs)
    for fn in (linear_cross_entropy, linear_log_probs):
        with pytest.raises(ValueError, match=match):
            fn(arguments["x"], arguments["labels"], arguments["w"], implementation="reference", **kwargs)
    mesh = make_mesh()
    with pytest.raises(ValueError, match=match):
        sharded_linear_cross_entropy(arguments["x"], arguments["labels"], arguments["w"], mesh=mesh,
                                     implementation="reference", **kwargs)


def test_wrapper_refuses_a_vocab_that_does_not_split_in_the_vh_layout():
    x, labels, w = random_problem(1, (2, 5), 8, 12)
    with pytest.raises(ValueError, match=r"V=12 \(w of shape \(12, 8\), w_layout='vh'\) is not divisible"):
        sharded_linear_cross_entropy(x, labels, np.ascontiguousarray(np.concatenate([w, w[:, :0]], 1).T),
                                     mesh=jax.make_mesh((1, 8), ("data", "model"), devices=jax.devices("cpu")[:8]),
                                     vocab_axis="model", w_layout="vh", implementation="reference")


def test_stated_in_specs_split_the_vh_vocab_dimension():
    mesh = make_mesh()
    x, labels, w = random_problem(1, (4, 5), 8, 30)
    x = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    with pytest.raises(ValueError, match=r"w's vocab V=30 .*w_layout='vh'.* does not split evenly"):
        linear_cross_entropy(x, labels, np.ascontiguousarray(w.T), w_layout="vh", implementation="reference",
                             in_specs=(P("data", None, None), P("model", None)))
    assert ce_core.CONTRACT_VERSION == 5


# --- pallas_tpu: the race-checked TPU interpreter on a 2 x 2 mesh --------------------------------


@pytest.mark.covering(placement=("local", "explicit", "auto_stated", "wrapper"), layout=("vh", "hv"),
                      row_scale=(False, True), reduction=("sum", "none"))
def test_pallas_tpu_features_in_the_tpu_interpreter(monkeypatch, placement, layout, row_scale, reduction):
    """The kernels' [V, H] blocks, argmax and row scale (a soft cap with a per-token temperature; without
    one, ``x``'s rows are scaled) on the fused and the per-token path, per shard: each pair meets once."""
    feature = Feature(layout, 2.0 if row_scale else None, "token" if row_scale or reduction == "sum" else "sequence",
                      reduction, lse=reduction == "none")
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    jax.clear_caches()
    x, labels, w_hv = random_problem(11, (B, S), 136, 300)  # H and the vocab shards not multiples of 128
    w = w_hv if feature.layout == "hv" else np.ascontiguousarray(w_hv.T)
    temperature = temperature_of(feature)
    cotangent = np.random.default_rng(4).standard_normal((B, S)).astype(np.float32)
    (_, outputs), (dx, dw) = run_placement(placement, "pallas_tpu", feature, x, labels, w, temperature, cotangent,
                                           mesh_shape=(2, 2))
    want = oracle(x, labels, w_hv, reduction=feature.reduction, logit_soft_cap=feature.cap, temperature=temperature,
                  cotangent=cotangent if feature.reduction == "none" else None)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert max_rel_error(outputs[0], want["loss"]) < 1e-4
    assert max_rel_error(dx, want["dx"]) < 1e-4
    assert max_rel_error(dw, want["dw"] if feature.layout == "hv" else want["dw"].T) < 1e-4
    np.testing.assert_array_equal(outputs[-1], expected_argmax(x, labels, w_hv, feature.cap, temperature))
    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found
