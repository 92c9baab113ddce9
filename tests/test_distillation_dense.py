"""linear_distillation_loss with a dense teacher (both heads streamed, contract version 5) against the float64 oracle.

The backends that compute pair statistics: ``reference`` (both heads materialised), ``xla`` (token chunks of
whole rows; ``xla_chunked`` is the same backend with a tile budget of 8 rows, so ragged chunks overlap), and
``pallas_tpu``'s pair kernels in the race-checked interpreter (the ``interpreter`` tier, at the end).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
from ce_core import UnsupportedError, linear_distillation_loss
from ce_core.extend import FallbackWarning, register_backend, unregister_backend
from ce_core.testing import TOLERANCES, distillation_oracle, max_rel_error, random_problem
from ce_xla import XlaBackend

VOCAB = 203
PAIR_BACKENDS = ("reference", "xla", "xla_chunked")


@pytest.fixture(scope="module", autouse=True)
def _chunked_xla():
    """``xla`` holding 8 rows of ``VOCAB`` float32 logits per tile: several chunks, the last one overlapping."""
    register_backend("xla_chunked", lambda: XlaBackend(budget_bytes=4 * VOCAB * 8), replace=True)
    yield
    unregister_backend("xla_chunked")


def teacher(seed: int, tokens: tuple[int, ...], hidden: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A teacher's hidden states and ``[Ht, V]`` head, its logits of order 1."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*tokens, hidden)).astype(np.float32),
            (rng.standard_normal((hidden, vocab)) / np.sqrt(hidden)).astype(np.float32))


def layout(w: np.ndarray, name: str) -> np.ndarray:
    return w if name == "hv" else np.ascontiguousarray(w.T)


def check(x: Any, w: Any, teacher_x: Any, teacher_w: Any, labels: Any, *, dtype: str, w_layout: str = "hv",
          teacher_w_layout: str = "hv", **options: Any) -> None:
    """Value and the student's ``dx``, ``dw`` against the oracle (``"none"`` through ``sum(cotangent * loss)``)."""
    reduction = options.get("reduction", "mean")
    cotangent = np.linspace(-1.0, 2.0, int(np.prod(x.shape[:-1]))).reshape(x.shape[:-1])
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(layout(w, w_layout), dtype)
    txj, twj = jnp.asarray(teacher_x, dtype), jnp.asarray(layout(teacher_w, teacher_w_layout), dtype)

    def loss(a, b):
        out = linear_distillation_loss(a, b, txj, twj, labels, w_layout=w_layout, teacher_w_layout=teacher_w_layout,
                                       **options)
        return out if reduction != "none" else jnp.sum(out * cotangent)

    value, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xj, wj)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    oracle_options = {key: value for key, value in options.items() if key != "implementation"}
    expected = distillation_oracle(f32(xj), layout(f32(wj), w_layout), f32(txj), layout(f32(twj), teacher_w_layout),
                                   labels, cotangent=cotangent if reduction == "none" else None, **oracle_options)
    expected_value = expected["loss"] if reduction != "none" else np.sum(expected["loss"] * cotangent)
    assert dx.dtype == xj.dtype and dw.dtype == wj.dtype and dw.shape == wj.shape
    value_tol, grad_tol = TOLERANCES[dtype]
    errors = {"loss": max_rel_error(value, expected_value), "dx": max_rel_error(dx.astype(jnp.float32), expected["dx"]),
              "dw": max_rel_error(layout(f32(dw), w_layout), expected["dw"])}
    assert errors["loss"] <= value_tol and max(errors["dx"], errors["dw"]) <= grad_tol, errors


@pytest.mark.covering(pair_backend=PAIR_BACKENDS, divergence=("forward_kl", "reverse_kl", "jsd"),
                      reduction=("mean", "sum", "none"), temperature=("number", "per_token"),
                      caps=("none", "student", "both"), hard=(0.0, 0.3), layouts=("hv/hv", "vh/hv", "hv/vh"),
                      dtype=("float32", "bfloat16"), with_labels=(True, False),
                      require=[("pair_backend", "divergence")])
