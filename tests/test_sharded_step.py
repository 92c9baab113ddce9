"""The plain call inside a user's own jitted, sharded step, on 8 simulated CPU devices.

Meshes come from ``jax.make_mesh`` as users make them: Explicit axes (its default, with
``jax.set_mesh``) and Auto axes (GSPMD/Shardy: ``NamedSharding`` inputs, with or without
``jax.set_mesh``, with or without the layout stated in ``in_specs``). Every mode runs the same
mechanism a TPU runs (``jax.shard_map`` over a layout fixed at trace time). For each layout of ``x``
and ``w`` the value and both gradients must match the float64 oracle. Where the layout is known
(Explicit types, or stated), the gradients must come back laid out like their inputs and the
compiled program must gather nothing but ``w`` where the caller's FSDP layout asks for it; under the
Auto-axes default it may gather ``w`` and hand ``dx`` back to the caller's layout, never more.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ce_core import linear_cross_entropy, linear_log_probs, sharded_linear_cross_entropy
from ce_core.sharded.placement import axes_of, spec_entries
from ce_core.testing import max_rel_error, oracle, random_problem

#: The backend_name tests run on 8 simulated devices; interpreted pallas_tpu is covered by the
#: 4-device tests below instead (see tests/conftest.py).
EIGHT_DEVICE_MESHES = True
#: explicit: jax.set_mesh of Explicit axes; auto: NamedSharding inputs of Auto axes, the default layout;
#: auto_set_mesh: the same inside jax.set_mesh; auto_stated: Auto axes with in_specs = the caller's layout.
MODES = ("explicit", "auto", "auto_set_mesh", "auto_stated")
#: The modes whose layout is the caller's own (read from the types, or stated).
CALLERS_LAYOUT = ("explicit", "auto_stated")
H, V = 40, 320  # H / 2 differs from every token count here, so a gathered piece of w is told apart
#: layout name -> (spec of x [batch, seq, H], spec of w [H, V], w's all-gathered shape or None)
LAYOUTS = {
    "data": (P("data", None, None), P(None, None), None),
    "vocab": (P(None, None, None), P(None, "model"), None),
    "data_x_vocab": (P("data", None, None), P(None, "model"), None),
    "sequence_x_vocab": (P(None, "data", None), P(None, "model"), None),
    "fsdp": (P("data", None, None), P("data", None), (H, V)),
    "fsdp_x_vocab": (P("data", None, None), P("data", "model"), (H, V // 4)),
}


class LossOptions(TypedDict, total=False):
    """Keyword options shared by the loss and its oracle."""

    label_smoothing: float
    logsumexp_weight: float
    logit_soft_cap: float


OPTIONS = LossOptions(label_smoothing=0.1, logsumexp_weight=1e-3, logit_soft_cap=3.0)
#: An all-gather instruction in compiled HLO text (also the async start on TPU), and its result shape.
ALL_GATHER = re.compile(r"=\s*\(?[a-z0-9]+\[(?P<dims>[\d,]*)\][^=\n]*?\ball-gather(?:-start)?\(")


def make_mesh(mode: str, shape: tuple[int, int] = (2, 4)):
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    devices = jax.devices("cpu")[: math.prod(shape)]
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type,) * 2, devices=devices)


def entered(mode: str, mesh):
    """``jax.set_mesh(mesh)`` except in plain GSPMD modes, where the shardings ride on the inputs alone."""
    return contextlib.nullcontext() if mode in ("auto", "auto_stated") else jax.set_mesh(mesh)


def stated_specs(mode: str, x_spec: P, w_spec: P) -> tuple[P, P] | None:
    """The ``in_specs`` of ``mode``: the caller's layout where the mode states it."""
    return (x_spec, w_spec) if mode == "auto_stated" else None


