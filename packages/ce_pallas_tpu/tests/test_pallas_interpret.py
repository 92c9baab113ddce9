"""The real kernels in Pallas' TPU interpret mode against the float64 oracle.

Interpret mode runs with race detection (a race raises), out-of-bounds reads raising, and as many
simulated TensorCores as the target has: v5e (one core) and v5p (two cores, vocab split over them).
Shapes are small but span several blocks in every dimension, with ragged last blocks in N, V and H
(H not a multiple of 128) so that every masking path runs on NaN-filled garbage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call

import ce_pallas_tpu
from ce_core import BlockSizes, RowStats, StatsSpec, linear_cross_entropy
from ce_core.extend import Case, compare_with_oracle, random_problem
from ce_pallas_tpu import tile_stats
from ce_reference import row_stats as reference_row_stats


def _races_found() -> bool:
    """Whether the interpreter's race detection (on in the ``interpret`` fixture) saw a race."""
    races = interpret_pallas_call.races
    assert races is not None, "race detection is off"
    return races.races_found


ALL_FEATURES = Case(logsumexp_weight=1e-3, logit_soft_cap=2.0, label_smoothing=0.1)

# (target, batch shape, H, V, dtype, case, block sizes). Together: every feature, every reduction,
# weights, f32 and bf16, odd N, V and H, hidden-blocked and whole-hidden forwards, one and two cores.
PARITY_CASES = [
    ("v5p", (100,), 200, 300, "float32", ALL_FEATURES, BlockSizes(32, 128, 128)),
    ("v5e", (100,), 200, 300, "float32", ALL_FEATURES, BlockSizes(32, 128, 128)),
    ("v5p", (3, 47), 256, 700, "bfloat16", Case(reduction="sum", use_weights=True, label_smoothing=0.1),
     BlockSizes(64, None, 256)),
    ("v5e", (141,), 128, 513, "bfloat16", Case(reduction="none", logit_soft_cap=30.0, logsumexp_weight=1e-4),
     BlockSizes(48, None, 128)),
    ("v5p", (141,), 136, 513, "float32", Case(reduction="none", use_weights=True), BlockSizes(48, 128, 128)),
    ("v5e", (2, 64), 256, 384, "bfloat16", Case(use_weights=True, logsumexp_weight=1e-3), BlockSizes(64, 128, 128)),
    ("v5p", (256,), 128, 640, "bfloat16", Case(), None),
    # Tuned token blocks balanced over N (the backward's 256 rows become two blocks of 160).
    ("v5p", (300,), 200, 700, "bfloat16", Case(label_smoothing=0.1), BlockSizes(None, 128, 128)),
    ("v5e", (37,), 48, 203, "float32", Case(use_weights=True, label_smoothing=0.05), None),
    # v6e: the streamed forward step in chunks of 256 vocab columns (2 and 3 per block).
    ("v6e", (3, 47), 256, 1700, "bfloat16", Case(reduction="sum", use_weights=True, label_smoothing=0.1),
     BlockSizes(64, None, 512)),
    ("v6e", (100,), 200, 1300, "float32", ALL_FEATURES, BlockSizes(32, None, 768)),
]


#: The fast tier's parity cases (two cores, every feature hidden-blocked; bf16 with weights streamed; v6e's
#: column chunks); CI's interpreter tier (``pytest -m interpreter``) runs the others too.
FAST_PARITY = {0, 2, 9}


@pytest.mark.parametrize("target,batch_shape,hidden,vocab,dtype,case,blocks",
                         [row if k in FAST_PARITY else pytest.param(*row, marks=pytest.mark.interpreter)
                          for k, row in enumerate(PARITY_CASES)],
                         ids=lambda value: str(value) if not isinstance(value, Case) else "")
def test_parity_with_oracle(interpret, target, batch_shape, hidden, vocab, dtype, case, blocks):
    interpret(target)
    x, labels, w = random_problem(11, batch_shape, hidden, vocab)
    compare_with_oracle("pallas_tpu", case, x, labels, w, dtype=dtype, block_sizes=blocks)
    assert not _races_found()