def test_a_dense_teacher_matches_the_float64_oracle(pair_backend, divergence, reduction, temperature, caps, hard,
                                                    layouts, dtype, with_labels):
    """Ragged tokens (leading batch dims) and vocabulary, ignored tokens, weights, a teacher of another width."""
    x, labels, w = random_problem(3, (3, 7), 24, VOCAB, ignore_fraction=0.25)
    teacher_x, teacher_w = teacher(4, (3, 7), 40, VOCAB)
    temp: Any = 0.8 if temperature == "number" else np.linspace(0.6, 1.4, 21, dtype=np.float32).reshape(3, 7)
    weights = np.linspace(0.5, 1.5, 21, dtype=np.float32).reshape(3, 7)
    student_layout, teacher_layout = layouts.split("/")
    check(x, w, teacher_x, teacher_w, labels if with_labels or hard else None, dtype=dtype, w_layout=student_layout,
          teacher_w_layout=teacher_layout, divergence=divergence, beta=0.3, reduction=reduction, temperature=temp,
          logit_soft_cap=None if caps == "none" else 2.5, teacher_logit_soft_cap=3.0 if caps == "both" else None,
          hard_label_weight=hard, weights=weights, implementation=pair_backend)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_dw_added_a_slice_of_columns_at_a_time_matches_the_oracle(monkeypatch, reduction):
    """``xla`` adds each chunk's ``dw`` 128 columns at a time here (the last slice overlapping the one before)."""
    from ce_xla import pair

    monkeypatch.setattr(pair, "DW_SLICE_BYTES", 4 * 24 * 128)
    x, labels, w = random_problem(25, (3, 7), 24, VOCAB)
    teacher_x, teacher_w = teacher(26, (3, 7), 40, VOCAB)
    check(x, w, teacher_x, teacher_w, labels, dtype="float32", w_layout="vh", divergence="jsd", reduction=reduction,
          implementation="xla_chunked")


@pytest.mark.parametrize(("reduction", "passes"), [("mean", 1), ("none", 2)])
def test_ignored_tokens_cost_no_chunk_on_xla(monkeypatch, reduction, passes):
    """A prompt of 15 ignored tokens in each of 3 sequences of 7 + 15: ``xla`` runs ``ceil(live / 8)`` chunks of its
    8-row tiles per pass (the live rows gathered to the front), not ``ceil(66 / 8)``; values as the oracle's."""
    from ce_core.extend import pair_logits as original
    from ce_xla import pair

    chunks: list[int] = []

    def counted(*args, **kwargs):
        jax.debug.callback(lambda: chunks.append(1))
        return original(*args, **kwargs)

    monkeypatch.setattr(pair, "pair_logits", counted)
    x, labels, w = random_problem(27, (3, 22), 24, VOCAB, ignore_fraction=0.0)
    labels[:, :15] = -100
    teacher_x, teacher_w = teacher(28, (3, 22), 40, VOCAB)
    check(x, w, teacher_x, teacher_w, labels, dtype="float32", divergence="reverse_kl", reduction=reduction,
          implementation="xla_chunked")
    assert len(chunks) == passes * -(-21 // 8)


def test_a_scalar_loss_forms_the_gradient_in_its_forward_pass_and_a_per_token_one_recomputes(monkeypatch):
    """``"mean"``: one pass (``pair_row_stats_and_grads``), its backward never recomputes; ``"none"``: the
    statistics, then ``pair_row_stats_vjp`` in the backward. The teacher takes zero gradient either way."""
    backend = ce_core.get_backend("xla")
    calls: list[str] = []
    for method in ("pair_row_stats", "pair_row_stats_vjp", "pair_row_stats_and_grads"):
        original = getattr(backend, method)

        def recorded(*args, _original=original, _method=method, **kwargs):
            calls.append(_method)
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, method, recorded)
    x, labels, w = random_problem(5, (13,), 16, 57)
    teacher_x, teacher_w = teacher(6, (13,), 20, 57)
    for reduction, expected in (("mean", ["pair_row_stats_and_grads"]),
                                ("none", ["pair_row_stats", "pair_row_stats_vjp"])):
        calls.clear()

        def loss(a, b, c, d, reduction=reduction):
            return jnp.sum(linear_distillation_loss(a, b, c, d, labels, divergence="jsd", reduction=reduction,
                                                    implementation="xla"))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, teacher_x, teacher_w)
        assert calls == expected, (reduction, calls)
        assert not np.asarray(grads[2]).any() and not np.asarray(grads[3]).any()
        oracle = distillation_oracle(x, w, teacher_x, teacher_w, labels, divergence="jsd", reduction=reduction)
        assert max_rel_error(grads[1], oracle["dw"]) <= 1e-5