def gathers_beyond(hlo: str, local_x: tuple[int, ...], w_shape: tuple[int, int]) -> list[tuple[int, ...]]:
    """All-gathers other than of the whole ``w`` and of x-like arrays no larger than the caller's shard.

    Under the Auto-axes default the compiler may gather ``w`` (once) and gather ``dx`` over the axes
    the caller's layout leaves whole (back to ``local_x``); a gather of more tokens than a device of
    the caller holds, of the labels beyond that, or of a ``[tokens, V]`` block is a failure.
    """
    def allowed(dims: tuple[int, ...]) -> bool:
        if len(dims) == 2 and all(whole % part == 0 for whole, part in zip(w_shape, dims, strict=True)):
            return True  # w, or a step towards it (gathered over one axis, then the other)
        return dims[-1:] == local_x[-1:] and math.prod(dims) <= math.prod(local_x)

    return [dims for dims in all_gathers(hlo) if not allowed(dims)]


def local_shape(shape: tuple[int, ...], spec: P, mesh) -> tuple[int, ...]:
    entries = spec_entries(spec, len(shape))
    return tuple(size // math.prod(mesh.shape[a] for a in axes_of(e)) for size, e in zip(shape, entries, strict=True))


def all_gathers(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m["dims"].split(",") if d) for m in ALL_GATHER.finditer(hlo)]


def same_layout(array: jax.Array, spec: P) -> bool:
    assert isinstance(array.sharding, NamedSharding), array.sharding
    return spec_entries(array.sharding.spec, array.ndim) == spec_entries(spec, array.ndim)


def value_grads_and_hlo(mode, mesh, loss_fn, x, w, x_spec, w_spec):
    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    with entered(mode, mesh):
        xs = jax.device_put(x, NamedSharding(mesh, x_spec))
        ws = jax.device_put(w, NamedSharding(mesh, w_spec))
        loss, (dx, dw) = step(xs, ws)
        hlo = step.lower(xs, ws).compile().as_text()
    assert hlo is not None
    return loss, dx, dw, hlo


def assert_matches_oracle(loss, dx, dw, expected, tol=(1e-5, 1e-4)):
    assert max_rel_error(loss, expected["loss"]) < tol[0]
    assert max_rel_error(dx, expected["dx"]) < tol[1]
    assert max_rel_error(dw, expected["dw"]) < tol[1]


@pytest.mark.covering(mode=MODES, layout=tuple(LAYOUTS))
def test_plain_call_follows_the_callers_layout(backend_name, mode, layout):
    x_spec, w_spec, gathered_w = LAYOUTS[layout]
    x, labels, w = random_problem(0, (4, 6), H, V)
    specs = stated_specs(mode, x_spec, w_spec)
    def loss_fn(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation=backend_name, in_specs=specs, **OPTIONS)

    mesh = make_mesh(mode)
    loss, dx, dw, hlo = value_grads_and_hlo(mode, mesh, loss_fn, x, w, x_spec, w_spec)

    assert_matches_oracle(loss, dx, dw, oracle(x, labels, w, **OPTIONS))
    if mode in CALLERS_LAYOUT:
        assert same_layout(dx, x_spec), (dx.sharding, x_spec)
        assert same_layout(dw, w_spec), (dw.sharding, w_spec)
        # Nothing gathered but w, and w only where the caller's layout splits it over H (FSDP).
        assert all_gathers(hlo) == ([gathered_w] if gathered_w else []), all_gathers(hlo)
    else:
        assert gathers_beyond(hlo, local_shape(x.shape, x_spec, mesh), (H, V)) == [], all_gathers(hlo)


