"""The forward kernels at contract version 3 against the float64 oracle: ``[V, H]`` heads, max/argmax
and a per-row scale, alone and together (``ops.row_stats`` directly; the backend joins at version 3).

Interpret mode runs with race detection and as many simulated TensorCores as the target has (v5e
one, v5p two: the vocab split over them). N, V and H are ragged against every block (H not a
multiple of 128), both forward kernels run (hidden blocked, and whole hidden: streamed per lane),
and the argmax ties are deliberate: equal maximal columns in one lane, in different lanes, in
different blocks and in different cores' halves, also in a ragged last block.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call

from ce_core import BlockSizes, StatsSpec
from ce_core.extend import random_problem, stats_oracle
from ce_pallas_tpu import forward, ops
from ce_pallas_tpu.forward import forward_call, label_logits
from ce_pallas_tpu.target import Target

N, H, V = 77, 200, 700  # ragged against blocks of 32 tokens and 128/256 columns; H pads to 256

FEATURES = {"vh": {"w_layout": "vh"}, "argmax": {"with_argmax": True}, "row_scale": {"with_row_scale": True}}
ALL = ("vh", "argmax", "row_scale")
STREAMED, BLOCKED = BlockSizes(32, None, 256), BlockSizes(32, 128, 128)


def _races_found() -> bool:
    races = interpret_pallas_call.races
    assert races is not None, "race detection is off"
    return races.races_found


def _spec(features, cap, blocks) -> StatsSpec:
    options = {key: value for feature in features for key, value in FEATURES[feature].items()}
    return StatsSpec(logit_soft_cap=cap, with_sum=True, with_expected=True, block_sizes=blocks, **options)


def _run(x, w, labels, spec: StatsSpec, row_scale):
    """The statistics from the kernels, under jit, for numpy inputs (w already in the spec's layout)."""
    scale = None if row_scale is None else jnp.asarray(row_scale)
    fn = jax.jit(lambda x_, w_, y_, s_: ops.row_stats(x_, w_, y_, spec, row_scale=s_))
    return fn(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), scale)


def _problem(seed: int, dtype: str, layout: str, with_scale: bool):
    x, labels, w = random_problem(seed, (N,), H, V, ignore_fraction=0.0)
    labels = labels.copy()
    labels[:4] = [-1, V, V + 300, -100]  # another shard's labels: a label logit of 0
    if layout == "vh":
        w = np.ascontiguousarray(w.T)
    scale = np.random.default_rng(seed).uniform(0.5, 2.0, N).astype(np.float32) if with_scale else None
    if dtype == "bfloat16":
        x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    return x, w, labels, scale


def _check(ours, oracle, spec: StatsSpec, dtype: str) -> None:
    tol = 2e-5 if dtype == "float32" else 1e-4
    for name in ("lse", "label", "sum", "expected"):
        np.testing.assert_allclose(np.asarray(getattr(ours, name)), oracle[name], rtol=tol, atol=tol, err_msg=name)
    if not spec.with_argmax:
        assert ours.max is None and ours.argmax is None
        return
    assert ours.argmax is not None and ours.argmax.dtype == jnp.int32 and ours.max is not None
    np.testing.assert_allclose(np.asarray(ours.max), oracle["max"], rtol=tol, atol=tol, err_msg="max")
    index = np.asarray(ours.argmax)
    assert np.all((index >= 0) & (index < V))
    # Random logits may have a runner-up within rounding of the max: the index must hold the max.
    agree = index == oracle["argmax"]
    assert agree.mean() > 0.9, agree.mean()
    assert np.all(np.abs(oracle["z"][np.arange(N), index] - oracle["max"]) <= tol * (1 + np.abs(oracle["max"])))


def _oracle(x, w, labels, spec: StatsSpec, scale):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    result = stats_oracle(x64, w64, labels, w_layout=spec.w_layout, logit_soft_cap=spec.logit_soft_cap,
                          row_scale=scale)
    w_hv = w64 if spec.w_layout == "hv" else w64.T
    raw = x64 @ w_hv
    capped = raw if spec.logit_soft_cap is None else spec.logit_soft_cap * np.tanh(raw / spec.logit_soft_cap)
    result["z"] = capped * (1.0 if scale is None else np.asarray(scale, np.float64)[:, None])
    return result


