"""Data- and vocab-parallel loss on 8 simulated CPU devices, against the float64 oracle."""

from __future__ import annotations

import functools
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ce_core import linear_cross_entropy, linear_log_probs, sharded_linear_cross_entropy
from ce_core.testing import Case, compare_with_oracle, max_rel_error, oracle, random_problem

MESH_SHAPES = [(8, 1), (2, 4), (1, 8)]
SHARDED_CASES = [
    Case(),
    Case(reduction="sum", use_weights=True, logsumexp_weight=1e-3),
    Case(reduction="none", logit_soft_cap=2.0, label_smoothing=0.1),
    Case(reduction="mean", use_weights=True, logsumexp_weight=1e-3, logit_soft_cap=2.0, label_smoothing=0.1),
]


class LossOptions(TypedDict, total=False):
    """Keyword options shared by the loss and its oracle."""

    label_smoothing: float
    logsumexp_weight: float


#: The backend_name tests run on 8 simulated devices; interpreted pallas_tpu on meshes is covered by
#: the 4-device tests of tests/test_sharded_step.py instead (see tests/conftest.py).
EIGHT_DEVICE_MESHES = True


def make_mesh(data: int, vocab: int) -> Mesh:
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "the root conftest asks XLA for 8 CPU devices"
    return Mesh(np.array(devices[: data * vocab]).reshape(data, vocab), ("data", "vocab"))


@pytest.mark.parametrize("mesh_shape,case", [(MESH_SHAPES[k % len(MESH_SHAPES)], case)
                                             for k, case in enumerate(SHARDED_CASES)],
                         ids=[f"{MESH_SHAPES[k % len(MESH_SHAPES)]}-case{k}" for k in range(len(SHARDED_CASES))])
def test_sharded_matches_oracle(mesh_shape, case):
    """Each case on one mesh shape, every shape used."""
    loss_fn = functools.partial(sharded_linear_cross_entropy, mesh=make_mesh(*mesh_shape), batch_axes="data",
                                vocab_axis="vocab")
    x, labels, w = random_problem(0, (4, 10), 32, 200)
    compare_with_oracle("reference", case, x, labels, w, loss_fn=loss_fn)