@pytest.mark.parametrize("mode", MODES)
def test_per_token_losses_and_lse_stay_split_like_the_labels(backend_name, mode):
    mesh = make_mesh(mode)
    x, labels, w = random_problem(1, (4, 6), H, V)
    cotangent = np.random.default_rng(1).standard_normal(labels.shape).astype(np.float32)

    specs = stated_specs(mode, P("data", None, None), P(None, "model"))

    def objective(x_, w_):
        losses, lse = linear_cross_entropy(x_, labels, w_, reduction="none", return_lse=True,
                                           implementation=backend_name, **OPTIONS, in_specs=specs)
        return jnp.sum(losses * cotangent), (losses, lse)

    with entered(mode, mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
        (_, (losses, lse)), (dx, dw) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(xs, ws)
    expected = oracle(x, labels, w, reduction="none", cotangent=cotangent, **OPTIONS)
    assert_matches_oracle(losses, dx, dw, expected)
    assert max_rel_error(lse, expected["lse"]) < 1e-6
    if mode in CALLERS_LAYOUT:
        assert same_layout(losses, P("data", None)) and same_layout(lse, P("data", None))


@pytest.mark.covering(mode=MODES, backends="turns")
def test_eager_calls_on_sharded_arrays(backend_name, mode):
    mesh = make_mesh(mode)
    x, labels, w = random_problem(2, (4, 6), H, V)
    specs = stated_specs(mode, P("data", None, None), P(None, "model"))
    with entered(mode, mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
        loss, (dx, dw) = jax.value_and_grad(
            lambda x_, w_: linear_cross_entropy(x_, labels, w_, implementation=backend_name, in_specs=specs),
            argnums=(0, 1))(xs, ws)
    assert_matches_oracle(loss, dx, dw, oracle(x, labels, w))


@pytest.mark.covering(mode=MODES, backends="turns")
def test_a_one_device_mesh(backend_name, mode):
    """Explicit axes of size 1 still type arrays as split along them; the call must not trip on that."""
    mesh = make_mesh(mode, (1, 1))
    x, labels, w = random_problem(9, (4, 6), H, V)
    specs = stated_specs(mode, P("data", None, None), P(None, "model"))
    def loss_fn(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation=backend_name, in_specs=specs, **OPTIONS)

    loss, dx, dw, _ = value_grads_and_hlo(mode, mesh, loss_fn, x, w, P("data", None, None), P(None, "model"))
    assert_matches_oracle(loss, dx, dw, oracle(x, labels, w, **OPTIONS))

def test_automatic_sharding_of_tokens_and_vocab_that_do_not_divide_evenly(backend_name):
    """The Auto-axes default pads the tokens to the 8 shards (padding adds nothing) and runs w whole."""
    mesh = make_mesh("auto")
    x, labels, w = random_problem(3, (25,), H, V + 2)

    def loss_fn(x_, w_):
        x_ = jax.lax.with_sharding_constraint(x_, NamedSharding(mesh, P("data", None)))
        w_ = jax.lax.with_sharding_constraint(w_, NamedSharding(mesh, P(None, "model")))
        return linear_cross_entropy(x_, labels, w_, implementation=backend_name, **OPTIONS)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w)
    assert_matches_oracle(loss, dx, dw, oracle(x, labels, w, **OPTIONS))

    def per_token(x_):
        x_ = jax.lax.with_sharding_constraint(x_, NamedSharding(mesh, P("data", None)))
        return linear_cross_entropy(x_, labels, w, reduction="none", implementation=backend_name)

    losses = jax.jit(per_token)(x)
    assert losses.shape == (25,)
    assert max_rel_error(losses, oracle(x, labels, w, reduction="none")["loss"]) < 1e-5


def test_stated_layouts_that_do_not_fit_the_mesh_are_refused_by_name():
    mesh = make_mesh("auto")
    x, labels, w = random_problem(3, (25,), H, V + 2)
    xs = jax.device_put(x[:20], NamedSharding(mesh, P("data", None)))
    labels = labels[:20]
    cases = [
        ((P(("data", "model"), None), P(None, None)), r"in_specs: x's dimension 0 \(size 20.*8 shards"),
        ((P(None, None), P(None, "model")), r"in_specs: w's vocab V=322.*4 shards"),
        ((P("batch", None), P(None, None)), r"names axis 'batch', which the mesh lacks"),
        ((P(("data", "data"), None), P()), r"uses a mesh axis twice"),
        ((P("data", None, None), P()), r"more entries than x has dimensions"),
        (P("data", None), r"must be a pair \(x_spec, w_spec\)"),
    ]
    for in_specs, message in cases:
        with pytest.raises(ValueError, match=message):
            jax.jit(lambda x_, s=in_specs: linear_cross_entropy(x_, labels, w, in_specs=s)).lower(xs)
    with pytest.raises(ValueError, match=r"no mesh is visible"):
        linear_cross_entropy(x[:20], labels, w, in_specs=(P("data", None), P()))


@pytest.mark.covering(mode=MODES, backends="turns")
def test_vmap_and_checkpoint_inside_a_sharded_step(backend_name, mode):
    mesh = make_mesh(mode)
    x, labels, w = random_problem(4, (2, 4, 6), H, V)  # vmapped over the first axis: per-example gradients
    specs = stated_specs(mode, P("data", None, None), P(None, "model"))
    per_example = lambda x_, y_, w_: linear_cross_entropy(x_, y_, w_, implementation=backend_name, in_specs=specs)  # noqa: E731
    grads = jax.vmap(jax.grad(jax.checkpoint(per_example), argnums=(0, 2)), in_axes=(0, 0, None))
    assert_per_example_gradients(mode, mesh, grads, x, labels, w)


def assert_per_example_gradients(mode, mesh, grads, x, labels, w):
    """Run `grads` jitted on x split by tokens and w by vocab; each example's gradients match the oracle's."""
    with entered(mode, mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "data", None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
        dx, dw = jax.jit(grads)(xs, labels, ws)
    for k in range(x.shape[0]):
        expected = oracle(x[k], labels[k], w)
        assert max_rel_error(dx[k], expected["dx"]) < 1e-4 and max_rel_error(dw[k], expected["dw"]) < 1e-4


# --- pallas_tpu: interpret mode on a 2x2 mesh --------------------------------------------------


@pytest.mark.parametrize("mode,layout", [("explicit", "data_x_vocab"),
                                         pytest.param("auto", "fsdp", marks=pytest.mark.slow),
                                         ("auto_set_mesh", "data_x_vocab"), ("auto_stated", "fsdp")])
def test_pallas_tpu_follows_the_callers_layout(monkeypatch, mode, layout):
    """Every mode runs the race-checked TPU interpreter per shard (the shard_map a TPU runs); each layout,
    vocab-parallel and FSDP, under Explicit and Auto axes. The scalar loss keeps its logits between the
    kernels (``keep_logits=True``: at this toy size the plan would recompute) in chunks of 8 tokens, two
    per shard, so under vocab shards each chunk's statistics are combined over them inside the chunk loop."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    from ce_pallas_tpu import kept_logits

    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 8)
    jax.clear_caches()  # the default layout of another case may have traced these very kernels
    calls = []
    original = kept_logits.row_stats_and_grads
    monkeypatch.setattr(kept_logits, "row_stats_and_grads",
                        lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    x_spec, w_spec, _ = LAYOUTS[layout]
    x, labels, w = random_problem(5, (4, 6), 128, 512)
    specs = stated_specs(mode, x_spec, w_spec)
    def loss_fn(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu", in_specs=specs, keep_logits=True,
                                    **OPTIONS)

    loss, dx, dw, _ = value_grads_and_hlo(mode, make_mesh(mode, (2, 2)), loss_fn, x, w, x_spec, w_spec)

    # The kernels ran per shard only: on 12 of the 24 tokens in the caller's layout (x split over
    # data), on 6 under the Auto-axes default (every token split over both axes).
    assert calls and set(calls) == {(12 if mode in CALLERS_LAYOUT else 6, 128)}, calls
    assert_matches_oracle(loss, dx, dw, oracle(x, labels, w, **OPTIONS))
    if mode in CALLERS_LAYOUT:
        assert same_layout(dx, x_spec) and same_layout(dw, w_spec)
    assert interpret_pallas_call.races is not None
    assert not interpret_pallas_call.races.races_found


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=() if mode == "explicit" else pytest.mark.slow)
                                  for mode in MODES])
def test_pallas_tpu_per_example_gradients_under_vmap_in_a_sharded_step(monkeypatch, mode):
    """Pallas cannot batch the kernels; ce_core runs the mapped examples one by one, on every shard."""
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    mesh = make_mesh(mode, (2, 2))
    x, labels, w = random_problem(4, (2, 4, 6), 128, 512)
    specs = stated_specs(mode, P("data", None, None), P(None, "model"))
    per_example = lambda x_, y_, w_: linear_cross_entropy(x_, y_, w_, implementation="pallas_tpu", in_specs=specs)  # noqa: E731
    grads = jax.vmap(jax.grad(per_example, argnums=(0, 2)), in_axes=(0, 0, None))
    assert_per_example_gradients(mode, mesh, grads, x, labels, w)


# --- a whole training step ----------------------------------------------------------------------


def _model_loss(params, inputs, labels, backend, specs):
    hidden = jnp.tanh(inputs @ params["embed"])
    return linear_cross_entropy(hidden, labels, params["head"], implementation=backend, logsumexp_weight=1e-3,
                                in_specs=specs)


def _sgd_step(params, inputs, labels, backend, specs):
    loss, grads = jax.value_and_grad(_model_loss)(params, inputs, labels, backend, specs)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss


@pytest.mark.covering(mode=MODES, layout=("data_x_vocab", "fsdp_x_vocab"))
def test_sharded_training_steps_give_the_unsharded_parameters(backend_name, mode, layout):
    rng = np.random.default_rng(7)
    inputs = rng.standard_normal((8, 5, 16)).astype(np.float32)
    labels = rng.integers(0, V, (8, 5)).astype(np.int32)
    params = {"embed": (rng.standard_normal((16, H)) / 4).astype(np.float32),
              "head": (rng.standard_normal((H, V)) / np.sqrt(H)).astype(np.float32)}
    step = jax.jit(functools.partial(_sgd_step, backend=backend_name, specs=None))

    expected = params
    for _ in range(3):
        expected, _ = step(expected, inputs, labels)

    mesh = make_mesh(mode)
    x_spec, head_spec, _ = LAYOUTS[layout]
    step = jax.jit(functools.partial(_sgd_step, backend=backend_name, specs=stated_specs(mode, x_spec, head_spec)))
    with entered(mode, mesh):
        sharded = {"embed": jax.device_put(params["embed"], NamedSharding(mesh, P())),
                   "head": jax.device_put(params["head"], NamedSharding(mesh, head_spec))}
        batch = jax.device_put(inputs, NamedSharding(mesh, x_spec))
        for _ in range(3):
            sharded, _ = step(sharded, batch, labels)
    assert same_layout(sharded["head"], head_spec)
    for name in params:
        assert max_rel_error(sharded[name], expected[name]) < 1e-5, name


# --- inside the caller's own shard_map ----------------------------------------------------------


def test_inside_a_users_shard_map_with_tokens_and_vocab_split(backend_name):
    """Per-shard sums (``vocab_axis_name`` combines the vocab), reduced by the caller's own psum."""
    mesh = make_mesh("explicit")
    x, labels, w = random_problem(8, (16,), H, V)
    weight_total = float(np.sum(labels != -100))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data", None), P("data"), P(None, "model")),
                       out_specs=P())
    def loss_fn(x_, y_, w_):
        local = linear_cross_entropy(x_, y_, w_, reduction="sum", vocab_axis_name="model",
                                     implementation=backend_name, **OPTIONS)
        return jax.lax.psum(local, "data") / weight_total

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data", None))
        ys = jax.device_put(labels, P("data"))
        ws = jax.device_put(w, P(None, "model"))
        loss, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b: loss_fn(a, ys, b), argnums=(0, 1)))(xs, ws)
    assert_matches_oracle(loss, dx, dw, oracle(x, labels, w, **OPTIONS))