def test_the_jsd_ends_are_the_kls_and_identical_heads_diverge_by_nothing():
    """``beta = 0`` is the forward KL and ``beta = 1`` the reverse KL (TRL's convention); a teacher equal to the
    student gives 0 and a zero gradient for every divergence."""
    x, labels, w = random_problem(7, (9,), 16, 31)
    teacher_x, teacher_w = teacher(8, (9,), 12, 31)
    value = jax.jit(lambda d, b: linear_distillation_loss(x, w, teacher_x, teacher_w, labels, divergence=d, beta=b),
                    static_argnums=(0, 1))
    assert float(value("jsd", 0.0)) == float(value("forward_kl", 0.5))
    assert float(value("jsd", 1.0)) == float(value("reverse_kl", 0.5))
    assert float(value("forward_kl", 0.5)) != float(value("reverse_kl", 0.5))
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        loss, dx = jax.jit(jax.value_and_grad(lambda a, d=divergence: linear_distillation_loss(
            a, w, x, w, labels, divergence=d)))(x)
        assert abs(float(loss)) <= 1e-6 and float(jnp.max(jnp.abs(dx))) <= 1e-6


def test_ignored_tokens_count_for_nothing_even_with_nan_hidden_states():
    """All ignored: 0 and zero gradients; NaN rows of either head at ignored tokens leave the rest exact."""
    x, labels, w = random_problem(10, (2, 5), 16, 40)
    teacher_x, teacher_w = teacher(11, (2, 5), 20, 40)

    @jax.jit
    def value_and_grads(a, c, y):
        return jax.value_and_grad(lambda a_, b_: linear_distillation_loss(
            a_, b_, c, teacher_w, y, divergence="reverse_kl", hard_label_weight=0.2), argnums=(0, 1))(a, w)

    value, (dx, dw) = value_and_grads(x, teacher_x, np.full((2, 5), -100, np.int32))
    assert float(value) == 0.0 and not np.asarray(dx).any() and not np.asarray(dw).any()
    labels[0, :2] = -100
    poisoned, poisoned_teacher = x.copy(), teacher_x.copy()
    poisoned[0, 0] = np.nan
    poisoned_teacher[0, 1] = np.nan
    value, (dx, dw) = value_and_grads(poisoned, poisoned_teacher, labels)
    expected = distillation_oracle(x, w, teacher_x, teacher_w, labels, divergence="reverse_kl", hard_label_weight=0.2)
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
    assert max_rel_error(value, expected["loss"]) <= 1e-5 and max_rel_error(dw, expected["dw"]) <= 1e-4
    assert not np.asarray(dx)[0, :2].any()


def test_a_padded_teacher_table_is_cut_to_vocab_size():
    """Qwen2.5-7B's 152064 rows against 1.5B's 151936, in small: the first ``vocab_size`` entries of both heads."""
    x, labels, w = random_problem(12, (8,), 16, 50)
    teacher_x, teacher_w = teacher(13, (8,), 24, 64)
    with pytest.raises(ValueError, match=r"student's vocabulary \(50\) and the teacher's \(64\) differ"):
        linear_distillation_loss(x, w, teacher_x, teacher_w, labels)
    value, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b: linear_distillation_loss(
        a, b, teacher_x, teacher_w.T, labels, vocab_size=50, teacher_w_layout="vh", divergence="jsd"),
        argnums=(0, 1)))(x, w)
    expected = distillation_oracle(x, w, teacher_x, teacher_w, labels, vocab_size=50, divergence="jsd")
    assert max_rel_error(value, expected["loss"]) <= 1e-5 and max_rel_error(dx, expected["dx"]) <= 1e-4
    assert max_rel_error(dw, expected["dw"]) <= 1e-4


def test_traced_bad_temperatures_make_their_tokens_nan_never_clamped():
    x, labels, w = random_problem(15, (4,), 8, 20, ignore_fraction=0.0)
    teacher_x, teacher_w = teacher(16, (4,), 8, 20)
    per_token = jax.jit(lambda t: linear_distillation_loss(x, w, teacher_x, teacher_w, labels, temperature=t,
                                                           reduction="none"))(np.array([1.0, 0.0, 2.0, -1.0]))
    assert np.isnan(np.asarray(per_token)[[1, 3]]).all() and np.isfinite(np.asarray(per_token)[[0, 2]]).all()