# (target, blocks, features, soft cap, dtype): every feature alone and all together, both kernels,
# one and two cores, soft cap on and off, float32 and bf16. The fast tier runs the first two (every
# feature together, on each kernel); CI's interpreter tier (``pytest -m interpreter``) all of them.
CASES = [
    ("v5p", STREAMED, ALL, 3.0, "float32"),
    ("v5e", BLOCKED, ALL, None, "bfloat16"),
    ("v5e", BlockSizes(32, None, 128), ("vh",), None, "bfloat16"),
    ("v5p", BLOCKED, ("vh",), 3.0, "float32"),
    ("v5e", STREAMED, ("argmax",), 3.0, "float32"),
    ("v5p", BlockSizes(32, 128, 256), ("argmax",), None, "bfloat16"),
    ("v5p", BlockSizes(32, None, 128), ("row_scale",), None, "float32"),
    ("v5e", BLOCKED, ("row_scale",), 3.0, "bfloat16"),
]
SLOW_CASES = [
    ("v5p", BLOCKED, ALL, 3.0, "bfloat16"),
    ("v5e", STREAMED, ALL, None, "float32"),
    # v6e: the streamed step in chunks of 256 columns (two per block).
    ("v6e", BlockSizes(32, None, 512), ALL, 3.0, "bfloat16"),
    ("v5p", STREAMED, ("vh", "argmax"), None, "bfloat16"),
    ("v5e", STREAMED, ("argmax", "row_scale"), 3.0, "float32"),
    ("v5p", BLOCKED, ("vh", "row_scale"), None, "float32"),
    ("v5p", STREAMED, (), 3.0, "float32"),
    # Default tiles: the vocab in one block that is not a multiple of 128 wide.
    ("v5e", None, ALL, 3.0, "float32"),
]


def _case_id(value) -> str:
    if isinstance(value, BlockSizes):
        return "blocked" if value.h_block_size else f"streamed{value.v_block_size}"
    if isinstance(value, tuple):
        return "+".join(value) or "plain"
    return str(value)


def _features_match_oracle(interpret, target, blocks, features, cap, dtype) -> None:
    interpret(target)
    spec = _spec(features, cap, blocks)
    x, w, labels, scale = _problem(21, dtype, spec.w_layout, spec.with_row_scale)
    _check(_run(x, w, labels, spec, scale), _oracle(x, w, labels, spec, scale), spec, dtype)
    assert not _races_found()


@pytest.mark.parametrize("target,blocks,features,cap,dtype",
                         [row if k < 2 else pytest.param(*row, marks=pytest.mark.interpreter)
                          for k, row in enumerate(CASES)], ids=_case_id)
def test_features_match_the_oracle(interpret, target, blocks, features, cap, dtype):
    _features_match_oracle(interpret, target, blocks, features, cap, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("target,blocks,features,cap,dtype", SLOW_CASES, ids=_case_id)
def test_more_feature_combinations_match_the_oracle(interpret, target, blocks, features, cap, dtype):
    _features_match_oracle(interpret, target, blocks, features, cap, dtype)


#: Pairs of equal maximal columns, one per group of rows (V=700, blocks of 128: six blocks, three
#: per core on v5p, core 1 from column 384; the last block is ragged, columns 640-699).
TIE_PAIRS = [
    (130, 386),  # the same lane, blocks 1 and 3 (and the two cores)
    (10, 266),  # the same lane, blocks 0 and 2 of one core
    (100, 600),  # different lanes, the later column in the lower lane, and the two cores
    (5, 6),  # neighbours in one block
    (300, 650),  # a middle block and the ragged last one
    (660, 699),  # both in the ragged last block
]


def _tied_problem(dtype: str, layout: str, spike: float):
    """Rows in groups, each with an indicator feature that lifts its pair of identical columns by ``spike``."""
    x, labels, w = random_problem(23, (N,), H, V, ignore_fraction=0.0)
    x, w = x.copy(), w.copy()
    groups = len(TIE_PAIRS)
    x[:, :groups] = 0.0
    x[np.arange(N), np.arange(N) % groups] = 1.0
    w[:groups, :] = 0.0
    for group, (first, second) in enumerate(TIE_PAIRS):
        w[:, second] = w[:, first]
        w[group, [first, second]] = spike
    labels[::7] = [TIE_PAIRS[i % groups][1] for i in range(len(labels[::7]))]
    if layout == "vh":
        w = np.ascontiguousarray(w.T)
    if dtype == "bfloat16":
        x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    return x, w, labels


def _ties_take_the_lowest_index(interpret, target, blocks, layout, cap, dtype, spike) -> None:
    interpret(target)
    spec = StatsSpec(logit_soft_cap=cap, with_sum=True, with_expected=True, block_sizes=blocks, w_layout=layout,
                     with_argmax=True, with_row_scale=True)
    x, w, labels = _tied_problem(dtype, layout, spike)
    scale = np.random.default_rng(5).uniform(0.5, 2.0, N).astype(np.float32)
    ours = _run(x, w, labels, spec, scale)
    oracle = _oracle(x, w, labels, spec, scale)
    pairs = np.array(TIE_PAIRS)[np.arange(N) % len(TIE_PAIRS)]
    # The ties checked on logits summed in one order for every column (BLAS may round two equal columns
    # differently, by where they fall in its blocks and threads).
    w_hv = np.asarray(w, np.float64) if layout == "hv" else np.asarray(w, np.float64).T
    z = np.einsum("nh,hv->nv", np.asarray(x, np.float64), w_hv, optimize=False)
    assert np.all(z[np.arange(N), pairs[:, 0]] == z[np.arange(N), pairs[:, 1]])  # true ties
    assert np.all(np.argmax(z, axis=1) == pairs[:, 0])
    np.testing.assert_array_equal(np.asarray(ours.argmax), pairs[:, 0])
    tol = 2e-5 if dtype == "float32" else 1e-4
    np.testing.assert_allclose(np.asarray(ours.max), oracle["max"], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(ours.lse), oracle["lse"], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(ours.label), oracle["label"], rtol=tol, atol=tol)
    assert not _races_found()


TIE_BLOCKS = {"streamed": BlockSizes(32, None, 128), "blocked": BlockSizes(32, 128, 128)}


@pytest.mark.parametrize("target,kernel,layout,cap,dtype", [
    ("v5p", "streamed", "vh", None, "float32"),
    pytest.param("v5p", "blocked", "hv", 3.0, "bfloat16", marks=pytest.mark.interpreter),
    pytest.param("v5e", "streamed", "hv", 3.0, "bfloat16", marks=pytest.mark.interpreter),
])
def test_ties_take_the_lowest_index(interpret, target, kernel, layout, cap, dtype):
    _ties_take_the_lowest_index(interpret, target, TIE_BLOCKS[kernel], layout, cap, dtype, spike=8.0)


@pytest.mark.slow
@pytest.mark.parametrize("target,kernel,layout", [("v5p", "streamed", "hv"), ("v5e", "blocked", "vh"),
                                                  ("v6e", "streamed", "vh")])
def test_ties_far_above_the_row_take_the_lowest_index(interpret, target, kernel, layout):
    """A spike of 60 nats: the streamed steps holding it overflow and are redone exactly."""
    blocks = BlockSizes(32, None, 256) if target == "v6e" else TIE_BLOCKS[kernel]
    _ties_take_the_lowest_index(interpret, target, blocks, layout, None, "float32", spike=60.0)


def test_row_scale_must_match_the_spec(interpret):
    interpret("v5e")
    x, labels, w = random_problem(24, (8,), 16, 40)
    with pytest.raises(ValueError, match="row_scale"):
        ops.row_stats(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), StatsSpec(with_row_scale=True))
    with pytest.raises(ValueError, match="row_scale"):
        ops.row_stats(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), StatsSpec(), row_scale=jnp.ones(8))