# --- ahead of time, for a TPU topology ----------------------------------------------------------

AOT_N, AOT_H, AOT_V = 32768, 4096, 128256


@pytest.fixture(scope="module")
def v5p_2x2x1():
    from ce_pallas_tpu.tooling.aot import topology_devices

    return topology_devices("v5p:2x2x1")


@pytest.mark.slow
@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("backend", ["pallas_tpu", "xla"])
@pytest.mark.parametrize("mesh_shape,w_spec", [((2, 2), P(None, "model")), ((4, 1), P(None, None))],
                         ids=["data_x_vocab", "data_only"])
def test_plain_call_compiles_for_a_v5p_topology_within_its_memory_bound(monkeypatch, v5p_2x2x1, backend,
                                                                         mesh_shape, w_spec):
    """The plain call under explicit sharding, compiled by libtpu for 4 v5p chips at Llama-3 scale."""
    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)  # compile the real kernels
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), devices=v5p_2x2x1)
    n, h, v = AOT_N, AOT_H, AOT_V
    loss_fn = lambda x_, y_, w_: linear_cross_entropy(x_, y_, w_, logsumexp_weight=1e-4, implementation=backend)  # noqa: E731
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 2))).lower(
            abstract(mesh, (n, h), jnp.bfloat16, P("data", None)), abstract(mesh, (n,), jnp.int32, P("data")),
            abstract(mesh, (h, v), jnp.bfloat16, w_spec)).compile()
    vocab_split = mesh_shape[1] if w_spec == P(None, "model") else 1
    assert_within_the_auto_axes_bound(compiled, backend, vocab_split, gathers_w=False, data_split=mesh_shape[0])