def test_backends_before_contract_version_5_are_refused_by_name():
    """A version-4 backend declines the pair (an ``UnsupportedError`` naming it and version 5); in a chain the
    call falls back, warning once."""

    class Version4(XlaBackend):
        name = "xla_v4"
        contract_version = 4

    register_backend("xla_v4", Version4)
    try:
        x, labels, w = random_problem(17, (4,), 8, 20)
        teacher_x, teacher_w = teacher(18, (4,), 8, 20)
        with pytest.raises(UnsupportedError, match=r"'xla_v4' implements contract version 4.*version 5: the pair"):
            linear_distillation_loss(x, w, teacher_x, teacher_w, labels, implementation="xla_v4")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = linear_distillation_loss(x, w, teacher_x, teacher_w, labels, implementation=("xla_v4", "xla"))
        assert any(issubclass(w_.category, FallbackWarning) and "xla_v4" in str(w_.message) for w_ in caught)
        assert max_rel_error(value, distillation_oracle(x, w, teacher_x, teacher_w, labels)["loss"]) <= 1e-5
    finally:
        unregister_backend("xla_v4")


def test_the_chunked_pass_holds_no_tokens_by_vocab_buffer():
    """Compiled for CPU, value_and_grad of the mean loss at 8192 tokens x 4096 entries (one float32 ``[N, V]``
    would be 128 MiB): temporaries stay under a sixteenth of it with 1 MiB tiles."""
    register_backend("xla_small_tiles", lambda: XlaBackend(budget_bytes=2**20), replace=True)
    try:
        n, v = 8192, 4096
        shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n, 32), (32, v), (n, 64), (64, v))]
        labels = jax.ShapeDtypeStruct((n,), jnp.int32)
        step = jax.jit(jax.value_and_grad(lambda a, b, c, d, y: linear_distillation_loss(
            a, b, c, d, y, divergence="jsd", implementation="xla_small_tiles"), argnums=(0, 1)))
        memory = step.lower(*shapes, labels).compile().memory_analysis()
        assert memory is not None
        assert memory.temp_size_in_bytes < n * v * 4 // 16, memory.temp_size_in_bytes
    finally:
        unregister_backend("xla_small_tiles")


def test_bad_dense_calls_are_clear_errors():
    x, labels, w = random_problem(19, (4,), 8, 20)
    teacher_x, teacher_w = teacher(20, (4,), 8, 20)
    with pytest.raises(ValueError, match="both teacher_x and teacher_w"):
        linear_distillation_loss(x, w, teacher_x, None, labels)
    with pytest.raises(ValueError, match=r"teacher_x must be \[..., Ht\] over x's tokens"):
        linear_distillation_loss(x, w, teacher_x[:3], teacher_w, labels)
    with pytest.raises(ValueError, match="beta must be in"):
        linear_distillation_loss(x, w, teacher_x, teacher_w, labels, divergence="jsd", beta=1.5)
    with pytest.raises(ValueError, match="teacher_logit_soft_cap"):
        linear_distillation_loss(x, w, teacher_x, teacher_w, labels, teacher_logit_soft_cap=0.0)
    with pytest.raises(ValueError, match="teacher_w must be a 2-D head"):
        linear_distillation_loss(x, w, teacher_x, teacher_w[None], labels)
    with pytest.raises(ValueError, match="teacher_w_layout"):
        linear_distillation_loss(x, w, teacher_x, teacher_w, labels, teacher_w_layout="vhh")
    with pytest.raises(ValueError, match="vocab_size must be an int in"):
        linear_distillation_loss(x, w, teacher_x, teacher_w, labels, vocab_size=21)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_distillation_loss(x, w, teacher_x, teacher_w, labels, temperature=0.0)


@pytest.mark.covering(axis_type=("explicit", "auto"), divergence=("forward_kl", "reverse_kl", "jsd"),
                      reduction=("mean", "none"), pair_backend=("reference", "xla"))
def test_over_a_mesh_splitting_tokens_and_vocab_matches_the_oracle(axis_type, divergence, reduction, pair_backend):
    """Tokens over "data"; both heads' vocabularies over "model" (the teacher's a tied ``[V, Ht]`` table) under
    Explicit axes, every token split and the heads whole under Auto axes (the default layout)."""
    check_on_a_mesh(axis_type, "jit", divergence, reduction, pair_backend)