@pytest.mark.parametrize("target", [pytest.param("v5e", marks=pytest.mark.interpreter), "v5p"])
def test_eager_tiny_problem(interpret, target):
    interpret(target)
    x, labels, w = random_problem(12, (1,), 8, 5)
    compare_with_oracle("pallas_tpu", Case(label_smoothing=0.1), x, labels, w, jit=False)


ROW_STATS_CASES = [
    *((target, blocks, 333) for target in ("v5e", "v5p")
      for blocks in (BlockSizes(32, 128, 128), BlockSizes(32, None, 128))),
    ("v6e", BlockSizes(32, None, 512), 1333),
]


@pytest.mark.slow
@pytest.mark.parametrize("target,blocks,vocab", ROW_STATS_CASES,
                         ids=["v5e-hidden-blocked", "v5e-streamed", "v5p-hidden-blocked", "v5p-streamed",
                              "v6e-streamed-in-column-chunks"])
def test_row_stats_and_vjp_match_the_reference(interpret, target, blocks, vocab):
    """The backend contract directly: all four statistics and their VJP for arbitrary cotangents.

    Labels outside ``[0, V)`` (those of another vocab shard) must give a label logit of 0. Both
    forward paths run (hidden blocked, and whole hidden with the streamed per-lane statistics, on
    v6e in chunks of 256 columns); on v5p the vocab is split over two cores, whose expected logits
    are merged by their share of mass.
    """
    interpret(target)
    x, labels, w = random_problem(13, (77,), 160, vocab, ignore_fraction=0.0)
    labels = labels.copy()
    labels[:5] = [-1, vocab, vocab + 67, -7, 1000 + vocab]
    spec = StatsSpec(logit_soft_cap=5.0, with_sum=True, with_expected=True, block_sizes=blocks)
    backend = ce_pallas_tpu.make_backend()
    x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
    ours, our_vjp = jax.vjp(lambda x_, w_: backend.row_stats(x_, w_, labels, spec), x, w)
    theirs, their_vjp = jax.vjp(lambda x_, w_: reference_row_stats(x_, w_, labels, spec), x, w)
    for name in ("lse", "label", "sum", "expected"):
        np.testing.assert_allclose(getattr(ours, name), getattr(theirs, name), rtol=2e-5, atol=2e-5, err_msg=name)
    assert np.all(np.asarray(ours.label)[:5] == 0.0)
    rng = np.random.default_rng(0)
    cotangent = RowStats(*(jnp.asarray(rng.standard_normal(77), jnp.float32) for _ in range(4)))
    for ours_grad, their_grad in zip(our_vjp(cotangent), their_vjp(cotangent), strict=True):
        np.testing.assert_allclose(ours_grad, their_grad, rtol=1e-4, atol=2e-5)
    # The contract's backward-only entry point, from the statistics alone.
    direct = backend.row_stats_vjp(x, w, labels, ours, cotangent, spec)
    for direct_grad, their_grad in zip(direct, their_vjp(cotangent), strict=True):
        np.testing.assert_allclose(direct_grad, their_grad, rtol=1e-4, atol=2e-5)
    assert not _races_found()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v6e", "v5p"])