@pytest.fixture(scope="module")
def v6e_2x2():
    from ce_pallas_tpu.tooling.aot import topology_devices

    return topology_devices("v6e:2x2")


#: w's layout in the caller's step -> (its spec, how many ways it splits V)
AUTO_W_LAYOUTS = {"replicated": (P(None, None), 1), "vocab": (P(None, "model"), 2), "fsdp": (P("data", None), 1)}


def compile_under_auto_axes(devices, generation, backend, w_spec, stated, n=AOT_N):
    """value_and_grad of the plain call at Llama-3 scale (``n`` tokens), Auto axes, x split over data on a 2x2 mesh.

    ``stated``: inside ``jax.set_mesh`` with the caller's layout in ``in_specs``; otherwise on
    ``NamedSharding``-typed shapes alone (no mesh context), with the default layout.
    """
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=devices)
    h, v = AOT_H, AOT_V
    specs = (P("data", None), w_spec) if stated else None
    loss_fn = lambda x_, y_, w_: linear_cross_entropy(x_, y_, w_, logsumexp_weight=1e-4, implementation=backend,  # noqa: E731
                                                      in_specs=specs)
    context = jax.set_mesh(mesh) if stated else contextlib.nullcontext()
    with context:
        return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 2))).lower(
            abstract(mesh, (n, h), jnp.bfloat16, P("data", None)), abstract(mesh, (n,), jnp.int32, P("data")),
            abstract(mesh, (h, v), jnp.bfloat16, w_spec)).compile()