@pytest.mark.parametrize(("divergence", "expected"), [
    ("reverse_kl", ["pair_row_stats", "pair_row_stats_vjp"]),
    ("jsd", ["pair_row_stats", "pair_row_stats", "pair_row_stats_vjp"]),
])
def test_a_vocab_split_takes_two_passes_for_a_kl_and_three_for_the_jsd(monkeypatch, divergence, expected):
    """Vocab shards: a KL is combined from each shard's own statistics (the chain rule), so a scalar loss runs
    the statistics and the gradient; the JSD's mixture needs the combined lses first, a pass more. Values and
    gradients the oracle's, with KLs small beside the lses (a near copy of the student for teacher). The passes
    are counted as they run (a callback per call on each of the 4 devices), not as they are traced."""
    backend = ce_core.get_backend("xla")
    calls: list[str] = []
    for method in ("pair_row_stats", "pair_row_stats_vjp", "pair_row_stats_and_grads"):
        original = getattr(backend, method)

        def recorded(*args, _original=original, _method=method, **kwargs):
            jax.debug.callback(lambda: calls.append(_method))
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, method, recorded)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu")[:4])
    x, labels, w = random_problem(25, (12,), 24, 130, ignore_fraction=0.2)
    noise = np.random.default_rng(26).standard_normal(w.shape).astype(np.float32)
    teacher_w = w + 0.05 * noise  # a KL of order 1e-3 per token, lses of order 5
    expected_values = distillation_oracle(x, w, x, teacher_w, labels, divergence=divergence, temperature=0.7)
    with jax.set_mesh(mesh):
        def put(value, *spec):
            return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.P(*spec)))

        a, b, y = put(x, "data", None), put(w, None, "model"), put(labels, "data")
        c, d = put(x, "data", None), put(teacher_w, None, "model")

        def loss(a_, b_):
            return linear_distillation_loss(a_, b_, c, d, y, divergence=divergence, temperature=0.7,
                                            implementation="xla")

        value, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(a, b)
    jax.effects_barrier()
    assert sorted(calls) == sorted(expected * 4), calls
    assert max_rel_error(value, expected_values["loss"]) <= 1e-5
    assert max_rel_error(dx, expected_values["dx"]) <= 1e-4 and max_rel_error(dw, expected_values["dw"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_eager_calls_over_a_mesh_match_the_oracle(axis_type):
    """Outside ``jit``: under Auto axes the call compiles its sharded pair as one program (the inputs' abstract
    mesh cannot lay them out op by op)."""
    check_on_a_mesh(axis_type, "eager", "jsd", "none", "xla")


def check_on_a_mesh(axis_type: str, call: str, divergence: str, reduction: str, pair_backend: str,
                    vocab_shards: int = 4) -> None:
    kind = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, vocab_shards), ("data", "model"), axis_types=(kind, kind),
                         devices=jax.devices("cpu")[:2 * vocab_shards])
    x, labels, w = random_problem(21, (4, 6), 32, 320, ignore_fraction=0.2)
    teacher_x, teacher_w = teacher(22, (4, 6), 48, 320)
    options: dict[str, Any] = dict(divergence=divergence, temperature=0.8, hard_label_weight=0.2, logit_soft_cap=3.0,
                                   reduction=reduction)
    cotangent = np.linspace(-1.0, 2.0, 24).reshape(4, 6)
    expected = distillation_oracle(x, w, teacher_x, teacher_w, labels, **options,
                                   cotangent=cotangent if reduction == "none" else None)
    with jax.set_mesh(mesh):
        def put(value, *spec):
            return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.P(*spec)))

        a, b, y = put(x, "data", None, None), put(w, None, "model"), put(labels, "data")
        c, d = put(teacher_x, "data", None, None), put(np.ascontiguousarray(teacher_w.T), "model", None)

        def loss(a_, b_):
            out = linear_distillation_loss(a_, b_, c, d, y, teacher_w_layout="vh", implementation=pair_backend,
                                           **options)
            return jnp.sum(out * cotangent) if reduction == "none" else out

        step = jax.value_and_grad(loss, argnums=(0, 1))
        value, (dx, dw) = (jax.jit(step) if call == "jit" else step)(a, b)
    expected_value = np.sum(expected["loss"] * cotangent) if reduction == "none" else expected["loss"]
    assert max_rel_error(value, expected_value) <= 1e-5
    assert max_rel_error(dx, expected["dx"]) <= 1e-4 and max_rel_error(dw, expected["dw"]) <= 1e-4