@pytest.mark.parametrize("layout,blocks,in_kernel", [
    ("hv", STREAMED, True), pytest.param("hv", BLOCKED, True, marks=pytest.mark.interpreter),
    ("vh", STREAMED, False), pytest.param("vh", BLOCKED, True, marks=pytest.mark.interpreter),
], ids=["hv-streamed", "hv-blocked", "vh-streamed", "vh-blocked"])
def test_only_a_streamed_vh_kernel_leaves_the_label_logit_to_the_wrapper(interpret, layout, blocks, in_kernel):
    """The streamed kernel with a ``[V, H]`` head takes no labels and gives no label logit: the labels
    given to it change nothing, and it gives one statistic fewer than the others."""
    interpret("v5e")
    spec = StatsSpec(with_expected=True, block_sizes=blocks, w_layout=layout)
    x, w, labels, _ = _problem(31, "float32", layout, False)
    cfg = ops.make_plan(N, H, V, x.dtype, w.dtype, spec).forward
    assert cfg.label_in_kernel == in_kernel
    y = jnp.asarray(labels, jnp.int32).reshape(-1, 1)
    outputs = forward_call(jnp.asarray(x), jnp.asarray(w), y, cfg)
    assert len(outputs) == cfg.n_stats == 2 + in_kernel  # lse[, label], expected
    if not in_kernel:
        shifted = forward_call(jnp.asarray(x), jnp.asarray(w), (y + 1) % V, cfg)
        for ours, other in zip(outputs, shifted, strict=True):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(other))


@pytest.mark.parametrize("x_dtype,precision,chunk,columns", [("float32", "default", None, 128),
                                                             ("float32", "highest", 16, None),
                                                             ("bfloat16", "default", 24, 128)])