@pytest.mark.slow
@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.covering(w_layout=tuple(AUTO_W_LAYOUTS), stated=(False, True), backend=("pallas_tpu", "xla"))
def test_auto_axes_compile_for_a_v5p_topology_within_the_memory_bound(monkeypatch, v5p_2x2x1, backend, w_layout,
                                                                      stated):
    """GSPMD on TPU: the Auto-axes call compiles for 4 v5p chips, gathering at most w, within the bound
    (every layout, default and stated, each pair of them and of a backend once).

    The bound is ``4HV/k + 8(N/d)H + 64 MiB`` per device, ``d`` the caller's token split and ``k`` the
    vocab split of the layout run: the caller's when stated, 1 under the default (which gathers w).
    """
    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)  # compile the real kernels
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    w_spec, vocab_split = AUTO_W_LAYOUTS[w_layout]
    compiled = compile_under_auto_axes(v5p_2x2x1, "v5p", backend, w_spec, stated)
    assert_within_the_auto_axes_bound(compiled, backend, vocab_split if stated else 1,
                                      gathers_w=(w_layout == "fsdp") or (w_layout == "vocab" and not stated))


@pytest.mark.slow
# Its stated vocab-parallel case (~350 s of libtpu at slowdown 1: the kept path's chunks over 16384 tokens a device)
# was dropped on 2026-12-02 when the slow tier outgrew CI's limit; v5p's covering rows above state that layout.
@pytest.mark.parametrize("backend,w_layout,stated", [("pallas_tpu", "replicated", False)])
def test_auto_axes_compile_for_a_v6e_topology_within_the_memory_bound(monkeypatch, v6e_2x2, backend, w_layout,
                                                                      stated):
    """The same on 4 v6e chips with the Pallas kernels in the default layout (the stated and FSDP layouts and the
    xla backend are compiled for v5p above, and xla for v6e in ce_xla's tests)."""
    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v6e")
    w_spec, vocab_split = AUTO_W_LAYOUTS[w_layout]
    # 4096 tokens a device (v5p's case takes 16384): v6e's kept path takes them in one chunk, where 16384 took four
    # chunks' kernels, ~190 s of libtpu at slowdown 1.
    n = AOT_N // 4
    compiled = compile_under_auto_axes(v6e_2x2, "v6e", backend, w_spec, stated, n=n)
    assert_within_the_auto_axes_bound(compiled, backend, vocab_split if stated else 1, gathers_w=w_layout == "fsdp",
                                      n=n)