def test_inside_the_callers_shard_map_each_token_shard_is_its_own_problem():
    """Per-token losses inside a ``shard_map`` over the tokens, the heads whole on every shard: the oracle's."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices("cpu")[:4])
    x, labels, w = random_problem(23, (8, 3), 16, 90)
    teacher_x, teacher_w = teacher(24, (8, 3), 24, 90)
    expected = distillation_oracle(x, w, teacher_x, teacher_w, labels, divergence="reverse_kl", reduction="none")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(jax.P("data"), jax.P(), jax.P("data"), jax.P(),
                                                           jax.P("data")), out_specs=jax.P("data"))
    def per_token(a, b, c, d, y):
        return linear_distillation_loss(a, b, c, d, y, divergence="reverse_kl", reduction="none")

    with jax.set_mesh(mesh):
        tokens = jax.sharding.NamedSharding(mesh, jax.P("data"))
        got = per_token(*(jax.device_put(value, tokens if value.shape[0] == 8 else jax.sharding.NamedSharding(
            mesh, jax.P())) for value in (x, w, teacher_x, teacher_w, labels)))
    assert max_rel_error(got, expected["loss"]) <= 1e-5


# ---------------------------------------------------------------------------------------------
# pallas_tpu's pair kernels (ce_pallas_tpu.pair) in the race-checked TPU interpreter, tiles small enough that a call
# takes several token blocks, gradient chunks (the last one overlapping) and vocab blocks.


@pytest.fixture
def pallas_interpreter(monkeypatch):
    """pallas_tpu's kernels interpreted for a target set by the returned function, with tiny tiles."""
    from ce_pallas_tpu import pair

    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    monkeypatch.setattr(pair, "BLOCKS", (16, 32, 256))  # two 128-column slices a statistics step
    monkeypatch.setattr(pair, "STREAMED_STATS", ("v5p",))  # both statistics updates: exact on v5e, streamed on v5p
    jax.clear_caches()
    yield lambda target: monkeypatch.setenv("CE_PALLAS_TPU_TARGET", target)
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.interpreter
@pytest.mark.covering(target=("v5e", "v5p"), divergence=("forward_kl", "reverse_kl", "jsd"),
                      reduction=("mean", "none"), temperature=("number", "per_token"),
                      caps=("none", "student", "both"), layouts=("hv/hv", "vh/hv", "hv/vh"),
                      dtype=("float32", "bfloat16"), vocab=(500, 650), require=[("target", "divergence"),
                                                                                ("target", "vocab")])
def test_pallas_tpu_pair_kernels_match_the_float64_oracle(pallas_interpreter, target, divergence, reduction,
                                                          temperature, caps, layouts, dtype, vocab):
    """Ragged tokens (3 x 15: two gradient chunks, the second overlapping) and vocabularies (500: 2 blocks, one per
    v5p core; 650: 3 blocks, the second core a block short), hidden sizes no multiple of 128, ignored tokens,
    weights, hard labels."""
    pallas_interpreter(target)
    x, labels, w = random_problem(31, (3, 15), 40, vocab, ignore_fraction=0.25)
    teacher_x, teacher_w = teacher(32, (3, 15), 72, vocab)
    temp: Any = 0.8 if temperature == "number" else np.linspace(0.6, 1.4, 45, dtype=np.float32).reshape(3, 15)
    student_layout, teacher_layout = layouts.split("/")
    check(x, w, teacher_x, teacher_w, labels, dtype=dtype, w_layout=student_layout, teacher_w_layout=teacher_layout,
          divergence=divergence, beta=0.3, reduction=reduction, temperature=temp,
          logit_soft_cap=None if caps == "none" else 2.5, teacher_logit_soft_cap=3.0 if caps == "both" else None,
          hard_label_weight=0.2, weights=np.linspace(0.5, 1.5, 45, dtype=np.float32).reshape(3, 15),
          implementation="pallas_tpu")