@pytest.mark.parametrize("jump", [20.0, 100.0])
def test_streamed_forward_survives_logits_far_above_the_earlier_blocks(interpret, target, jump):
    """The whole-hidden forward takes a step's exps against each lane's maximum over the earlier blocks.

    Here one column of a middle block lies ``jump`` nats above every earlier logit of its row: 20 stays
    inside the margin (the step is streamed with terms up to e^20); 100 would overflow float32
    (e^100), so the step must be redone exactly. Rows whose label is that column check the label pick
    of the redone step; the vocab is ragged, and split over two cores on v5p.
    """
    interpret(target)
    vocab, spike = 1100, 600  # blocks of 256: the spike is in the third block, a ragged fifth
    x, labels, w = random_problem(17, (53,), 128, vocab, ignore_fraction=0.0)
    x, w, labels = x.copy(), w.copy(), labels.copy()
    x[:, 0] = 1.0  # a constant feature, so that one weight sets the spike column's logit in every row
    w[0, :] = 0.0
    w[0, spike] = jump
    labels[::3] = spike
    spec = StatsSpec(with_sum=True, with_expected=True, block_sizes=BlockSizes(32, None, 256))
    x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
    ours = ce_pallas_tpu.make_backend().row_stats(x, w, labels, spec)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.all(logits[:, spike] - np.delete(logits, spike, axis=1)[:, :512].max(axis=1) > jump - 10)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    probs = np.exp(logits - lse[:, None])
    expected = {"lse": lse, "label": logits[np.arange(53), np.asarray(labels)], "sum": logits.sum(1),
                "expected": (probs * logits).sum(1)}
    for name, value in expected.items():
        np.testing.assert_allclose(getattr(ours, name), value, rtol=2e-5, atol=2e-5, err_msg=name)
    assert not _races_found()


@pytest.mark.parametrize("sums,redo", [
    ([[1.0, 2.0], [3.0, tile_stats.OVERFLOW_SUM]], False),
    ([[1.0, 2.0], [3.0, tile_stats.OVERFLOW_SUM * 1.01]], True),
    ([[1.0, np.inf], [3.0, 4.0]], True),
    ([[np.nan, np.inf], [3.0, 4.0]], True),  # a max that takes NaN over inf still asks for the redo
    ([[np.inf, np.nan], [3.0, 4.0]], True),
    ([[np.nan, 1.0], [3.0, 4.0]], True),  # a NaN row alone is redone too (its redo changes nothing)
    ([[-np.nan, np.inf], [3.0, 4.0]], True),  # NaN with its sign bit set (x86's default NaN)
])
@pytest.mark.parametrize("interpreted", [False, True])
def test_overflow_check(sums, redo, interpreted):
    assert bool(tile_stats.overflowed(jnp.asarray(sums, jnp.float32), interpreted=interpreted)) is redo


@pytest.mark.parametrize("target", ["v6e", pytest.param("v5p", marks=pytest.mark.interpreter)])
def test_a_nan_row_does_not_hide_an_overflowing_one(interpret, target):
    """A streamed step is redone when its largest lane sum is not at most ``exp(30)``; a NaN sum fails
    that compare too, so a NaN row in the token block still lets the step be redone for the rows
    whose logits jumped 100 nats (e^100 overflows float32 if streamed). Only the NaN row is NaN."""
    interpret(target)
    vocab, spike = 1100, 600
    x, labels, w = random_problem(23, (40,), 128, vocab, ignore_fraction=0.0)
    x, w = x.copy(), w.copy()
    x[:, 0] = 1.0
    w[0, :] = 0.0
    w[0, spike] = 100.0
    x[5, 7] = np.nan  # one row of the first token block: every logit of it is NaN
    spec = StatsSpec(with_expected=True, block_sizes=BlockSizes(32, None, 256))
    ours = ce_pallas_tpu.make_backend().row_stats(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), spec)
    finite = np.arange(40) != 5
    logits = np.asarray(x, np.float64)[finite] @ np.asarray(w, np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    expected = {"lse": lse, "label": logits[np.arange(39), labels[finite]],
                "expected": (np.exp(logits - lse[:, None]) * logits).sum(1)}
    for name, value in expected.items():
        got = np.asarray(getattr(ours, name))
        assert np.isnan(got[5]), name
        np.testing.assert_allclose(got[finite], value, rtol=2e-5, atol=2e-5, err_msg=name)
    assert not _races_found()


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.interpreter), jnp.bfloat16])
def test_all_ignored_gives_zero_loss_and_gradients(interpret, dtype):
    interpret("v5p")
    x, _, w = random_problem(14, (40,), 128, 300)
    labels = np.full((40,), -100, np.int32)

    def loss_fn(x_, w_):
        return linear_cross_entropy(x_, labels, w_, logsumexp_weight=1e-2, label_smoothing=0.1,
                                    implementation="pallas_tpu", block_sizes=BlockSizes(16, None, 128))

    loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    assert float(loss) == 0.0
    assert not np.any(np.asarray(dx, np.float32)) and not np.any(np.asarray(dw, np.float32))