def assert_within_the_auto_axes_bound(compiled, backend, vocab_split, gathers_w, *, data_split=2, w_shape=None,
                                      n=AOT_N):
    """Per device at most ``4HV/k + 8(N/d)H + 64 MiB`` of temporaries (``k`` = ``vocab_split``, ``d`` =
    ``data_split``), no gather but of ``w`` (of ``w_shape``, ``(H, V)`` unless given), and that one only
    when ``gathers_w``; the Pallas kernels in the program exactly when ``backend`` is pallas_tpu.

    xla adds ``4HV/k``: each device's float32 ``dw`` accumulator beyond its ``dx`` one (0.7-1.8 GiB here)
    fits a deviceless TPU's keep-logits budget (2 GiB: ``ce_xla.tiling``), so it takes tokens outer (its
    vocab-outer bound, a budget of 0, is checked in ``packages/ce_xla/tests/test_memory.py``). pallas_tpu
    adds its keep-logits budget (4 GiB on v5p and v6e alike: ``ce_pallas_tpu.kept_logits``), which a scalar
    loss's gradient may spend on one chunk's kept logits and a float32 ``dw``."""
    h, v = AOT_H, AOT_V
    w_shape = w_shape or (h, v)
    hlo = compiled.as_text()
    assert hlo is not None
    bound = 4 * h * v / vocab_split + 8 * (n / data_split) * h + 64 * 2**20
    if backend == "xla":
        bound += 4 * h * v / vocab_split
    if backend == "pallas_tpu":
        from ce_pallas_tpu import kept_logits
        from ce_pallas_tpu.target import CHIP_FACTS, Target

        budgets = {kept_logits.keep_logits_budget(Target(gen, CHIP_FACTS[gen].num_cores, None))
                   for gen in ("v5p", "v6e")}
        assert len(budgets) == 1
        bound += budgets.pop()
    memory = compiled.memory_analysis()
    assert memory is not None
    temp = memory.temp_size_in_bytes
    assert temp <= bound, f"{temp / 2**20:.0f} MiB of temporaries per device > {bound / 2**20:.0f} MiB"
    # No gather of x, the labels or a [tokens, V] block; w gathered once, and only where it must be.
    assert gathers_beyond(hlo, (n // data_split, h), w_shape) == [], all_gathers(hlo)
    assert all_gathers(hlo) == ([w_shape] if gathers_w else []), all_gathers(hlo)
    assert ("tpu_custom_call" in hlo) == (backend == "pallas_tpu")


def abstract(mesh, shape, dtype, spec):
    """A ``ShapeDtypeStruct`` placed on ``mesh`` by ``spec`` (an argument to lower for a topology)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


@pytest.mark.slow
@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("call", ["log_probs_default", "log_probs_stated", "wrapper"])
def test_log_probs_and_the_wrapper_compile_under_auto_axes_for_a_v5p_topology(monkeypatch, v5p_2x2x1, call):
    """The RL path (log-probs and entropy) and the wrapper, Auto axes, value_and_grad, 4 v5p chips."""
    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=v5p_2x2x1)
    n, h, v = AOT_N, AOT_H, AOT_V
    w_spec = P(None, "model")

    def objective(x_, y_, w_):
        if call == "wrapper":
            return sharded_linear_cross_entropy(x_, y_, w_, mesh=mesh, batch_axes=("data",), vocab_axis="model",
                                                implementation="pallas_tpu")
        specs = (P("data", None), w_spec) if call == "log_probs_stated" else None
        logp, entropy = linear_log_probs(x_, y_, w_, temperature=0.7, return_entropy=True, in_specs=specs,
                                         implementation="pallas_tpu")
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 2))).lower(
        abstract(mesh, (n, h), jnp.bfloat16, P("data", None)), abstract(mesh, (n,), jnp.int32, P("data")),
        abstract(mesh, (h, v), jnp.bfloat16, w_spec)).compile()
    assert_within_the_auto_axes_bound(compiled, "pallas_tpu", 1 if call == "log_probs_default" else 2,
                                      gathers_w=call == "log_probs_default")


#: how the v3 features' step is placed -> (axis types, stated in_specs?, inside jax.set_mesh?)
V3_PLACEMENTS = {"explicit": (AxisType.Explicit, False, True), "auto_default": (AxisType.Auto, False, False),
                 "auto_stated": (AxisType.Auto, True, True)}


@pytest.mark.slow
@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("backend", ["pallas_tpu", "xla"])
@pytest.mark.parametrize("placement", V3_PLACEMENTS)
def test_tied_head_argmax_and_per_token_temperature_compile_for_a_v5p_topology(monkeypatch, v5p_2x2x1, backend,
                                                                               placement):
    """A tied ``[V, H]`` head split over vocab, the token argmax and a per-token temperature under a soft
    cap, value_and_grad, compiled by libtpu for 4 v5p chips at Llama-3 scale, in each placement.

    The bound is the plain call's (``4HV/k + 8(N/d)H + 64 MiB``); nothing but ``w`` may be gathered,
    and ``w`` only under the Auto-axes default (which runs it whole).
    """
    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    axis_type, stated, set_mesh = V3_PLACEMENTS[placement]
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=v5p_2x2x1)
    n, h, v = AOT_N, AOT_H, AOT_V
    x_spec, w_spec = P("data", None), P("model", None)

    def objective(x_, y_, w_, temperature):
        loss, argmax = linear_cross_entropy(x_, y_, w_, w_layout="vh", return_argmax=True, logit_soft_cap=30.0,
                                            temperature=temperature, implementation=backend,
                                            in_specs=(x_spec, w_spec) if stated else None)
        return loss, argmax

    context = jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext()
    with context:
        compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 2), has_aux=True)).lower(
            abstract(mesh, (n, h), jnp.bfloat16, x_spec), abstract(mesh, (n,), jnp.int32, P("data")),
            abstract(mesh, (v, h), jnp.bfloat16, w_spec), abstract(mesh, (n,), jnp.float32, P("data"))).compile()
    default = placement == "auto_default"
    assert_within_the_auto_axes_bound(compiled, backend, 1 if default else 2, gathers_w=default, w_shape=(v, h))