@pytest.mark.interpreter
def test_pallas_tpu_pair_statistics_of_a_vocab_shard_given_the_whole_rows_lses(pallas_interpreter):
    """The shard's part of each sum (``lse`` given): the two halves of a vocabulary add up to the whole rows' sums,
    as the reference backend computes them; without ``lse`` a KL comes in one pass and the JSD in two."""
    from ce_core.extend import PairSpec

    pallas_interpreter("v5e")
    pallas, reference = ce_core.get_backend("pallas_tpu"), ce_core.get_backend("reference")
    x, _, w = (jnp.asarray(value) for value in random_problem(33, (40,), 40, 300))
    teacher_x, teacher_w = (jnp.asarray(value) for value in teacher(34, (40,), 72, 300))
    scale = jnp.asarray(np.linspace(0.7, 1.3, 40, dtype=np.float32))
    for divergence in ("reverse_kl", "jsd"):  # one KL in one pass (the other: the oracle tests), and the JSD
        spec = PairSpec(divergence=divergence, beta=0.3, logit_soft_cap=4.0)
        whole = reference.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale=scale)
        got = pallas.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale=scale)
        assert max_rel_error(got.lse, whole.lse) <= 1e-6 and max_rel_error(got.teacher_lse, whole.teacher_lse) <= 1e-6
        assert max_rel_error(got.divergence, whole.divergence) <= 1e-5
        lse = (whole.lse, whole.teacher_lse)
        halves = [pallas.pair_row_stats(x, w[:, cut], teacher_x, teacher_w[:, cut], spec, row_scale=scale, lse=lse)
                  for cut in (slice(0, 170), slice(170, 300))]
        assert max_rel_error(halves[0].divergence + halves[1].divergence, whole.divergence) <= 1e-5
        if divergence == "jsd":
            assert whole.student_term is not None and got.student_term is not None
            assert max_rel_error(got.student_term, whole.student_term) <= 1e-5
            summed = halves[0].student_term + halves[1].student_term  # type: ignore[operator]
            assert max_rel_error(summed, whole.student_term) <= 1e-5


@pytest.mark.interpreter
def test_pallas_tpu_pair_statistics_redo_a_streamed_step_whose_sums_overflow(pallas_interpreter):
    """A vocab block after a row's first is streamed (its exps against each lane's reference from earlier blocks);
    logits 100 nats above the references (the student's in the second block, the teacher's in the ragged third, a
    few rows each) overflow float32 there, so those steps must be redone exactly: every statistic matches the
    materialised reference's, with every token counted and with a block of ignored ones (the kernel that walks the
    counted blocks)."""
    from ce_core.extend import PairSpec

    pallas_interpreter("v5p")  # streamed (the fixture)
    pallas, reference = ce_core.get_backend("pallas_tpu"), ce_core.get_backend("reference")
    x, _, w = random_problem(37, (40,), 40, 700)
    teacher_x, teacher_w = teacher(38, (40,), 72, 700)
    x[:, 0], teacher_x[:, 0] = 1.0, 1.0
    w[0, :], teacher_w[0, :] = 0.0, 0.0
    w[0, 300:303] = 100.0  # 256-column blocks: the second block, lanes 44-46
    teacher_w[0, 600] = 100.0  # the third (ragged) block
    x[5:9, 0] = -1.0  # some rows without the spikes: their steps stream through
    teacher_x[20:24, 0] = -1.0
    x, w, teacher_x, teacher_w = (jnp.asarray(value) for value in (x, w, teacher_x, teacher_w))
    scale = jnp.ones((40,), jnp.float32)
    second_block_ignored = jnp.asarray(np.arange(40) // 16 != 1)
    for divergence, live in (("forward_kl", None), ("reverse_kl", second_block_ignored), ("jsd", None)):
        spec = PairSpec(divergence=divergence, beta=0.3)  # one pass of each KL; the JSD's lses pass
        counted = slice(None) if live is None else np.asarray(live)  # what a backend gives the others is not read
        want = reference.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale=scale, live=live)
        got = pallas.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale=scale, live=live)
        for name in ("lse", "teacher_lse", "divergence"):
            error = max_rel_error(getattr(got, name)[counted], getattr(want, name)[counted])
            assert error <= (1e-5 if name == "divergence" else 1e-6), (divergence, name, error)