def test_return_lse_matches_float64(interpret):
    interpret("v5p")
    x, labels, w = random_problem(15, (2, 33), 96, 301)
    _, lse = linear_cross_entropy(x, labels, w, return_lse=True, implementation="pallas_tpu",
                                  block_sizes=BlockSizes(16, None, 128))
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(lse), np.log(np.exp(logits).sum(-1)), rtol=1e-5)


@pytest.mark.slow
def test_mixed_input_dtypes(interpret):
    interpret("v5e")
    x, labels, w = random_problem(16, (21,), 32, 65)
    grads = jax.grad(lambda x_, w_: linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu"),
                     argnums=(0, 1))(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32))
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32


@pytest.mark.slow
def test_generic_interpreter_works_under_checkpoint(monkeypatch):
    """The TPU interpreter orders its steps with io_callbacks, which jax.checkpoint cannot
    differentiate (``Effects not supported in AD of checkpoint/remat``); the generic interpreter
    (``CE_PALLAS_TPU_INTERPRET=plain``) has no effects and runs the same kernels under remat."""
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "plain")
    x, labels, w = random_problem(17, (64,), 128, 256)

    def loss(kind):
        def fn(x_, w_):
            return linear_cross_entropy(x_, labels, w_, implementation=kind, block_sizes=BlockSizes(32, None, 128))
        return fn

    grads = jax.jit(jax.grad(jax.checkpoint(loss("pallas_tpu")), argnums=(0, 1)))(x, w)
    expected = jax.grad(loss("reference"), argnums=(0, 1))(x, w)
    for ours, theirs in zip(grads, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def _float64_loss_and_grads(x, labels, w):
    """Mean cross-entropy of ``x @ w`` and its gradients in float64 (labels all valid)."""
    z = x @ w
    top = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
    rows = np.arange(len(labels))
    loss = np.mean(lse - z[rows, labels])
    p = np.exp(z - lse[:, None])
    p[rows, labels] -= 1
    p /= len(labels)
    return loss, p @ w.T, x.T @ p


@pytest.mark.slow
@pytest.mark.parametrize("precision,dw_tolerance", [(None, 1e-2), ("highest", 1e-5)])
def test_precision_with_bf16_activations_and_f32_weights(interpret, precision, dw_tolerance):
    """By default bf16 x with f32 w runs bf16 MXU passes (w rounded to bf16 in VMEM, float32
    accumulation): dw is then as exact as bf16 operands allow; "highest" keeps float32 products."""
    interpret("v5e")
    x, labels, w = random_problem(18, (128,), 256, 640, ignore_fraction=0.0)
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(w, jnp.float32)

    def loss_fn(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu", precision=precision,
                                    block_sizes=BlockSizes(64, None, 256))

    loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w)
    want_loss, want_dx, want_dw = _float64_loss_and_grads(np.asarray(x, np.float64), np.asarray(labels),
                                                          np.asarray(w, np.float64))
    assert abs(float(loss) - want_loss) <= 1e-4 * abs(want_loss)
    assert np.max(np.abs(np.asarray(dx, np.float64) - want_dx)) <= 1e-2 * np.max(np.abs(want_dx))  # dx is bf16
    dw_error = np.max(np.abs(np.asarray(dw, np.float64) - want_dw)) / np.max(np.abs(want_dw))
    assert dw_error <= dw_tolerance
    if precision is None:
        assert dw_error > 1e-5  # really bf16 passes, not float32 ones


def test_unknown_precision_is_refused(interpret):
    x, labels, w = random_problem(19, (8,), 16, 40)
    with pytest.raises(ValueError, match="precision"):
        linear_cross_entropy(x, labels, w, implementation="pallas_tpu", precision="fp8")