def test_pallas_tpu_through_the_wrapper_on_a_2x2_mesh(monkeypatch):
    """The wrapper runs the real kernels per shard (race-checked TPU interpreter, two cores of a v5p)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    loss_fn = functools.partial(sharded_linear_cross_entropy, mesh=make_mesh(2, 2), vocab_axis="vocab")
    x, labels, w = random_problem(1, (3, 11), 48, 328)  # 33 tokens: padded to 34 for 2 data shards
    compare_with_oracle("pallas_tpu", SHARDED_CASES[-1], x, labels, w, loss_fn=loss_fn)
    assert interpret_pallas_call.races is not None
    assert not interpret_pallas_call.races.races_found


def test_every_backend_on_a_data_by_vocab_mesh(backend_name):
    loss_fn = functools.partial(sharded_linear_cross_entropy, mesh=make_mesh(2, 4), vocab_axis="vocab")
    x, labels, w = random_problem(1, (3, 11), 48, 328)  # 33 tokens: padded to 34 for 2 data shards
    compare_with_oracle(backend_name, SHARDED_CASES[-1], x, labels, w, loss_fn=loss_fn)
    compare_with_oracle(backend_name, Case(reduction="none", use_weights=True), x, labels, w, loss_fn=loss_fn)


def test_data_parallel_only_uses_the_fused_path_and_matches(backend_name):
    loss_fn = functools.partial(sharded_linear_cross_entropy, mesh=make_mesh(8, 1), batch_axes=("data", "vocab"))
    x, labels, w = random_problem(2, (21,), 16, 97)
    compare_with_oracle(backend_name, Case(use_weights=True, label_smoothing=0.2), x, labels, w, loss_fn=loss_fn)


def test_dw_comes_back_sharded_like_w():
    mesh = make_mesh(2, 4)
    x, labels, w = random_problem(3, (16,), 8, 64)
    w = jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, "vocab")))
    dw = jax.jit(jax.grad(lambda w_: sharded_linear_cross_entropy(x, labels, w_, mesh=mesh, vocab_axis="vocab")))(w)
    assert dw.sharding.is_equivalent_to(w.sharding, 2)


def test_return_lse_and_all_ignored():
    mesh = make_mesh(2, 4)
    x, labels, w = random_problem(4, (2, 5), 8, 40)
    loss, lse = jax.jit(lambda x_, w_: sharded_linear_cross_entropy(x_, labels, w_, mesh=mesh, vocab_axis="vocab",
                                                                    return_lse=True))(x, w)
    expected = oracle(x, labels, w)
    assert max_rel_error(lse, expected["lse"]) < 1e-6 and lse.shape == labels.shape
    assert max_rel_error(loss, expected["loss"]) < 1e-6
    ignored = np.full_like(labels, -100)
    value, grad = jax.jit(jax.value_and_grad(
        lambda w_: sharded_linear_cross_entropy(x, ignored, w_, mesh=mesh, vocab_axis="vocab")))(w)
    assert float(value) == 0.0 and not np.asarray(grad).any()


def test_inside_a_users_shard_map_with_vocab_axis_name():
    mesh = make_mesh(1, 8)
    x, labels, w = random_problem(5, (12,), 16, 80)

    @functools.partial(jax.shard_map, mesh=mesh,
                       in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(None, "vocab")),
                       out_specs=PartitionSpec())
    def loss_fn(x_, y_, w_):
        return linear_cross_entropy(x_, y_, w_, label_smoothing=0.1, vocab_axis_name="vocab")

    loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 2)))(x, labels, w)
    expected = oracle(x, labels, w, label_smoothing=0.1)
    assert max_rel_error(loss, expected["loss"]) < 1e-5
    assert max_rel_error(dx, expected["dx"]) < 1e-4 and max_rel_error(dw, expected["dw"]) < 1e-4


def test_vocab_axis_name_outside_shard_map_is_a_clear_error():
    x, labels, w = random_problem(6, (4,), 8, 16)
    with pytest.raises(ValueError, match="vocab_axis_name='vocab' is not a mesh axis bound here"):
        linear_cross_entropy(x, labels, w, vocab_axis_name="vocab")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(vocab_axis="model"), r"vocab_axis 'model' is not an axis of the mesh; mesh axes: \('data', 'vocab'\)"),
        (dict(batch_axes=("batch",)), r"batch axis 'batch' is not an axis of the mesh"),
        (dict(batch_axes=("data", "vocab"), vocab_axis="vocab"), r"vocab_axis 'vocab' is also one of batch_axes"),
        (dict(vocab_axis="vocab", reduction="max"), r"reduction must be one of"),
    ],
)
def test_bad_mesh_arguments(kwargs, match):
    x, labels, w = random_problem(7, (4,), 8, 16)
    with pytest.raises(ValueError, match=match):
        sharded_linear_cross_entropy(x, labels, w, mesh=make_mesh(2, 4), **kwargs)


def test_vocab_not_divisible_by_shards():
    x, labels, w = random_problem(8, (4,), 8, 18)
    with pytest.raises(ValueError, match=r"vocab size V=18 .* is not divisible by the 4 shards of vocab_axis='vocab'"):
        sharded_linear_cross_entropy(x, labels, w, mesh=make_mesh(2, 4), vocab_axis="vocab")


def test_concrete_bad_label_is_reported_with_global_vocab():
    x, labels, w = random_problem(9, (4,), 8, 16, ignore_fraction=0.0)
    labels[3] = 16
    with pytest.raises(ValueError, match=r"labels must be in \[0, 16\).*labels\[3\] = 16"):
        sharded_linear_cross_entropy(x, labels, w, mesh=make_mesh(2, 4), vocab_axis="vocab")


def test_pallas_tpu_in_interpret_mode_on_a_data_by_vocab_mesh(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    loss_fn = functools.partial(sharded_linear_cross_entropy, mesh=make_mesh(2, 2), vocab_axis="vocab")
    x, labels, w = random_problem(10, (2, 9), 128, 512)
    compare_with_oracle("pallas_tpu", SHARDED_CASES[-1], x, labels, w, loss_fn=loss_fn)


def test_the_generic_interpreter_is_refused_by_name_on_a_shard(monkeypatch):
    """Pallas' generic interpreter indexes per-device blocks with replicated values, which
    shard_map's varying-axes check refuses deep inside JAX (``dynamic_slice requires varying manual
    axes to match``); pallas_tpu refuses it first, naming the setting and the one that works, in
    ce_core's shard_map (before tracing) and in the caller's own (at trace time)."""
    from ce_core import UnsupportedError

    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "plain")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    mesh = make_mesh(2, 2)
    x, labels, w = random_problem(11, (2, 9), 48, 328)
    with pytest.raises(UnsupportedError, match=r"CE_PALLAS_TPU_INTERPRET=plain cannot run inside shard_map.*=1"):
        sharded_linear_cross_entropy(x, labels, w, mesh=mesh, vocab_axis="vocab", implementation="pallas_tpu")

    def per_device(x_, labels_, w_):
        return linear_cross_entropy(x_, labels_, w_, reduction="sum", implementation="pallas_tpu")[None]

    users = jax.shard_map(per_device, mesh=mesh, in_specs=(PartitionSpec("data"), PartitionSpec("data"),
                                                            PartitionSpec()), out_specs=PartitionSpec("data"))
    with pytest.raises(UnsupportedError, match="CE_PALLAS_TPU_INTERPRET=plain cannot run inside shard_map"):
        users(x, labels, w)
    # The same calls run with the TPU interpreter.
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    total = float(users(x, labels, w).sum())
    expected = float(linear_cross_entropy(x, labels, w, reduction="sum", implementation="reference"))
    assert abs(total - expected) <= 1e-5 * abs(expected)


@pytest.mark.slow
def test_pallas_tpu_sharded_over_a_v5p_2x2x1_topology_compiles(monkeypatch):
    from ce_pallas_tpu.tooling.aot import topology_devices

    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)  # compile the real kernels, not the interpreter
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    devices = topology_devices("v5p:2x2x1")
    mesh = Mesh(np.array(devices).reshape(2, 2), ("data", "vocab"))
    n, h, v = 8192, 4096, 128256

    def loss(x, labels, w):
        # The recompute path's bound (the kept path's float32 dw alone is a device's logits when N <= H per device:
        # its memory under vocab shards is tests/test_sharded_step.py's).
        return sharded_linear_cross_entropy(x, labels, w, mesh=mesh, vocab_axis="vocab", implementation="pallas_tpu",
                                            logsumexp_weight=1e-4, keep_logits=False)

    def arg(shape, dtype, *partition):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*partition)))

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 2))).lower(
        arg((n, h), jnp.bfloat16, "data", None), arg((n,), jnp.int32, "data"), arg((h, v), jnp.bfloat16, None, "vocab")
    ).compile()
    hlo = compiled.as_text()
    assert hlo is not None
    assert "tpu_custom_call" in hlo  # the Pallas kernels, not a fallback
    tokens, vocab = n // 2, v // 2  # per device
    memory = compiled.memory_analysis()
    assert memory is not None
    temp = memory.temp_size_in_bytes
    assert temp <= 4 * h * vocab + 8 * tokens * h  # pallas_tpu's bound: one f32 dw, two f32 dx
    assert temp < 4 * tokens * vocab  # less than one f32 copy of this device's logits


# --- the wrapper with meshes of any axis types and inputs of any layout ------------------------


def _make_mesh(axis_type, shape=(2, 4)):
    return jax.make_mesh(shape, ("data", "vocab"), axis_types=(axis_type,) * 2, devices=jax.devices("cpu")[:8])


@pytest.mark.covering(axis_type=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto), call=("jit", "eager"),
                      fast=1)
def test_wrapper_takes_a_make_mesh_mesh_and_ordinary_arrays(backend_name, axis_type, call):
    mesh = _make_mesh(axis_type)
    loss_fn = functools.partial(sharded_linear_cross_entropy, mesh=mesh, vocab_axis="vocab")
    x, labels, w = random_problem(11, (3, 11), 48, 328)
    compare_with_oracle(backend_name, SHARDED_CASES[-1], x, labels, w, loss_fn=loss_fn, jit=call == "jit")


@pytest.mark.covering(specs=[
    (PartitionSpec("data", None), PartitionSpec("data", None)),  # FSDP: w split over H
    (PartitionSpec(None, "vocab"), PartitionSpec("vocab", None)),  # both split the "wrong" way
    (PartitionSpec(("data", "vocab"), None), PartitionSpec(None, ("data", "vocab"))),
], backends="turns")
def test_wrapper_reshards_inputs_laid_out_otherwise_under_explicit_axes(backend_name, specs):
    x_spec, w_spec = specs
    mesh = _make_mesh(jax.sharding.AxisType.Explicit)
    x, labels, w = random_problem(12, (32,), 48, 320)
    options = LossOptions(label_smoothing=0.1, logsumexp_weight=1e-3)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, x_spec)
        ws = jax.device_put(w, w_spec)
        loss, (dx, dw) = jax.jit(jax.value_and_grad(
            lambda a, b: sharded_linear_cross_entropy(a, labels, b, mesh=mesh, vocab_axis="vocab",
                                                      implementation=backend_name, **options),
            argnums=(0, 1)))(xs, ws)
    expected = oracle(x, labels, w, **options)
    assert max_rel_error(loss, expected["loss"]) < 1e-5
    assert max_rel_error(dx, expected["dx"]) < 1e-4 and max_rel_error(dw, expected["dw"]) < 1e-4


def test_every_function_rejects_unknown_keyword_arguments_by_name():
    """Type checkers flag a misspelt option (the keywords are typed); at run time it is a ValueError."""
    x, labels, w = random_problem(13, (4,), 8, 16)
    misspelt: dict[str, Any] = {"label_smothing": 0.1}
    layout: dict[str, Any] = {"in_specs": None}  # the wrapper's layout is batch_axes/vocab_axis
    reduction: dict[str, Any] = {"reduction": "sum"}  # log-probabilities are per token
    unknown = r"unexpected keyword argument\(s\) \['label_smothing'\]; it takes \[.*'label_smoothing'"
    with pytest.raises(ValueError, match=r"sharded_linear_cross_entropy\(\) got " + unknown):
        sharded_linear_cross_entropy(x, labels, w, mesh=make_mesh(2, 4), **misspelt)
    with pytest.raises(ValueError, match=r"linear_cross_entropy\(\) got " + unknown):
        linear_cross_entropy(x, labels, w, **misspelt)
    with pytest.raises(ValueError, match=r"sharded_linear_cross_entropy\(\) got .*\['in_specs'\]"):
        sharded_linear_cross_entropy(x, labels, w, mesh=make_mesh(2, 4), **layout)
    with pytest.raises(ValueError, match=r"linear_log_probs\(\) got .*\['reduction'\]"):
        linear_log_probs(x, labels, w, **reduction)
