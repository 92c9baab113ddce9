"""Contract version 3 of the xla backend against the float64 oracle (``ce_core.testing.stats_oracle``).

A ``[V, H]`` head (``w_layout="vh"``), the ``max``/``argmax`` statistics and a per-token
``row_scale``, in all eight combinations, on every path (``row_stats`` and its custom VJP,
``row_stats_vjp`` from a global lse, the fused ``row_stats_and_grads``), in both gradient orders and
the three chunkings of ``test_paths.py`` (one chunk; overlapping token chunks and gradient slices;
overlapping token and vocab chunks). N = 51 tokens and V = 1001 or 3001 are divided by no chunk.
Each feature combination takes its own dtype, soft cap and vocabulary, so that every one of those
meets every feature. Ties for the argmax are exact (integer-valued inputs), across chunks too.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import BlockSizes, RowStats, StatsSpec
from ce_core.extend import get_backend, max_rel_error, random_problem, stats_oracle
from ce_xla import XlaBackend

N = 51
ORDERS = ("tokens_outer", "vocab_outer")
CHUNKINGS = {
    "one_chunk": ({}, None),
    # 24-row token chunks (51 = 24 + 24 + overlapping 24); tokens outer, 512-column gradient slices.
    "full_rows": ({"grad_budget_bytes": 1}, BlockSizes(b_block_size=24)),
    # 384-column vocab tiles and gradient slices divide neither 1001 nor 3001 (the last overlaps).
    "vocab_chunks": ({}, BlockSizes(b_block_size=16, v_block_size=384)),
}
MODES = {f"{chunking}-{order}": (XlaBackend(**options, gradient_order=order), block_sizes)
         for chunking, (options, block_sizes) in CHUNKINGS.items() for order in ORDERS}
#: (w_layout, with_argmax, with_row_scale): all eight, each with its own (vocab, dtype, soft cap) so
#: that both dtypes, both vocabularies and the cap on and off each meet every feature, on and off.
FEATURES = list(itertools.product(("hv", "vh"), (False, True), (False, True)))
SETTINGS = [(1001, "float32", 3.0), (3001, "bfloat16", None), (3001, "float32", None), (1001, "bfloat16", 3.0),
            (3001, "bfloat16", 3.0), (1001, "float32", None), (1001, "bfloat16", None), (3001, "float32", 3.0)]
MODE_NAMES = list(MODES)
#: The fast tier's mode for each feature combination (an index into MODE_NAMES; the slow tier runs the other
#: five): every mode is used, and every value of every feature and setting meets both gradient orders
#: (test_the_fast_modes_meet_every_value_in_both_orders).
FAST_MODES = (0, 0, 1, 2, 3, 3, 4, 5)


def _cases() -> list:
    """Every (mode, feature combination): the fast tier runs each combination in one mode, the slow tier in
    the other five."""
    cases = []
    for k, (feature, setting) in enumerate(zip(FEATURES, SETTINGS, strict=True)):
        for m, name in enumerate(MODE_NAMES):
            ident = (f"{name}-{feature[0]}-argmax{int(feature[1])}-scale{int(feature[2])}-{setting[0]}-{setting[1]}-"
                     f"cap{int(setting[2] is not None)}")
            marks = () if m == FAST_MODES[k] else (pytest.mark.slow,)
            cases.append(pytest.param(name, *feature, *setting, id=ident, marks=marks))
    return cases


def test_the_fast_modes_meet_every_value_in_both_orders():
    assert set(FAST_MODES) == set(range(len(MODE_NAMES)))
    for position in range(6):  # layout, argmax, row scale, vocab, dtype, cap
        for value in {(*f, *s)[position] for f, s in zip(FEATURES, SETTINGS, strict=True)}:
            orders = {MODE_NAMES[FAST_MODES[k]].split("-")[1] for k, (f, s) in enumerate(zip(FEATURES, SETTINGS,
                                                                                               strict=True))
                      if (*f, *s)[position] == value}
            assert orders == set(ORDERS), (position, value, orders)


CASES = _cases()
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
STATS_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-5}


@pytest.fixture
def case_mode(mode_name):
    return MODES[mode_name]


def problem(vocab: int, dtype: str, layout: str, seed: int):
    """``x``, ``w`` (in ``layout``, cast to ``dtype``), labels (three owned by no one) and a row scale."""
    x, labels, w = random_problem(seed, (N,), 40, vocab, ignore_fraction=0.0)
    labels[[3, 17, 41]] = [-7, vocab, vocab + 123]
    scale = np.random.default_rng(seed + 100).uniform(0.4, 2.5, N).astype(np.float32)
    head = w if layout == "hv" else np.ascontiguousarray(w.T)
    return jnp.asarray(x, dtype), jnp.asarray(head, dtype), jnp.asarray(labels), jnp.asarray(scale)


def as_float32(*arrays):
    return tuple(np.asarray(jnp.asarray(a, jnp.float32)) for a in arrays)


def check(actual, expected, tol, what):
    error = max_rel_error(np.asarray(jnp.asarray(actual, jnp.float32)), expected)
    assert error <= tol, f"{what}: rel error {error:.3g} > {tol}"


def check_stats(stats: RowStats, expected: dict, spec: StatsSpec, dtype: str) -> None:
    for name in ("lse", "label", "sum", "expected"):
        wanted = getattr(spec, f"with_{name}", True)
        assert (getattr(stats, name) is not None) == wanted, name
        if wanted:
            check(getattr(stats, name), expected[name], STATS_TOLERANCE[dtype], name)
    assert (stats.max is not None) == spec.with_argmax and (stats.argmax is not None) == spec.with_argmax
    if stats.max is not None and stats.argmax is not None:
        assert stats.argmax.dtype == jnp.int32 and stats.max.dtype == jnp.float32
        check(stats.max, expected["max"], STATS_TOLERANCE[dtype], "max")
        # Random float inputs: no exact ties, so argmax agrees with float64 up to near-ties.
        z_max, z_at = expected["max"], expected["z_at_argmax"]
        np.testing.assert_array_less(z_max - z_at, 1e-5 * np.maximum(1.0, np.abs(z_max)) + 1e-6)
    assert np.all(np.asarray(stats.label)[[3, 17, 41]] == 0.0), "out-of-vocab labels give label logit 0"


def oracle(x, w, labels, scale, layout, cap, with_row_scale, cotangent=None, argmax=None):
    """The float64 oracle, plus the oracle's logit at the backend's ``argmax`` (for near-ties)."""
    x32, w32 = as_float32(x, w)
    row_scale = np.asarray(scale) if with_row_scale else None
    result = stats_oracle(x32, w32, np.asarray(labels), w_layout=layout, logit_soft_cap=cap, row_scale=row_scale,
                          cotangent=cotangent)
    if argmax is not None:
        w_hv = (w32 if layout == "hv" else w32.T).astype(np.float64)
        rows = np.arange(x32.shape[0])
        raw = np.einsum("nh,hn->n", x32.astype(np.float64), w_hv[:, np.asarray(argmax)])
        z = raw if cap is None else cap * np.tanh(raw / cap)
        result["z_at_argmax"] = z * (1.0 if row_scale is None else row_scale[rows])
    return result


def random_cotangent(seed: int, expected: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = ("lse", "label", "sum", "expected") if expected else ("lse", "label", "sum")
    return {name: rng.standard_normal(N).astype(np.float32) for name in names}


@pytest.mark.parametrize("mode_name,layout,with_argmax,with_row_scale,vocab,dtype,cap", CASES)
def test_row_stats_and_its_vjp(case_mode, layout, with_argmax, with_row_scale, vocab, dtype, cap):
    backend, block_sizes = case_mode
    x, w, labels, scale = problem(vocab, dtype, layout, seed=1)
    spec = StatsSpec(logit_soft_cap=cap, with_sum=True, with_expected=True, block_sizes=block_sizes, w_layout=layout,
                     with_argmax=with_argmax, with_row_scale=with_row_scale)
    kwargs = {"row_scale": scale} if with_row_scale else {}
    g = random_cotangent(2, expected=True)
    cotangent = RowStats(*(jnp.asarray(g[k]) for k in ("lse", "label", "sum", "expected")))

    @jax.jit
    def run(x_, w_):
        stats, vjp = jax.vjp(lambda a, b: backend.row_stats(a, b, labels, spec, **kwargs), x_, w_)
        ct = cotangent
        if with_argmax:  # cotangents of max (zeros) and argmax (float0), as jax.vjp hands them
            ct = ct._replace(max=jnp.zeros(N), argmax=np.zeros(N, jax.dtypes.float0))
        return stats, vjp(ct)

    stats, (dx, dw) = run(x, w)
    expected = oracle(x, w, labels, scale, layout, cap, with_row_scale, g, stats.argmax)
    check_stats(stats, expected, spec, dtype)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    check(dx, expected["dx"], TOLERANCE[dtype], "dx")
    check(dw, expected["dw"], TOLERANCE[dtype], "dw")


@pytest.mark.parametrize("mode_name,layout,with_argmax,with_row_scale,vocab,dtype,cap", CASES)
def test_row_stats_vjp_from_a_global_lse(case_mode, layout, with_argmax, with_row_scale, vocab, dtype, cap):
    """``w`` is one vocab shard (ids [0, 700)) and ``lse``/``expected`` are over the whole vocabulary."""
    backend, block_sizes = case_mode
    x, w_full, labels, scale = problem(vocab, dtype, layout, seed=3)
    w = w_full[:, :700] if layout == "hv" else w_full[:700]
    spec = StatsSpec(logit_soft_cap=cap, with_sum=True, with_expected=True, block_sizes=block_sizes, w_layout=layout,
                     with_argmax=with_argmax, with_row_scale=with_row_scale)
    kwargs = {"row_scale": scale} if with_row_scale else {}
    whole = oracle(x, w_full, labels, scale, layout, cap, with_row_scale)
    g = random_cotangent(4, expected=True)
    stats = RowStats(*(jnp.asarray(whole[k], jnp.float32) for k in ("lse", "label", "sum", "expected")))
    cotangent = RowStats(*(jnp.asarray(g[k]) for k in ("lse", "label", "sum", "expected")))
    dx, dw = jax.jit(lambda a, b: backend.row_stats_vjp(a, b, labels, stats, cotangent, spec, **kwargs))(x, w)
    # The shard's share: the oracle's delta on the shard's columns, i.e. the full problem's gradients
    # with the other columns' cotangent removed; computed directly from the definitions here.
    x64, w64 = (a.astype(np.float64) for a in as_float32(x, w))
    w_hv = w64 if layout == "hv" else w64.T
    raw = x64 @ w_hv
    capped = raw if cap is None else cap * np.tanh(raw / cap)
    s = np.asarray(scale, np.float64)[:, None] if with_row_scale else 1.0
    z = s * capped
    p = np.exp(z - whole["lse"][:, None])
    one_hot = (np.arange(700)[None, :] == np.asarray(labels)[:, None]).astype(np.float64)
    dz = (g["lse"][:, None] * p + g["label"][:, None] * one_hot + g["sum"][:, None]
          + g["expected"][:, None] * p * (1.0 + z - whole["expected"][:, None]))
    delta = dz * s * (1.0 if cap is None else 1.0 - np.tanh(raw / cap) ** 2)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    check(dx, delta @ w_hv.T, TOLERANCE[dtype], "dx")
    check(dw, x64.T @ delta if layout == "hv" else delta.T @ x64, TOLERANCE[dtype], "dw")


@pytest.mark.parametrize("mode_name,layout,with_argmax,with_row_scale,vocab,dtype,cap", CASES)
def test_row_stats_and_grads(case_mode, layout, with_argmax, with_row_scale, vocab, dtype, cap):
    backend, block_sizes = case_mode
    x, w, labels, scale = problem(vocab, dtype, layout, seed=5)
    spec = StatsSpec(logit_soft_cap=cap, with_sum=True, with_expected=True, block_sizes=block_sizes, w_layout=layout,
                     with_argmax=with_argmax, with_row_scale=with_row_scale)
    kwargs = {"row_scale": scale} if with_row_scale else {}
    rng = np.random.default_rng(6)
    params = {"a": jnp.asarray(rng.uniform(0.5, 2, N), jnp.float32), "b": jnp.asarray(rng.standard_normal(N),
                                                                                    jnp.float32)}

    def cotangent_fn(stats, p):  # depends on the chunk's own statistics, as ce_core's does
        assert (stats.argmax is not None) == with_argmax
        return RowStats(p["a"] * (1.0 + 0.1 * stats.lse), p["b"] * jnp.tanh(stats.label), -0.01 * p["a"],
                        0.3 * p["b"])

    stats, dx, dw = jax.jit(lambda a, b: backend.row_stats_and_grads(a, b, labels, spec, cotangent_fn, params,
                                                                     **kwargs))(x, w)
    plain = oracle(x, w, labels, scale, layout, cap, with_row_scale, argmax=stats.argmax)
    a, b = (np.asarray(params[k], np.float64) for k in "ab")
    g = {"lse": a * (1.0 + 0.1 * plain["lse"]), "label": b * np.tanh(plain["label"]), "sum": -0.01 * a,
         "expected": 0.3 * b}
    expected = oracle(x, w, labels, scale, layout, cap, with_row_scale, g, stats.argmax)
    check_stats(stats, expected, spec, dtype)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    check(dx, expected["dx"], TOLERANCE[dtype], "dx")
    check(dw, expected["dw"], TOLERANCE[dtype], "dw")


def tied_problem(vocab: int, dtype: str, layout: str, seed: int = 7):
    """Integer-valued ``x`` and quarter-valued ``w``: every logit is exact in float32 and bf16, so
    equal logits are exactly equal and many rows have their maximum at several columns.

    Column 3 (the largest logit of the first rows) is copied to columns 500 and ``vocab - 1`` (other
    vocab chunks) and 620 (in the part of the last 384-column chunk that overlaps the one before it
    when V = 1001).
    """
    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, (N, 40)).astype(np.float32)
    w = (rng.integers(-1, 2, (40, vocab)) / 4).astype(np.float32)
    w[:, 3] = np.sign(x[0] + x[1]) / 4
    for column in (500, 620, vocab - 1):
        w[:, column] = w[:, 3]
    labels = rng.integers(0, vocab, N).astype(np.int32)
    head = w if layout == "hv" else np.ascontiguousarray(w.T)
    return jnp.asarray(x, dtype), jnp.asarray(head, dtype), jnp.asarray(labels)


@pytest.mark.covering(chunking=tuple(CHUNKINGS), order=ORDERS, layout=("hv", "vh"), dtype=("float32", "bfloat16"),
                      cap=(None, 3.0), with_row_scale=(False, True))
def test_argmax_ties_go_to_the_lowest_index(chunking, order, layout, dtype, cap, with_row_scale):
    backend, block_sizes = MODES[f"{chunking}-{order}"]
    vocab = 1001
    x, w, labels = tied_problem(vocab, dtype, layout)
    scale = jnp.asarray(np.random.default_rng(8).uniform(0.5, 2, N).astype(np.float32))
    kwargs = {"row_scale": scale} if with_row_scale else {}
    spec = StatsSpec(logit_soft_cap=cap, block_sizes=block_sizes, w_layout=layout, with_argmax=True,
                     with_row_scale=with_row_scale)
    x32, w32 = as_float32(x, w)
    expected = stats_oracle(x32, w32, np.asarray(labels), w_layout=layout, logit_soft_cap=cap,
                            row_scale=np.asarray(scale) if with_row_scale else None)
    raw = np.asarray(jnp.asarray(x, jnp.float32)) @ np.asarray(jnp.asarray(w if layout == "hv" else w.T, jnp.float32))
    tied = (raw == raw.max(1, keepdims=True)).sum(1) > 1
    assert tied.sum() >= 10, "the problem must have many tied rows"
    first_max = raw[:, 3] == raw.max(1)  # rows whose maximum is at 3, 500, 620 and 1000 at once
    assert first_max.any()

    stats = jax.jit(lambda a, b: backend.row_stats(a, b, labels, spec, **kwargs))(x, w)
    np.testing.assert_array_equal(np.asarray(stats.argmax), expected["argmax"])
    assert np.all(np.asarray(stats.argmax)[first_max] <= 3)
    fused, _, _ = jax.jit(lambda a, b: backend.row_stats_and_grads(
        a, b, labels, spec, lambda s, p: RowStats(p, p), jnp.ones(N), **kwargs))(x, w)
    np.testing.assert_array_equal(np.asarray(fused.argmax), expected["argmax"])
    np.testing.assert_allclose(np.asarray(fused.max), expected["max"], rtol=1e-6)


def test_argmax_of_a_later_chunk_wins_only_when_strictly_larger():
    """Two chunks of 128 columns: the maximum sits in both (column 5 and 200) in some rows and only
    in the second (column 200, larger) in others."""
    backend = XlaBackend(gradient_order="tokens_outer")
    x = np.ones((4, 8), np.float32)
    x[:2, 0] = 0.0  # rows 0 and 1 do not see the first entries, where the columns differ
    w = np.zeros((8, 256), np.float32)
    w[:, 5] = 1.0
    w[:, 200] = 1.0
    w[0, 200] = 1.5
    spec = StatsSpec(with_argmax=True, block_sizes=BlockSizes(b_block_size=4, v_block_size=128))
    stats = backend.row_stats(jnp.asarray(x), jnp.asarray(w), jnp.zeros(4, jnp.int32), spec)
    np.testing.assert_array_equal(np.asarray(stats.argmax), [5, 5, 200, 200])
    np.testing.assert_array_equal(np.asarray(stats.argmax), np.argmax(x @ w, axis=1))


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_plans_read_h_and_v_from_the_layout(layout):
    x, w, _, _ = problem(3001, "bfloat16", layout, seed=9)
    backend = XlaBackend()
    plan = backend._plan_for(x, w, StatsSpec(w_layout=layout), None)
    assert (plan.h, plan.v) == (40, 3001)
    assert plan == backend.plan(N, 40, 3001, StatsSpec(), x.dtype, w.dtype, live_rows=False)


def test_contract_version_5_and_the_registry_accepts_every_v3_spec():
    assert XlaBackend.contract_version == 5 and XlaBackend().takes_live_rows
    backend = get_backend("xla")
    assert isinstance(backend, XlaBackend)
    x, w, labels, scale = problem(1001, "float32", "vh", seed=10)
    spec = StatsSpec(w_layout="vh", with_argmax=True, with_row_scale=True)
    assert spec.needs_version == 3
    stats = backend.row_stats(x, w, labels, spec, row_scale=scale)
    assert stats.argmax is not None
    with pytest.raises(ValueError, match="row_scale"):
        backend.row_stats(x, w, labels, spec)