def test_label_logits_round_the_operands_as_the_kernel_does(monkeypatch, x_dtype, precision, chunk, columns):
    """:func:`label_logits` against the float64 oracle of the operands as the MXU takes them: rounded to
    bf16 at the default precision, whole at ``highest``; capped, scaled, and 0 for another shard's labels;
    in one piece, or in chunks of ``chunk`` tokens (77 is not a multiple of either); the rows gathered whole or
    from slices of ``columns`` columns (200 is not a multiple of 128)."""
    if chunk is not None:
        monkeypatch.setattr(forward, "LABEL_ROWS_BYTES", chunk * H * 4)
    if columns is not None:
        monkeypatch.setattr(forward, "LABEL_COLUMNS_BYTES", columns * V * 4)
    rng = np.random.default_rng(32)
    x = rng.normal(size=(N, H)).astype(np.float32)
    w = (rng.normal(size=(V, H)) / np.sqrt(H)).astype(np.float32)
    labels = rng.integers(0, V, N).astype(np.int32)
    labels[:4] = [-1, V, V + 300, -100]
    scale = rng.uniform(0.5, 2.0, N).astype(np.float32)
    cap = 3.0
    spec = StatsSpec(w_layout="vh", logit_soft_cap=cap, precision=precision, with_row_scale=True)
    cfg = ops.make_plan(N, H, V, jnp.dtype(x_dtype), jnp.dtype(jnp.float32), spec, Target("v5e", 1, None)).forward
    ours = label_logits(jnp.asarray(x, x_dtype), jnp.asarray(w), jnp.asarray(labels).reshape(-1, 1), cfg,
                        jnp.asarray(scale).reshape(-1, 1))

    def as_taken(a: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) if precision == "default" else a.astype(np.float64)

    hit = (labels >= 0) & (labels < V)
    raw = np.einsum("nh,nh->n", as_taken(np.asarray(jnp.asarray(x, x_dtype), np.float32)),
                    as_taken(w[np.where(hit, labels, 0)]))
    expected = np.where(hit, cap * np.tanh(raw / cap) * scale, 0.0)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="w_layout='hv'"):
        label_logits(jnp.asarray(x), jnp.asarray(w.T), jnp.asarray(labels), dataclasses.replace(cfg, w_layout="hv"))


def test_label_logits_in_chunks_inside_a_shard_map(monkeypatch):
    """Under ``shard_map`` (tokens split over two devices) the chunk loop's carry varies like its
    operands, and each shard's label logits are the unsharded call's."""
    monkeypatch.setattr(forward, "LABEL_ROWS_BYTES", 8 * H * 4)
    rng = np.random.default_rng(33)
    n = 2 * 36  # 36 tokens a shard: four chunks of 8 and a last one moved back
    x = jnp.asarray(rng.normal(size=(n, H)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(V, H)) / np.sqrt(H), jnp.float32)
    labels = jnp.asarray(rng.integers(-1, V + 1, (n, 1)), jnp.int32)
    spec = StatsSpec(w_layout="vh", precision="highest")
    cfg = ops.make_plan(n // 2, H, V, x.dtype, w.dtype, spec, Target("v5e", 1, None)).forward
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.shard_map(lambda x_, y_: label_logits(x_, w, y_, cfg), mesh=mesh,
                            in_specs=(jax.P("data"), jax.P("data")), out_specs=jax.P("data"))
    np.testing.assert_allclose(np.asarray(jax.jit(sharded)(x, labels)), np.asarray(label_logits(x, w, labels, cfg)),
                               rtol=1e-6, atol=1e-6)


#: Instructions that pass an array on without moving it: the head as a parameter, and as a loop's
#: invariant (the label logits' chunk loop carries ``w`` through a ``while``).
_ALIASES = re.compile(r"\b(?:parameter|get-tuple-element|tuple|while|bitcast)\(")


def _vh_head_copies(hlo: str, v: int, h: int) -> list[str]:
    """HLO instructions that make an array of the ``[V, H]`` head's shape (either order): not the
    parameter, nor a loop passing it on."""
    shape = re.compile(rf"=\s*\w+\[({v},{h}|{h},{v})\]")
    return [line.strip() for line in hlo.splitlines() if shape.search(line) and not _ALIASES.search(line)]


@pytest.mark.slow
@pytest.mark.parametrize("features", [("vh",), ALL], ids=["vh", "vh+argmax+row_scale"])
def test_vh_forward_compiles_for_v5e_without_copying_the_head(features):
    """At 4096x1536x151936 bf16 the ``[V, H]`` head goes to the kernel as it lies: no transpose or copy."""
    from ce_pallas_tpu.tooling import aot

    n, h, v = 4096, 1536, 151936
    spec = _spec(features, 30.0, None)
    with aot.compiling_for("v5e") as device:
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16, sharding=sharding),
                jax.ShapeDtypeStruct((v, h), jnp.bfloat16, sharding=sharding),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding),
                jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding) if spec.with_row_scale else None)
        compiled = jax.jit(lambda x, w, y, s: ops.row_stats(x, w, y, spec, row_scale=s)).lower(*args).compile()
    hlo = compiled.as_text()
    assert hlo is not None and "ce_pallas_tpu_forward" in hlo
    assert _vh_head_copies(hlo, v, h) == []