@pytest.mark.interpreter
def test_pallas_tpu_ignored_tokens_count_for_nothing_even_with_nan_hidden_states(pallas_interpreter, monkeypatch):
    """NaN rows of either head at ignored tokens, in a token block with counted ones, leave the divergence and its
    gradients exact: the pair kernels zero dead rows, never multiply them by a zero cotangent. (Without
    ``hard_label_weight``: pallas_tpu's cross-entropy kernels need such rows finite, README "Ignored tokens".)"""
    from ce_pallas_tpu import pair

    pallas_interpreter("v5p")
    monkeypatch.setattr(pair, "BLOCKS", None)  # the rule's tiles: 40 rows, two gradient chunks of 32 (overlapping)
    x, labels, w = random_problem(35, (2, 20), 40, 256)
    teacher_x, teacher_w = teacher(36, (2, 20), 72, 256)
    labels[0, :3] = -100
    poisoned, poisoned_teacher = x.copy(), teacher_x.copy()
    poisoned[0, 0] = np.nan
    poisoned_teacher[0, 1] = np.nan

    def loss(a, b):
        return linear_distillation_loss(a, b, poisoned_teacher, teacher_w, labels, divergence="jsd",
                                        implementation="pallas_tpu")

    value, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(poisoned, w)
    expected = distillation_oracle(x, w, teacher_x, teacher_w, labels, divergence="jsd")
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
    assert max_rel_error(value, expected["loss"]) <= 1e-5 and max_rel_error(dw, expected["dw"]) <= 1e-4
    assert not np.asarray(dx)[0, :3].any()


@pytest.mark.slow  # 14 s in the race-checked interpreter (the interpreter tier's second heaviest)
@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_pallas_tpu_pair_kernels_skip_token_blocks_without_a_counted_token(pallas_interpreter, monkeypatch,
                                                                          divergence):
    """Each product of the pair kernels runs once per token block (statistics) or chunk (gradient) holding a counted
    token, none for the others (a counter in the interpreted products, against the count with none ignored), and
    the values still match the oracle. v5p: the statistics' token blocks spread over two cores' shares."""
    from ce_pallas_tpu import common

    pallas_interpreter("v5p")
    n = 64  # statistics: four blocks of 16; gradient: two chunks of 32
    x, labels, w = random_problem(39, (n,), 40, 300)
    teacher_x, teacher_w = teacher(40, (n,), 72, 300)
    products = ("matmul", "matmul_nt", "matmul_tn")
    counters: dict[str, list[int]] = {name: [] for name in products}
    for name in products:
        original = getattr(common, name)

        def counted(*args, _original=original, _counter=counters[name], **kwargs):
            jax.debug.callback(lambda: _counter.append(1))
            return _original(*args, **kwargs)

        monkeypatch.setattr(common, name, counted)
    second_half = labels.copy()
    second_half[:32] = -100
    second_half[[40, 63]] = -100  # ignored tokens inside a counted block: computed, inert
    first_and_last = np.where((np.arange(n) // 16) % 3 == 0, labels, -100)  # blocks 0 and 3: both chunks
    patterns = {"none": labels, "all": np.full(n, -100, np.int32), "second half": second_half,
                "first and last": first_and_last}
    if divergence == "reverse_kl":  # its one pass skips as the JSD's passes do: the halving is enough here
        patterns = {pattern: patterns[pattern] for pattern in ("none", "second half")}
    counts = {}
    for pattern, pattern_labels in patterns.items():
        for counter in counters.values():
            counter.clear()
        jax.clear_caches()
        check(x, w, teacher_x, teacher_w, pattern_labels, dtype="float32", divergence=divergence, beta=0.3,
              implementation="pallas_tpu")
        counts[pattern] = {name: len(counter) for name, counter in counters.items()}
    for name in ("matmul", "matmul_tn"):  # the logits of both heads (and dx), dw
        assert counts["none"][name] > 0 and counts.get("all", {name: 0})[name] == 0, (name, counts)
        assert 2 * counts["second half"][name] == counts["none"][name], (name, counts)
    if "first and last" in counts:  # blocks 0 and 3: half the statistics blocks, both gradient chunks
        assert counts["first and last"]["matmul_tn"] == counts["none"]["matmul_tn"], counts


@pytest.mark.interpreter
@pytest.mark.parametrize(("axis_type", "divergence"), [("explicit", "jsd"), ("auto", "forward_kl")])
def test_pallas_tpu_over_a_mesh_splitting_tokens_and_vocab_matches_the_oracle(pallas_interpreter, axis_type,
                                                                              divergence):
    """Both heads' vocabularies split over "model" (a KL combined from each shard's own statistics, the JSD's
    second pass given the combined lses) under Explicit axes; the default layout under Auto axes. On a 2 x 2
    mesh: the interpreter runs each device's kernels in turn."""
    pallas_interpreter("v5e")
    check_on_a_mesh(axis_type, "jit", divergence, "mean", "pallas_tpu", vocab_shards=2)
