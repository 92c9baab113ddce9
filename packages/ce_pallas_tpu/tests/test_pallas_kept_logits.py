"""The no-recompute gradient (``keep_logits=True``): kept logits between the kernels, in interpret mode.

Every scalar-loss option through the public API against the float64 oracle, with chunks small enough
that a call takes several (the last one overlapping the one before), tiles small enough that both
kernels take several token and vocab blocks, ragged in N, V and H, on one core (v5e) and two (v5p,
the vocab split over them, the last core a block short), in the race-checked interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call

from ce_core import BlockSizes, StatsSpec, linear_cross_entropy
from ce_core.extend import TOLERANCES, max_rel_error, oracle, random_problem
from ce_pallas_tpu import kept_logits, ops
from ce_pallas_tpu.forward import forward_call


@pytest.fixture(autouse=True)
def _fresh_traces():
    """The chunk size and the target are read when a call is traced: no trace of another test's reused."""
    jax.clear_caches()


def _problem(seed: int, n: int, h: int, v: int, layout: str, dtype: str):
    x, labels, w = random_problem(seed, (n,), h, v, ignore_fraction=0.2)
    if layout == "vh":
        w = np.ascontiguousarray(w.T)
    return jnp.asarray(x, dtype), labels, jnp.asarray(w, dtype)


def _value_and_grads(x, labels, w, *, keep_logits: bool | None, options: dict, weights):
    def loss(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu", keep_logits=keep_logits,
                                    weights=weights, **options)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def _oracle(x, labels, w, layout: str, options: dict, weights, temperature):
    w32 = np.asarray(jnp.asarray(w, jnp.float32))
    plain = {name: value for name, value in options.items() if name not in ("w_layout", "temperature", "block_sizes",
                                                                            "return_argmax")}
    expected = oracle(np.asarray(jnp.asarray(x, jnp.float32)), labels, w32.T if layout == "vh" else w32,
                      weights=weights, temperature=temperature, **plain)
    if layout == "vh":
        expected["dw"] = expected["dw"].T
    return expected


@pytest.mark.covering(
    target=("v5e", "v5p"),
    layout=("hv", "vh"),
    reduction=("mean", "sum"),
    extras=("plain", "z_loss+smoothing", "soft_cap", "weights"),
    temperature=("none", "scalar", "per_token"),
    dtype=("float32", "bfloat16"),
    chunk=(16, 24, 4096),
    fast=2,
)
def test_kept_logits_matches_the_oracle(interpret, monkeypatch, target, layout, reduction, extras, temperature, dtype,
                                        chunk):
    interpret(target)
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", chunk)
    called = []
    monkeypatch.setattr(kept_logits, "row_stats_and_grads",
                        functools.partial(_spy, called, kept_logits.row_stats_and_grads))
    n, h, v = 45, 200, 300  # ragged everywhere: 45 rows in blocks of 16, H past 128, V past 256
    x, labels, w = _problem(n + len(extras), n, h, v, layout, dtype)
    options: dict = dict(reduction=reduction, w_layout=layout, block_sizes=BlockSizes(16, None, 128))
    if extras == "z_loss+smoothing":
        options.update(logsumexp_weight=1e-3, label_smoothing=0.1)
    if extras == "soft_cap":
        options.update(logit_soft_cap=3.0)
    rng = np.random.default_rng(n)
    weights = None
    if extras == "weights":  # of both signs and some 0: the rows' cotangents too (the backward folds their sign into x)
        weights = rng.uniform(-1.0, 2.0, n).astype(np.float32)
        weights[::7] = 0.0
    temperatures = {"none": 1.0, "scalar": 0.7, "per_token": rng.uniform(0.5, 2.0, n).astype(np.float32)}
    t = temperatures[temperature]
    if temperature != "none":
        options["temperature"] = jnp.asarray(t) if temperature == "per_token" else t
    loss, (dx, dw) = _value_and_grads(x, labels, w, keep_logits=True, options=options, weights=weights)
    assert called, "keep_logits=True did not take the kept-logits path"
    expected = _oracle(x, labels, w, layout, options, weights, t)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dx.shape == x.shape and dw.shape == w.shape
    loss_tol, grad_tol = TOLERANCES[dtype]
    assert max_rel_error(loss, expected["loss"]) <= loss_tol
    assert max_rel_error(dx.astype(jnp.float32), expected["dx"]) <= grad_tol
    assert max_rel_error(dw.astype(jnp.float32), expected["dw"]) <= grad_tol
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found


def _spy(called: list, function, *args, **kwargs):
    called.append(True)
    return function(*args, **kwargs)


def _config_spy(monkeypatch, name: str, config_index: int) -> list:
    """``kept_logits.<name>`` (a kernel's call) replaced by a spy that records each call's config, its
    ``config_index``-th argument, and calls through; returns the list of configs."""
    function, configs = getattr(kept_logits, name), []

    def spy(*args, **kwargs):
        configs.append(args[config_index])
        return function(*args, **kwargs)

    monkeypatch.setattr(kept_logits, name, spy)
    return configs


def _kept_errors_with_v6e_fact(monkeypatch, fact: str, value: bool, spied: list, x, labels, w, options: dict,
                               weights, expected: dict, dtype: str) -> tuple[float, float]:
    """The kept path's ``(dx, dw)`` errors against ``expected`` with v6e's ``ChipFacts`` ``fact`` set to ``value``
    (``spied``, a spy's list of configs, cleared first); its loss within the dtype's tolerance."""
    from ce_pallas_tpu.target import CHIP_FACTS

    monkeypatch.setitem(CHIP_FACTS, "v6e", dataclasses.replace(CHIP_FACTS["v6e"], **{fact: value}))
    spied.clear()
    jax.clear_caches()
    loss, (dx, dw) = _value_and_grads(x, labels, w, keep_logits=True, options=options, weights=weights)
    assert max_rel_error(loss, expected["loss"]) <= TOLERANCES[dtype][0]
    return (max_rel_error(dx.astype(jnp.float32), expected["dx"]),
            max_rel_error(dw.astype(jnp.float32), expected["dw"]))


def _signed_weights_and_temperatures(seed: int, n: int, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-token weights of either sign and per-token temperatures (also set in ``options``)."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(-1.0, 2.0, n).astype(np.float32)
    t = rng.uniform(0.5, 2.0, n).astype(np.float32)
    options["temperature"] = jnp.asarray(t)
    return weights, t


def _assert_v6e_backward_fact_as_accurate_on_as_off(monkeypatch, fact: str, flag: str, x, labels, w, options: dict,
                                                    weights, expected: dict, dtype: str) -> None:
    """With v6e's ``ChipFacts`` ``fact`` on and then off, every kept backward call has ``BackwardConfig`` ``flag`` so
    (a spy on the calls), the loss, ``dx`` and ``dw`` within the dtype's tolerance of ``expected``, race-free; and
    the errors with it on within 5% of those with it off."""
    called = _config_spy(monkeypatch, "backward_call", 9)
    errors = {}
    for on in (True, False):
        errors[on] = _kept_errors_with_v6e_fact(monkeypatch, fact, on, called, x, labels, w, options, weights,
                                                expected, dtype)
        assert called and all(getattr(cfg, flag) == on for cfg in called), called
        assert max(errors[on]) <= TOLERANCES[dtype][1], errors
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    for with_fact, without in zip(errors[True], errors[False], strict=True):
        assert with_fact <= 1.05 * without + 1e-6, errors


def _assert_kept_float32_grads_match_the_oracle_race_free(x, labels, w, layout: str) -> None:
    """The kept path's plain mean-loss gradients against the float64 oracle, and no race in the interpreter."""
    _, (dx, dw) = _value_and_grads(x, labels, w, keep_logits=True, options=dict(w_layout=layout), weights=None)
    expected = _oracle(x, labels, w, layout, {}, None, 1.0)
    assert max_rel_error(dx, expected["dx"]) <= TOLERANCES["float32"][1]
    assert max_rel_error(dw, expected["dw"]) <= TOLERANCES["float32"][1]
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found


@pytest.mark.slow  # 13 s in the race-checked interpreter (the interpreter tier is at its budget)
def test_middle_chunks_called_one_after_another_or_in_a_loop_give_the_same_gradients(interpret, monkeypatch):
    """Five chunks (three middle ones, the last overlapping the fourth): called one after another in the program
    (the default up to ``UNROLLED_MIDDLE_CHUNKS``, which libtpu compiles in less than half the time) or in a
    ``lax.fori_loop`` (beyond it), the same loss and gradients bit for bit, the oracle's, race-checked."""
    interpret("v5e")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 16)
    n, h, v = 70, 72, 300
    x, labels, w = _problem(29, n, h, v, "hv", "float32")
    sizes = BlockSizes(16, None, 128)
    options = dict(block_sizes=sizes, logit_soft_cap=3.0)
    plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec(block_sizes=sizes))
    assert plan.chunks == 5
    results, programs = {}, {}
    for unrolled in (3, 2):  # three middle chunks: unrolled, then looped
        monkeypatch.setattr(kept_logits, "UNROLLED_MIDDLE_CHUNKS", unrolled)
        jax.clear_caches()
        loss, grads = _value_and_grads(x, labels, w, keep_logits=True, options=options, weights=None)
        results[unrolled] = [np.asarray(a) for a in (loss, *grads)]
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
        text = str(jax.make_jaxpr(lambda x_, w_: _value_and_grads(x_, labels, w_, keep_logits=True, options=options,
                                                                  weights=None))(x, w))
        programs[unrolled] = text.count("pallas_call[")
    # Unrolled: a forward and a backward call per chunk; looped: the first's, the loop body's and the last's.
    assert programs == {3: 2 * 5, 2: 2 * 3}, programs
    for name, unrolled, looped in zip(("loss", "dx", "dw"), results[3], results[2], strict=True):
        assert np.array_equal(unrolled, looped), name
    expected = _oracle(x, labels, w, "hv", options, None, 1.0)
    assert max_rel_error(results[3][0], expected["loss"]) <= TOLERANCES["float32"][0]
    assert max_rel_error(results[3][1], expected["dx"]) <= TOLERANCES["float32"][1]
    assert max_rel_error(results[3][2], expected["dw"]) <= TOLERANCES["float32"][1]


@pytest.mark.interpreter
@pytest.mark.parametrize("layout,n,chunk", [("hv", 600, 256), ("vh", 330, None)])
def test_the_kept_backwards_default_tiles_match_the_oracle(interpret, monkeypatch, layout, n, chunk):
    """The kept backward's own default tiles (the whole hidden size per product, a token block that divides
    the chunk, a wide vocab block), ragged in V and H, over two cores, race-checked: three chunks, or one
    of 330 tokens (not whole sublane tiles: the kernels' token blocks round up to 16, the rest masked; the
    forward's one block of 336 rows inside the backward's two of 176, the buffer not a whole number of it)."""
    interpret("v5p")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", chunk)
    h, v = 200, 3000
    x, labels, w = _problem(17, n, h, v, layout, "float32")
    plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec(w_layout=layout))
    assert plan.chunks == (3 if n == 600 else 1) and plan.backward.block_h == plan.backward.hp
    assert plan.forward.block_b % 16 == plan.backward.block_b % 16 == 0
    if n == 330:
        assert (plan.forward.block_b, plan.backward.block_b, plan.logits_shape[0]) == (336, 176, 352)
    assert plan.backward.nv == 2 and plan.backward.num_cores == 2
    _assert_kept_float32_grads_match_the_oracle_race_free(x, labels, w, layout)


# One row in the interpreter tier (at its budget), the other two in the slow tier.
@pytest.mark.parametrize("layout,dtype,tiles", [
    pytest.param("vh", "bfloat16", "default", marks=pytest.mark.interpreter),
    pytest.param("hv", "float32", "default", marks=pytest.mark.slow),
    pytest.param("vh", "float32", "explicit", marks=pytest.mark.slow)])
def test_dx_held_transposed_where_the_hidden_size_pads_the_mxu(interpret, monkeypatch, layout, dtype, tiles):
    """v6e's kept backward holds ``dx`` transposed where ``Hp`` is not a whole number of its MXU's 256
    (:attr:`ce_pallas_tpu.backward.BackwardConfig.dx_transposed`): ``H`` 330 (``Hp`` 384), ragged in N and V,
    several chunks; default tiles (one token block a chunk) or explicit ones (two 128-row blocks a chunk, so the
    token blocks are runs of ``dx.T``'s lanes); bf16 with per-token temperatures, weights, the label's term by rows
    and bf16 kept logits. Against the float64 oracle, race-checked, and as accurate as with ``dx`` untransposed.
    The plan takes it at ``Hp`` 384 and not at 256, where nothing pads."""
    interpret("v6e")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 256 if tiles == "explicit" else 64)
    n, h, v = 300, 330, 1100
    x, labels, w = _problem(31, n, h, v, layout, dtype)
    options: dict = dict(w_layout=layout)
    if tiles == "explicit":
        options["block_sizes"] = BlockSizes(128, None, 256)
    weights = t = None
    if dtype == "bfloat16":
        weights, t = _signed_weights_and_temperatures(31, n, options)
    spec = StatsSpec(w_layout=layout, block_sizes=options.get("block_sizes"))
    plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, spec)
    assert plan.chunks > 1 and all(cfg.dx_transposed for cfg in plan.piece_configs("last")), plan
    assert (plan.backward.nb == 2) == (tiles == "explicit")
    assert not kept_logits.plan_chunks(n, 256, v, x.dtype, w.dtype, spec).backward.dx_transposed
    expected = _oracle(x, labels, w, layout, options, weights, 1.0 if t is None else t)
    _assert_v6e_backward_fact_as_accurate_on_as_off(monkeypatch, "kept_dx_transposed", "dx_transposed", x, labels, w,
                                                    options, weights, expected, dtype)


#: The dw test's tiles: ``(CHUNK_TOKENS, explicit token block or None, chunks, token blocks a chunk, roles)``.
_DW_TRANSPOSED_TILES = {
    "default": (64, None, 5, 1, ("first", "middle", "last")),  # one token block a chunk
    "explicit": (256, 128, 2, 2, ("first", "last")),  # two whole 128-row blocks a chunk
    "ragged_blocks": (512, 128, 1, 3, ("only",)),  # one chunk of 300 rows in three blocks, the last of 44
}


# Every row in the slow tier (the interpreter tier is at its budget).
@pytest.mark.slow
@pytest.mark.parametrize("dtype,tiles", [("bfloat16", "default"), ("float32", "explicit"),
                                         ("float32", "ragged_blocks")])
def test_tied_heads_dw_held_transposed_where_the_hidden_size_pads_the_mxu(interpret, monkeypatch, dtype, tiles):
    """v6e's kept backward of a ``[V, H]`` head holds ``dw`` as ``[Hp, V]`` (slots and running sum) and ``x``
    transposed where ``Hp`` is not a whole number of its MXU's 256
    (:attr:`ce_pallas_tpu.backward.BackwardConfig.kept_dw_transposed`), the label's term in ``delta``: ``H`` 384,
    ragged in N and V; several chunks (the running sum read and written transposed, the last chunk's tiles
    transposed as they are staged) of one token block or of two whole 128-row ones, or one chunk of three 128-row
    blocks whose last is ragged (as v6e's plan takes 1,000 tokens: four of 256), ``dx`` held transposed too; bf16
    with per-token temperatures, signed weights and bf16 kept logits. Against the float64 oracle, race-checked,
    and as accurate as the untransposed form (with its label rows). The plan takes it at ``Hp`` 384 and not at
    256, where nothing pads, nor at 330, which is not whole lanes."""
    interpret("v6e")
    chunk_tokens, block_b, chunks, blocks, roles = _DW_TRANSPOSED_TILES[tiles]
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", chunk_tokens)
    n, h, v = 300, 384, 1100
    x, labels, w = _problem(37, n, h, v, "vh", dtype)
    options: dict = dict(w_layout="vh")
    if block_b is not None:
        options["block_sizes"] = BlockSizes(block_b, None, 256)
    weights = t = None
    if dtype == "bfloat16":
        weights, t = _signed_weights_and_temperatures(37, n, options)
    spec = StatsSpec(w_layout="vh", block_sizes=options.get("block_sizes"))
    plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, spec)
    assert (plan.chunks, plan.backward.nb) == (chunks, blocks), plan
    assert plan.running_dw_shape == (h, plan.backward.nv * plan.backward.block_v), plan
    assert all(cfg.kept_dw_transposed and cfg.dx_transposed and cfg.x_transposed and not cfg.label_rows
               for role in roles for cfg in plan.piece_configs(role)), plan
    for other in (256, 330):
        assert not kept_logits.plan_chunks(n, other, v, x.dtype, w.dtype, spec).backward.kept_dw_transposed
    expected = _oracle(x, labels, w, "vh", options, weights, 1.0 if t is None else t)
    _assert_v6e_backward_fact_as_accurate_on_as_off(monkeypatch, "kept_dw_transposed", "kept_dw_transposed", x, labels,
                                                    w, options, weights, expected, dtype)


@pytest.mark.slow  # 8 s in the race-checked interpreter; the fast tier runs the kept path in the covering rows
def test_argmax_comes_out_of_the_kept_logits_path(interpret, monkeypatch):
    interpret("v5p")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 16)
    x, labels, w = _problem(3, 40, 128, 260, "hv", "float32")

    def loss(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu", keep_logits=True,
                                    return_argmax=True, block_sizes=BlockSizes(16, None, 128))

    (value, argmax), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.array_equal(np.asarray(argmax), np.where(labels == -100, -1, np.argmax(z, axis=1)))  # -1: ignored
    expected = oracle(np.asarray(x), labels, np.asarray(w))
    assert max_rel_error(value, expected["loss"]) <= TOLERANCES["float32"][0]
    assert max_rel_error(grads[0], expected["dx"]) <= TOLERANCES["float32"][1]


@pytest.mark.slow  # 7 s: both paths in the race-checked interpreter
def test_bf16_gradients_are_as_accurate_as_the_recompute_path(interpret, monkeypatch):
    """Kept logits are the same float32 products the recompute path forms again, and ``dw`` is summed
    in float32 across chunks: the bf16 gradient errors match the recompute path's."""
    interpret("v5e")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 32)
    x, labels, w = _problem(5, 96, 256, 640, "hv", "bfloat16")
    expected = _oracle(x, labels, w, "hv", {}, None, 1.0)
    errors = {}
    for keep in (True, False):
        options = dict(block_sizes=BlockSizes(32, None, 128))
        _, (dx, dw) = _value_and_grads(x, labels, w, keep_logits=keep, options=options, weights=None)
        errors[keep] = (max_rel_error(dx.astype(jnp.float32), expected["dx"]),
                        max_rel_error(dw.astype(jnp.float32), expected["dw"]))
    for kept, recomputed in zip(errors[True], errors[False], strict=True):
        assert kept <= 1.05 * recomputed + 1e-6, errors


@pytest.mark.slow  # 11 s in the race-checked interpreter
@pytest.mark.parametrize("layout,n,split", [("hv", 600, 2), ("vh", 230, 4)])
def test_a_hidden_size_in_tiles_matches_the_oracle(interpret, monkeypatch, layout, n, split):
    """The kept backward's hidden size in tiles (Llama-3 70B's plan on v5p and v6e): each tile walks the
    core's vocab blocks with its own ``x``, ``dx``, ``w`` and ``dw`` slices, over three chunks (the running
    ``dw``'s first, middle and last kernels) or one, ragged in N and V, on two cores (the last a block short),
    race-checked."""
    interpret("v5p")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 256)
    monkeypatch.setattr(kept_logits, "HIDDEN_SPLIT", split)
    h, v = 512, 5000
    x, labels, w = _problem(19, n, h, v, layout, "float32")
    plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec(w_layout=layout))
    assert plan.chunks == (3 if n == 600 else 1) and plan.backward.hidden_split == split
    assert plan.backward.nv == 3 and plan.backward.num_cores == 2
    _assert_kept_float32_grads_match_the_oracle_race_free(x, labels, w, layout)


@pytest.mark.slow  # 16 s in the race-checked interpreter, three plans (the interpreter tier's heaviest case)
def test_hidden_tiles_with_and_without_delta_over_the_logits_match_one_tile_exactly(interpret, monkeypatch):
    """The kept backward in two hidden tiles, each forming ``delta`` or the first writing it over the kept
    logits (packed bf16) for the second to read: bf16, a soft cap, label smoothing, z-loss and per-token
    temperatures, prompt-like dead token blocks (the walk skips them in every tile), ragged in N and V, two
    cores, three chunks. The loss and gradients are those of the same plan in one tile (bit for bit where each
    tile forms ``delta``; within a bf16 rounding where it is read back) and match the float64 oracle;
    race-checked."""
    from ce_pallas_tpu.target import CHIP_FACTS

    interpret("v5p")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 128)
    n, h, v = 330, 512, 3000  # three 128-token chunks, the last overlapping the second by 54 rows
    x, labels, w = _problem(23, n, h, v, "hv", "bfloat16")
    labels = np.where(np.arange(n) % 165 < 70, -100, labels)  # two 70-token prompts: dead blocks
    t = np.random.default_rng(3).uniform(0.5, 2.0, n).astype(np.float32)
    sizes = BlockSizes(64, None, 1024)  # 64-token blocks, three vocab blocks (the last ragged, core 1 one short)
    options = dict(block_sizes=sizes, logit_soft_cap=3.0, label_smoothing=0.1, logsumexp_weight=1e-3,
                   temperature=jnp.asarray(t))
    results = {}
    for split, over in ((1, False), (2, False), (2, True)):
        monkeypatch.setattr(kept_logits, "HIDDEN_SPLIT", split)
        monkeypatch.setitem(CHIP_FACTS, "v5p", dataclasses.replace(CHIP_FACTS["v5p"], delta_over_logits=over))
        plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec(block_sizes=sizes))
        assert (plan.backward.hidden_split, plan.backward.delta_over_logits) == (split, over)
        assert (plan.chunks, plan.chunk, plan.backward.num_cores, plan.backward.block_b, plan.backward.nv) == (
            3, 128, 2, 64, 3)
        jax.clear_caches()
        loss, grads = _value_and_grads(x, labels, w, keep_logits=True, options=options, weights=None)
        results[split, over] = [np.asarray(a, np.float32) for a in (loss, *grads)]
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    for name, tiled, whole in zip(("loss", "dx", "dw"), results[2, False], results[1, False], strict=True):
        assert np.array_equal(tiled, whole), name  # the same products, delta formed in each tile
    # Read back, delta is the same operand (its bits round-trip exactly), but the interpreter's CPU matmuls may
    # sum a bitcast operand in another order: a handful of bf16 roundings may flip.
    for name, read_back, whole in zip(("loss", "dx", "dw"), results[2, True], results[1, False], strict=True):
        # One bf16 rounding, or a float32 reordering's size where the sum cancels to next to nothing.
        assert np.all(np.abs(read_back - whole) <= 2.0**-7 * np.abs(whole) + 2.0**-16 * np.max(np.abs(whole))), name
    loss, dx, dw = results[2, True]
    expected = _oracle(x, labels, w, "hv", options, None, t)
    loss_tol, grad_tol = TOLERANCES["bfloat16"]
    assert max_rel_error(loss, expected["loss"]) <= loss_tol
    assert max_rel_error(dx, expected["dx"]) <= grad_tol
    assert max_rel_error(dw, expected["dw"]) <= grad_tol
    assert not np.any(dx[labels == -100])


@pytest.mark.covering(target=("v6e", "v5p", "v5e"), dtype=("bfloat16", "float32"),
                      extras=("weights", "plain", "z_loss+smoothing", "soft_cap"), chunk=(24, 4096), split=(1, 2),
                      fast=1)
def test_the_label_term_by_rows_gives_the_per_logit_terms_gradients(interpret, monkeypatch, target, dtype, extras,
                                                                     chunk, split):
    """``label_rows`` (a ``[V, H]`` head's label term added by rows: ``dw``'s in the kernel, ``dx``'s beside it)
    against the term per logit: the same loss and gradients up to the order of float32 sums (bf16 gradients bit
    for bit, bar a few roundings that flip), and the float64 oracle's; ignored labels, a label a third of the rows
    share, signed and zero weights, V and N ragged, several chunks or one, the hidden size whole or in two tiles
    (v5p and v6e: ``delta`` formed by the first, over the kept logits), one core or two (v5p), race-checked."""
    from ce_pallas_tpu.target import CHIP_FACTS

    interpret(target)
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", chunk)
    monkeypatch.setattr(kept_logits, "HIDDEN_SPLIT", split)
    n, h, v = 45, 200 if split == 1 else 256, 700
    x, labels, w = _problem(7 + len(extras), n, h, v, "vh", dtype)
    labels = np.where(np.arange(n) % 3 == 1, 300, labels)  # a frequent token: a third of the rows add to one row
    sizes = BlockSizes(16, None, 256)
    options: dict = dict(w_layout="vh", block_sizes=sizes, temperature=0.7)
    if extras == "z_loss+smoothing":
        options.update(logsumexp_weight=1e-3, label_smoothing=0.1)
    if extras == "soft_cap":
        options.update(logit_soft_cap=3.0)
    weights = None
    if extras == "weights":
        weights = np.random.default_rng(n).uniform(-1.0, 2.0, n).astype(np.float32)
        weights[::7] = 0.0
    results = {}
    for by_rows in (False, True):
        monkeypatch.setitem(CHIP_FACTS, target, dataclasses.replace(CHIP_FACTS[target], kept_label_rows=by_rows))
        plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec(w_layout="vh", block_sizes=sizes))
        assert plan.backward.label_rows == by_rows and plan.backward.nv == 3 and plan.backward.hidden_split == split
        jax.clear_caches()
        loss, grads = _value_and_grads(x, labels, w, keep_logits=True, options=options, weights=weights)
        results[by_rows] = [np.asarray(a, np.float32) for a in (loss, *grads)]
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    for name, rows, per_logit in zip(("loss", "dx", "dw"), results[True], results[False], strict=True):
        if dtype == "float32":
            assert max_rel_error(rows, per_logit) <= 1e-5, name
        else:  # bf16: bit for bit but where XLA's entry without the term and the kernel's differ in the last bit and
            # its rounding to bf16 flips (an ulp of that entry times the label's row of w or x), or an output's does
            differs = rows != per_logit
            assert np.mean(differs) <= 0.02, (name, np.mean(differs))
            assert max_rel_error(rows, per_logit) <= 2.0**-7, name
    loss, dx, dw = results[True]
    expected = _oracle(x, labels, w, "vh", options, weights, 0.7)
    loss_tol, grad_tol = TOLERANCES[dtype]
    assert max_rel_error(loss, expected["loss"]) <= loss_tol
    assert max_rel_error(dx, expected["dx"]) <= grad_tol
    assert max_rel_error(dw, expected["dw"]) <= grad_tol


def _rl_oracle(x, labels, w, token_fn, inputs, temperature: float) -> tuple[float, np.ndarray, np.ndarray]:
    """The RL objective over ``[V, H]`` ``w`` in float64 from the full logits: ``(loss, dx, dw)``."""
    with jax.enable_x64(True):
        counted = jnp.asarray(labels) >= 0
        safe = jnp.where(counted, jnp.asarray(labels), 0)
        inputs64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), inputs)

        def loss(x_, w_):
            log_p = jax.nn.log_softmax(x_ @ w_.T / temperature, axis=-1)
            logp = jnp.take_along_axis(log_p, safe[:, None], axis=-1)[:, 0]
            entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
            return jnp.sum(jnp.where(counted, token_fn(logp, entropy, inputs64), 0.0))

        x64, w64 = (jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32)), jnp.float64) for a in (x, w))
        value, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1))(x64, w64)
        return float(value), np.asarray(dx), np.asarray(dw)


@pytest.mark.covering(dtype=("bfloat16", "float32"), chunk=(24, 4096), fast=1)
def test_the_label_term_by_rows_with_the_entropys_terms_gives_the_per_logit_terms_gradients(interpret, monkeypatch,
                                                                                           dtype, chunk):
    """The RL objective with an entropy bonus (``with_expected``: ``delta`` with the entropy's terms) on v6e's kept
    path adds a ``[V, H]`` head's label term by rows as the plain loss does: the same value and gradients as the
    term per logit (bf16 bit for bit bar a few roundings that flip) and the float64 oracle's; and with the entropy's
    cotangent in the exponent (``fold_entropy_cotangent``, v6e's default) or not, as accurate against the oracle.
    Clipped ratios, a KL term, ignored labels, a label a third of the rows share, zero weights, V and N ragged,
    several chunks or one, race-checked."""
    from ce_core import linear_token_objective
    from ce_core.policy import PolicyInputs, PolicyLoss
    from ce_pallas_tpu.target import CHIP_FACTS

    interpret("v6e")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", chunk)
    n, h, v = 45, 200, 700
    x, labels, w = _problem(17, n, h, v, "vh", dtype)
    labels = np.where(np.arange(n) % 3 == 1, 300, labels)
    rng = np.random.default_rng(n)
    current = -np.log(v) + 0.3 * rng.standard_normal(n)
    weights = np.where(labels >= 0, 1.0 / n, 0.0).astype(np.float32)
    weights[::7] = 0.0
    inputs = PolicyInputs(old_logp=(current + 0.3 * rng.standard_normal(n)).astype(np.float32),
                          advantages=rng.standard_normal(n).astype(np.float32), weights=weights,
                          ref_logp=(current + 0.1 * rng.standard_normal(n)).astype(np.float32))
    # bf16 moves logp by ~1e-2: clipping at a kink would then differ from the oracle's, so it is wide there.
    token_fn = PolicyLoss(kl_coefficient=0.05, entropy_coefficient=0.05,
                          **(dict(clip_low=10.0) if dtype == "bfloat16" else dict(clip_high=0.28)))
    sizes = BlockSizes(16, None, 256)

    def objective(x_, w_):
        return linear_token_objective(x_, labels, w_, token_fn, inputs, implementation="pallas_tpu",
                                      keep_logits=True, w_layout="vh", block_sizes=sizes, temperature=0.7)

    results = {}
    for in_exponent, by_rows in ((False, False), (False, True), (True, False), (True, True)):
        monkeypatch.setitem(CHIP_FACTS, "v6e", dataclasses.replace(CHIP_FACTS["v6e"], kept_label_rows=by_rows,
                                                                   kept_entropy_in_exponent=in_exponent))
        spec = StatsSpec(w_layout="vh", block_sizes=sizes, with_expected=True)
        plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, spec)
        assert plan.backward.label_rows == by_rows and plan.backward.with_expected
        assert plan.backward.cotangent_in_exponent == in_exponent and plan.backward.nv == 3
        jax.clear_caches()
        value, grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))(x, w)
        results[in_exponent, by_rows] = [np.asarray(a, np.float32) for a in (value, *grads)]
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    for in_exponent in (False, True):
        for name, rows, per_logit in zip(("loss", "dx", "dw"), results[in_exponent, True],
                                         results[in_exponent, False], strict=True):
            if dtype == "float32":
                assert max_rel_error(rows, per_logit) <= 1e-5, name
            else:  # as the plain loss's test: an entry whose rounding to bf16 flips
                assert np.mean(rows != per_logit) <= 0.02, (name, np.mean(rows != per_logit))
                assert max_rel_error(rows, per_logit) <= 2.0**-7, name
    expected = _rl_oracle(x, labels, w, token_fn, inputs, 0.7)
    errors = {key: [max_rel_error(value, want) for value, want in zip(values, expected, strict=True)]
              for key, values in results.items()}
    for key, (loss_error, dx_error, dw_error) in errors.items():
        assert loss_error <= TOLERANCES[dtype][0] and max(dx_error, dw_error) <= TOLERANCES[dtype][1], (key, errors)
    folded, formed = errors[True, True], errors[False, True]  # the fold no less accurate (bar its own roundings)
    assert all(a <= 1.1 * b + TOLERANCES[dtype][1] / 16 for a, b in zip(folded, formed, strict=True)), errors
    assert np.abs(expected[2]).max() > 0


@pytest.mark.interpreter
@pytest.mark.parametrize("n,h,split", [(330, 200, 1), (230, 512, 2)])
def test_the_kept_backward_with_x_transposed_matches_it_untransposed(interpret, monkeypatch, n, h, split):
    """v6e's kept backward of an ``[H, V]`` head holds the chunk's ``x`` as ``x.T`` (padded by XLA to whole
    token blocks and 128-wide hidden tiles): the same gradients as with ``x`` as it is, to float32 rounding,
    and the float64 oracle's; three chunks (the running ``dw``'s first, middle and last kernels) with H ragged,
    or one chunk of 230 tokens in two hidden tiles (``delta`` over the kept logits); the first (or only) chunk's
    ``dw`` slots zeroed by DMA from a zero block, as v6e's plan does; bf16, dead prompt blocks, race-checked."""
    from ce_pallas_tpu.target import CHIP_FACTS

    interpret("v6e")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 128 if split == 1 else 256)
    monkeypatch.setattr(kept_logits, "HIDDEN_SPLIT", split)
    v = 3000
    x, labels, w = _problem(29, n, h, v, "hv", "bfloat16")
    labels = np.where(np.arange(n) < 130, -100, labels)  # a prompt: the first token block dead
    results = {}
    for transposed in (False, True):
        monkeypatch.setitem(CHIP_FACTS, "v6e", dataclasses.replace(CHIP_FACTS["v6e"], kept_x_transposed=transposed))
        plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec())
        assert plan.backward.x_transposed == transposed and plan.backward.hidden_split == split
        assert plan.backward.dw_zeros_by_dma
        assert plan.chunks == (3 if split == 1 else 1) and plan.backward.hidden == h
        jax.clear_caches()
        loss, grads = _value_and_grads(x, labels, w, keep_logits=True, options={}, weights=None)
        results[transposed] = [np.asarray(a, np.float32) for a in (loss, *grads)]
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    for name, moved, plain in zip(("loss", "dx", "dw"), results[True], results[False], strict=True):
        # The same products in another operand order: a bf16 rounding of dw may flip, nothing more.
        assert np.all(np.abs(moved - plain) <= 2.0**-7 * np.abs(plain) + 2.0**-16 * np.max(np.abs(plain))), name
    loss, dx, dw = results[True]
    expected = _oracle(x, labels, w, "hv", {}, None, 1.0)
    loss_tol, grad_tol = TOLERANCES["bfloat16"]
    assert max_rel_error(loss, expected["loss"]) <= loss_tol
    assert max_rel_error(dx, expected["dx"]) <= grad_tol
    assert max_rel_error(dw, expected["dw"]) <= grad_tol


@pytest.mark.interpreter
@pytest.mark.parametrize("layout,n,chunk,block_b,piece,pieces", [
    ("hv", 330, None, 128, 128, (128, 128, 74)),  # one chunk: first, middle and last pieces, the last ragged; x.T
    ("vh", 200, 96, 32, 64, (64, 32)),  # three chunks (the last overlapping): every chunk role, in pieces
])
def test_a_chunks_backward_in_pieces_matches_it_whole(interpret, monkeypatch, layout, n, chunk, block_b, piece,
                                                      pieces):
    """The backward of each chunk in pieces (``KeptPlan.pieces``: a call per piece over its rows of the chunk's
    kept logits, the float32 running ``dw`` passed between them as between chunks) matches the float64 oracle,
    and (one chunk) gives the loss and gradients of the same plan's backward over the whole chunk bit for bit
    (the same products, ``dw`` summed over the token blocks in the same order): bf16, a soft cap, per-token
    temperatures, prompt-like dead token blocks, ragged in V, two cores, race-checked."""
    interpret("v5p")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", chunk)
    h, v = 200, 3000
    x, labels, w = _problem(31, n, h, v, layout, "bfloat16")
    labels = np.where(np.arange(n) % 165 < 70, -100, labels)
    t = np.random.default_rng(5).uniform(0.5, 2.0, n).astype(np.float32)
    sizes = BlockSizes(block_b, None, 1024)
    options = dict(w_layout=layout, block_sizes=sizes, logit_soft_cap=3.0, temperature=jnp.asarray(t))
    results = {}
    for longest in (None, piece) if chunk is None else (piece,):  # each pallas call interprets for ~2 s
        monkeypatch.setattr(kept_logits, "PIECE_TOKENS", longest)
        plan = kept_logits.plan_chunks(n, h, v, x.dtype, w.dtype, StatsSpec(w_layout=layout, block_sizes=sizes))
        assert plan.pieces == (() if longest is None else pieces) and plan.backward.block_b == block_b
        assert plan.chunks == (1 if chunk is None else 3) and plan.backward.num_cores == 2
        assert plan.backward.x_transposed == (layout == "hv")
        jax.clear_caches()
        loss, grads = _value_and_grads(x, labels, w, keep_logits=True, options=options, weights=None)
        results[longest] = [np.asarray(a, np.float32) for a in (loss, *grads)]
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    if None in results:
        for name, in_pieces, whole in zip(("loss", "dx", "dw"), results[piece], results[None], strict=True):
            assert np.array_equal(in_pieces, whole), name
    loss, dx, dw = results[piece]
    expected = _oracle(x, labels, w, layout, options, None, t)
    loss_tol, grad_tol = TOLERANCES["bfloat16"]
    assert max_rel_error(loss, expected["loss"]) <= loss_tol
    assert max_rel_error(dx, expected["dx"]) <= grad_tol
    assert max_rel_error(dw, expected["dw"]) <= grad_tol


def test_the_plan_takes_hidden_tiles_or_more_chunks_only_where_the_roofline_gains():
    """Llama-3 70B's head (H=8192): whole, v5p's VMEM leaves 256-token chunks (below the ~350 whose float32
    dw traffic hides) and v6e's 256-column vocab blocks; of two and four hidden tiles the plan prefers the
    one that fits the longest chunk (four), and on v6e takes 16384 tokens in eight 2048-token chunks
    rather than the default's six 3072-token ones (18432 rows). An unstarved whole plan stays whole
    unless tiles are estimated more than 3% faster: Llama-3 8B on v5e and v5p stays whole; on v6e 4096
    tokens go in one chunk (whole: three 1536-token chunks, an eighth more rows), its backward whole in pieces
    of 1536, 1536 and 1024 rows rather than in two tiles, and 70B on v5e in 1024-token
    chunks in two tiles (whole: 512, its float32 dw's traffic at the MXU's pace). v6e forms ``delta`` once
    per tile at a cost the estimate counts: 16384 tokens of Llama-3 8B stay whole (eleven 1536-token
    chunks, against eight in two tiles). Explicit tiles stay whole; a split needs H a whole number of
    128-wide tiles."""
    from ce_pallas_tpu.backward import backward_call
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tiling import vmem_budget

    bf16, spec = jnp.bfloat16, StatsSpec()
    v5e, v5p, v6e = (Target(gen, CHIP_FACTS[gen].num_cores, None) for gen in ("v5e", "v5p", "v6e"))
    budget = {target: vmem_budget(target) for target in (v5e, v5p, v6e)}
    for target, chunk, block_v in ((v5p, 1024, 512), (v6e, 2048, 1024)):
        plan = kept_logits.plan_chunks(16384, 8192, 128256, bf16, bf16, spec, target)
        b = plan.backward
        assert (b.hidden_split, b.hidden_tile, b.block_h, plan.chunk, b.block_v) == (4, 2048, 2048, chunk, block_v)
        assert plan.chunks * plan.chunk == 16384  # no chunk overlaps the one before
        assert plan.chunk >= kept_logits.hiding_chunk(8192, 2, target)
        halves = kept_logits._fit_split(4096, 8192, 128256, bf16, bf16, spec, target, budget[target], 2, False)
        quarters = kept_logits._fit_split(4096, 8192, 128256, bf16, bf16, spec, target, budget[target], 4, False)
        assert halves is not None and quarters is not None and halves[2] < quarters[2]  # two tiles: shorter chunk
        assert plan.running_dw_shape[0] == 8192  # the running dw stays whole: each tile adds its rows
        kept, recompute = kept_logits.estimated_seconds(plan, bf16, target)  # the logits read once per tile
        assert kept < 0.9 * recompute
    for target in (v5e, v5p, v6e):  # v6e: eleven whole 1536-token chunks; eight in two tiles cost more
        assert kept_logits.plan_chunks(16384, 4096, 128256, bf16, bf16, spec, target).backward.hidden_split == 1
    llama8b = kept_logits.plan_chunks(4096, 4096, 128256, bf16, bf16, spec, v6e)
    assert (llama8b.chunks, llama8b.pieces, llama8b.backward.hidden_split) == (1, (1536, 1536, 1024), 1)
    short = kept_logits.plan_chunks(2048, 4096, 128256, bf16, bf16, spec, v6e)  # 1024-row pieces would not hide dw
    assert (short.chunks, short.pieces, short.backward.hidden_split) == (1, (), 2)
    with pytest.MonkeyPatch.context() as patch:  # without the pieces' budget: the one chunk in two tiles
        patch.setattr(kept_logits, "keep_logits_budget", lambda target: llama8b.extra_bytes - 1)
        tiled = kept_logits.plan_chunks(4096, 4096, 128256, bf16, bf16, spec, v6e)
        assert (tiled.chunks, tiled.pieces, tiled.backward.hidden_split) == (1, (), 2)
    whole = kept_logits._fit_split(4096, 4096, 128256, bf16, bf16, spec, v6e, budget[v6e], 1, False)
    assert whole is not None and whole[2] == 1536 and not kept_logits._starved(whole, 4096, bf16, v6e)
    v5e_70b = kept_logits.plan_chunks(16384, 8192, 128256, bf16, bf16, spec, v5e)
    assert (v5e_70b.chunk, v5e_70b.backward.hidden_split) == (1024, 2)
    with pytest.MonkeyPatch.context() as patch:  # a chunk set by hand is taken as it is, whole
        patch.setattr(kept_logits, "CHUNK_TOKENS", 512)
        assert kept_logits.plan_chunks(16384, 4096, 128256, bf16, bf16, spec, v6e).chunk == 512
    explicit = StatsSpec(block_sizes=BlockSizes(256, None, 256))
    assert kept_logits.plan_chunks(16384, 8192, 128256, bf16, bf16, explicit, v5p).backward.hidden_split == 1
    assert kept_logits.plan_chunks(4096, 8000, 128256, bf16, bf16, spec, v5p).backward.hidden_split == 1  # H % 256
    wrong = dataclasses.replace(kept_logits.plan_chunks(1024, 200, 300, jnp.float32, jnp.float32, spec, v5p).backward,
                                hidden_split=2)
    x, w = jnp.zeros((1024, 200)), jnp.zeros((200, 300))
    column = jnp.zeros((1024, 1))
    with pytest.raises(ValueError, match="hidden_split=2"):
        backward_call(x, w, column.astype(jnp.int32), column, column, column, None, None, None, wrong)


def test_backward_pieces_are_whole_token_blocks_start_and_end_the_running_dw_once_and_stay_in_the_kept_rows():
    """A chunk's backward pieces (``KeptPlan.pieces``): as few as the longest allows, all but the last the same
    whole number of token blocks; across a call's pieces the float32 running ``dw`` is started by the first and
    ended in ``w``'s dtype by the last, and held (counted in ``extra_bytes``) even in a call of one chunk; a
    piece's rows past the kept logits' buffer, a piece reading ``delta`` back over them, or pieces shorter than a
    token block are refused."""
    from ce_pallas_tpu.backward import backward_call
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    assert kept_logits._piece_rows(4096, 1536, 256) == (1536, 1536, 1024)
    assert kept_logits._piece_rows(3000, 1536, 256) == (1536, 1464)
    assert kept_logits._piece_rows(200, 80, 32) == (64, 64, 64, 8)
    assert kept_logits._piece_rows(128, 48, 32) == (32, 32, 32, 32)
    assert kept_logits._piece_rows(1024, 1536, 256) == (1024,)
    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    bf16 = jnp.bfloat16
    plan = kept_logits.plan_chunks(4096, 4096, 128256, bf16, bf16, StatsSpec(), v6e)
    ends = {role: [(cfg.dw_from_running, cfg.dw_to_running, cfg.n) for cfg in plan.piece_configs(role)]
            for role in ("only", "first", "middle", "last")}
    assert ends["only"] == [(False, True, 1536), (True, True, 1536), (True, False, 1024)]
    assert ends["first"] == [(False, True, 1536), (True, True, 1536), (True, True, 1024)]
    assert ends["middle"] == [(True, True, 1536), (True, True, 1536), (True, True, 1024)]
    assert ends["last"] == [(True, True, 1536), (True, True, 1536), (True, False, 1024)]
    assert plan.logits_shape[0] == 4096 and plan.backward_calls == 3
    b = plan.backward
    assert plan.extra_bytes == 4 * (math.prod(plan.logits_shape) + math.prod(plan.running_dw_shape)
                                    + b.padded_n * b.hp + math.prod(b.dw_acc_shape))
    assert plan.extra_bytes <= kept_logits.keep_logits_budget(v6e)

    small = kept_logits.plan_chunks(1024, 512, 300, jnp.float32, jnp.float32, StatsSpec(), v6e)
    only = small.piece_configs("only")[0]
    x, w, column = jnp.zeros((1024, 512)), jnp.zeros((512, 300)), jnp.zeros((1024, 1))
    logits = jnp.zeros(small.logits_shape)
    tiled = dataclasses.replace(only, hidden_split=2, block_h=256, delta_over_logits=True, logits_row_block=1)
    for cfg, match in ((dataclasses.replace(only, logits_row_block=1), "run past the kept logits"),
                       (tiled, "logits_row_block needs the kept-logits mode without delta_over_logits")):
        with pytest.raises(ValueError, match=match):
            backward_call(x, w, column.astype(jnp.int32), column, column, column, None, None, None, cfg,
                          kept=(logits, None))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kept_logits, "PIECE_TOKENS", 8)
        with pytest.raises(ValueError, match="PIECE_TOKENS=8"):
            kept_logits.plan_chunks(1024, 200, 300, jnp.float32, jnp.float32, StatsSpec(), v6e)


def test_the_kept_forward_grows_its_token_block_where_the_logits_writes_would_not_hide():
    """The kept forward writes 2 / Hp float32 bytes a flop beside ``w``'s reads: Qwen2.5-1.5B's tied head
    (H=1536) on v6e (560 flops a byte) moves more than its matmuls hide at the recompute forward's
    1024-row blocks, so the kept forward takes the 4096-token chunk in one block, its vocab block
    narrowed to fit VMEM; Llama-3 8B's 1536-token chunks (16384 tokens) go from 768 rows to 1536. Where
    the traffic hides (v5p) the token block is the recompute forward's, and explicit tiles stay."""
    from ce_pallas_tpu import ops
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tiling import vmem_budget

    bf16 = jnp.bfloat16
    v5p, v6e = (Target(gen, CHIP_FACTS[gen].num_cores, None) for gen in ("v5p", "v6e"))
    tied = StatsSpec(w_layout="vh")
    plan = kept_logits.plan_chunks(16384, 1536, 151936, bf16, bf16, tied, v6e)
    shape = ops.problem_shape(plan.chunk, 1536, 151936, bf16, bf16, tied)
    recompute = ops.make_plan(plan.chunk, 1536, 151936, bf16, bf16, tied, v6e).forward
    f = plan.forward
    assert (plan.chunk, f.block_b, f.padded_n) == (4096, 4096, 4096) and f.block_v < recompute.block_v
    assert not kept_logits._kept_forward_hides(recompute.block_b, shape, v6e)
    assert kept_logits._kept_forward_hides(f.block_b, shape, v6e)
    assert kept_logits._forward_need(f, shape, v6e) <= vmem_budget(v6e)
    llama = kept_logits.plan_chunks(16384, 4096, 128256, bf16, bf16, StatsSpec(), v6e)
    assert (llama.chunk, llama.forward.block_b) == (1536, 1536)
    on_v5p = kept_logits.plan_chunks(16384, 1536, 151936, bf16, bf16, tied, v5p)
    base = ops.make_plan(on_v5p.chunk, 1536, 151936, bf16, bf16, tied, v5p)
    shape = ops.problem_shape(on_v5p.chunk, 1536, 151936, bf16, bf16, tied)
    halved_only = kept_logits._fit_forward(base, shape, v5p, vmem_budget(v5p), explicit=True)  # no growth
    assert on_v5p.forward == dataclasses.replace(halved_only, n=on_v5p.chunk)
    assert kept_logits._kept_forward_hides(on_v5p.forward.block_b, shape, v5p)
    explicit = StatsSpec(w_layout="vh", block_sizes=BlockSizes(1024, None, 4096))
    assert kept_logits.plan_chunks(16384, 1536, 151936, bf16, bf16, explicit, v6e).forward.block_b == 1024


def test_the_kept_forward_fits_vmem_with_the_most_logits_a_step_and_the_most_rows_on_a_tie():
    """Where the recompute forward's tiles and the kept logits' blocks do not fit VMEM, the kept forward
    takes the fitting halvings with the largest step, the most rows on a tie: v5p, Llama-3 8B's head in
    512-token chunks, 512 x 1024 (1.032 of its MXU minimum in libtpu's schedule), not 256 x 2048 (1.054);
    TPU7x, Qwen2.5-0.5B's tied head, 1024 x 2048, where 2048 x 1024 does not fit and 1024 x 1024 would."""
    from ce_pallas_tpu import ops
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tiling import vmem_budget

    bf16 = jnp.bfloat16
    for gen, h, v, spec, chosen in (("v5p", 4096, 128256, StatsSpec(), (512, 1024)),
                                    ("tpu7x", 896, 151936, StatsSpec(w_layout="vh"), (1024, 2048))):
        target = Target(gen, CHIP_FACTS[gen].num_cores, None)
        plan = kept_logits.plan_chunks(4096, h, v, bf16, bf16, spec, target)
        base = ops.make_plan(plan.chunk, h, v, bf16, bf16, spec, target)
        shape = ops.problem_shape(plan.chunk, h, v, bf16, bf16, spec)
        budget = vmem_budget(target)

        def need(block_b: int, block_v: int, base=base, shape=shape, target=target) -> int:
            tiles = dataclasses.replace(base.forward, keep_logits=True, block_b=block_b, block_v=block_v)
            return kept_logits._forward_need(tiles, shape, target)

        recompute = (base.forward.block_b, base.forward.block_v)
        assert need(*recompute) > budget  # the rule's case
        fitted = kept_logits._fit_forward(base, shape, target, budget, explicit=True)  # before any growth
        b, bv = fitted.block_b, fitted.block_v
        assert (b, bv) == chosen and need(b, bv) <= budget
        assert need(2 * b, bv) > budget or 2 * b > recompute[0]  # no larger step fits
        assert need(b, 2 * bv) > budget or 2 * bv > recompute[1]
        if 2 * bv <= recompute[1]:  # as many logits, fewer rows: fits too, not taken
            assert need(b // 2, 2 * bv) <= budget
        if 2 * b <= recompute[0]:  # as many logits, more rows: does not fit
            assert need(2 * b, bv // 2) > budget
        assert (plan.forward.block_b, plan.forward.block_v) == chosen


def test_a_kept_plans_kernels_fit_vmem_or_the_kept_path_is_refused_while_tracing(interpret):
    """Both kernels of every kept plan fit the generation's VMEM budget, awkward heads included; where no
    chunk's would (a hidden size whose resident ``x`` and float32 ``dx`` fill VMEM at 256 tokens),
    ``keep_logits=True`` is refused with ``UnsupportedError`` naming the argument and the default recomputes.
    TPU7x, a [4904, 1185] head at 17143 tokens went to libtpu in 1792-token chunks needing 67 MB of its 64
    (a random-shape run, 2026-12-02): a one-block vocabulary of 1185 entries was never narrowed."""
    from ce_core import UnsupportedError
    from ce_pallas_tpu import ops
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tiling import vmem_budget

    bf16 = jnp.bfloat16
    for gen, n, h, v, layout in (("tpu7x", 17143, 4904, 1185, "hv"), ("tpu7x", 1800, 4904, 1185, "hv"),
                                 ("v5p", 5000, 7000, 1500, "vh"), ("v6e", 3000, 20000, 32000, "hv"),
                                 ("v5e", 4097, 4096, 128256, "hv")):
        target = Target(gen, CHIP_FACTS[gen].num_cores, None)
        spec = StatsSpec(w_layout=layout)
        plan = kept_logits.plan_chunks(n, h, v, bf16, bf16, spec, target)
        shape = ops.problem_shape(plan.chunk, h, v, bf16, bf16, spec)
        budget = vmem_budget(target)
        assert kept_logits._backward_need(plan.backward, shape) <= budget, (gen, h, v)
        assert kept_logits._forward_need(plan.forward, shape, target) <= budget, (gen, h, v)
    tpu7x = Target("tpu7x", CHIP_FACTS["tpu7x"].num_cores, None)
    # A chunk shrunk to fit stays in whole 256s and its backward's token block a whole 128-row multiple that
    # divides it (1792 -> 768 tokens in one 768-row block; before, 896 and then 448 in the recompute's 16 rows).
    fitted = kept_logits._fit_split(1792, 4904, 1185, bf16, bf16, StatsSpec(), tpu7x, vmem_budget(tpu7x), 1, False)
    assert fitted is not None and fitted[2] == 768 and fitted[1].block_b == 768
    with pytest.raises(UnsupportedError, match="keep_logits=True"):
        kept_logits.plan_chunks(4096, 20000, 32000, bf16, bf16, StatsSpec(keep_logits=True), tpu7x)
    assert kept_logits.choose(4096, 20000, 32000, bf16, bf16, StatsSpec(), tpu7x) is None
    # Through the API: refused while tracing, before any kernel, so an implementation list moves on.
    interpret("tpu7x")
    x, labels, w = (jax.ShapeDtypeStruct((512, 20000), bf16), jax.ShapeDtypeStruct((512,), jnp.int32),
                    jax.ShapeDtypeStruct((20000, 3000), bf16))

    def gradient(implementation):
        loss = functools.partial(linear_cross_entropy, implementation=implementation, keep_logits=True)
        return jax.eval_shape(jax.grad(lambda x, w, labels: loss(x, labels, w), argnums=(0, 1)), x, w, labels)

    with pytest.raises(UnsupportedError, match="keep_logits=True"):
        gradient("pallas_tpu")
    with pytest.warns(UserWarning, match="falling back to 'xla'"):
        dx, dw = gradient(["pallas_tpu", "xla"])
    assert dx.shape == x.shape and dw.shape == w.shape


def test_the_plan_keeps_whole_token_blocks_per_chunk_and_pads_the_buffers(interpret):
    interpret("v5p")
    from ce_core import StatsSpec

    plan = kept_logits.plan_chunks(1000, 200, 300, jnp.float32, jnp.float32,
                                   StatsSpec(block_sizes=BlockSizes(16, None, 128)), chunk_tokens=100)
    assert plan.chunk == 96 and plan.chunks == 11  # 100 rounded down to whole 16-row blocks
    f, b = plan.forward, plan.backward
    assert f.keep_logits and b.kept_logits
    rows, columns = plan.logits_shape
    assert rows % f.block_b == rows % b.block_b == 0 and rows >= plan.chunk
    # Both cores' blocks, the last core's missing one included: 3 blocks of 128 split 2 + 1 -> 4.
    assert columns == 4 * 128
    assert plan.running_dw_shape == (256, 3 * 128)  # H padded to 256, whole vocab blocks
    assert plan.extra_bytes == 4 * (rows * columns + 256 * 384)  # one logits buffer through the chunks
    # A token count nobody tuned for (v6e, Qwen3-0.6B's tied head): the forward's block the whole chunk (3,008
    # rows), the backward's a third of it; the buffer spans the longer padded extent, not a whole number of both
    # blocks (their lcm, 94,752 rows, would be 31 GB of bf16 logits and their maxima; 3,024 rows are 1.2 GB).
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    untuned = kept_logits.plan_chunks(3000, 1024, 151936, jnp.bfloat16, jnp.bfloat16, StatsSpec(w_layout="vh"), v6e)
    f, b = untuned.forward, untuned.backward
    assert untuned.chunks == 1 and (f.padded_n, b.padded_n) == (3008, 3024)
    assert untuned.logits_shape[0] == 3024 and untuned.extra_bytes < 1.25 * 2**30


def test_v6e_pads_a_chunk_to_whole_lane_token_blocks_where_they_let_its_backward_hold_products_transposed(
        monkeypatch):
    """Where no whole 128-row block divides a chunk (3,000 or 2,900 tokens a device, Qwen2.5-0.5B's width), v6e's
    plan pads it to 128-row token blocks rather than take the recompute plan's 16-row multiple, so that the kept
    backward holds ``dx`` (and a tied head's ``dw``) transposed, as long as the padded rows stay within
    :data:`kept_logits.KEPT_LANE_PADDING_ALLOWANCE` of the recompute block's. Not where the padding would cost
    more (700 tokens), nor where nothing pads the MXU (``H`` 1024) or the chip holds nothing transposed (v5p)."""
    from ce_core import StatsSpec
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    def backward(generation: str, n: int, h: int, layout: str):
        target = Target(generation, CHIP_FACTS[generation].num_cores, None)
        plan = kept_logits.plan_chunks(n, h, 151936, jnp.bfloat16, jnp.bfloat16, StatsSpec(w_layout=layout), target)
        assert plan.logits_shape[0] >= plan.backward.padded_n, plan
        return plan.backward

    def without_the_rule(generation: str, n: int, h: int, layout: str):
        with monkeypatch.context() as m:
            m.setattr(kept_logits, "KEPT_LANE_PADDING_ALLOWANCE", 1.0)  # the recompute plan's block only
            return backward(generation, n, h, layout)

    for n in (3000, 2900):
        for layout in ("vh", "hv"):
            lanes, sixteens = backward("v6e", n, 896, layout), without_the_rule("v6e", n, 896, layout)
            assert (lanes.block_b, lanes.nb) == (1024, 3) and sixteens.block_b % 128, (lanes, sixteens)
            assert lanes.dx_transposed and lanes.kept_dw_transposed == (layout == "vh")
            assert not sixteens.dx_transposed and not sixteens.kept_dw_transposed
            assert sixteens.padded_n < lanes.padded_n <= kept_logits.KEPT_LANE_PADDING_ALLOWANCE * sixteens.padded_n
    short = backward("v6e", 700, 896, "vh")  # 3 x 256 = 768 rows against 3 x 240 = 720: 6.7% more
    assert short.block_b % 128 and not short.dx_transposed
    for generation, h in (("v6e", 1024), ("v5p", 896)):
        assert backward(generation, 3000, h, "vh") == without_the_rule(generation, 3000, h, "vh"), (generation, h)


#: libtpu's figures for the scoped VMEM of v6e's kept forward with bf16 logits, compiled alone with the core's whole
#: VMEM as its limit (libtpu 0.0.52, 2026-12-04; docs/notes/2026-12-04-kept-store-whole-block.md): (H, block_b,
#: block_v, layout, lane-maxima columns, MiB). The kept plan's VMEM model must bound each from above.
KEPT_BF16_FORWARD_VMEM = [
    (384, 2048, 1024, "vh", 512, 25.25), (384, 4096, 2048, "vh", 512, 72.27),
    (896, 2048, 1024, "hv", 512, 39.06), (896, 2048, 2048, "hv", 512, 54.8), (896, 4096, 2048, "hv", 512, 96.59),
    (896, 4096, 2048, "vh", 512, 83.97), (896, 4096, 2048, "vh", 1024, 83.96), (896, 4096, 2048, "hv", 2048, 108.05),
    (1024, 4096, 1024, "vh", 512, 61.98), (1024, 4096, 2048, "vh", 2048, 102.19), (1024, 2048, 2048, "vh", 2048, 56.18),
]


def test_v6e_keeps_a_narrow_heads_bf16_logits_in_2048_column_blocks_of_two_maxima_groups_where_they_fit():
    """v6e's kept forward with bf16 logits takes 2048-column blocks of two 1024-column lane-maxima groups (the
    first group's logits stored while the second's products run) with the chunk's every row where they fit VMEM:
    Qwen2.5-0.5B's head (``H`` 896), 4096 x 2048; Qwen3-0.6B's (1024) does not fit and keeps 4096 x 1024, one
    group. The backward reads a block's maxima by the group (``kept_block_v``). The VMEM model bounds libtpu's
    figures (:data:`KEPT_BF16_FORWARD_VMEM`) from above, and a group that does not divide the block is refused."""
    from ce_pallas_tpu import ops
    from ce_pallas_tpu.forward import forward_call
    from ce_pallas_tpu.layout import cdiv
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tiling import vmem_budget

    bf16 = jnp.bfloat16
    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    budget = vmem_budget(v6e)
    for h, tiles, group in ((896, (4096, 2048), 1024), (1024, (4096, 1024), 1024)):
        plan = kept_logits.plan_chunks(16384, h, 151936, bf16, bf16, StatsSpec(w_layout="vh"), v6e)
        f, b = plan.forward, plan.backward
        assert (plan.chunk, (f.block_b, f.block_v), f.maxima_columns) == (4096, tiles, group), f
        assert b.kept_bf16 and b.kept_block_v == group and b.block_v % group == 0, b
        assert plan.maxima_shape == (plan.logits_shape[0], cdiv(plan.logits_shape[1], group) * 128)
        shape = ops.problem_shape(plan.chunk, h, 151936, bf16, bf16, StatsSpec(w_layout="vh"))
        wide = dataclasses.replace(f, block_v=2048, kept_maxima_columns=1024)
        assert (kept_logits._forward_need(wide, shape, v6e) <= budget) == (h == 896)
    for h, block_b, block_v, layout, group, mib in KEPT_BF16_FORWARD_VMEM:
        spec = StatsSpec(w_layout=layout)
        plan = kept_logits.plan_chunks(4096, h, 151936, bf16, bf16, spec, v6e)
        cfg = dataclasses.replace(plan.forward, block_b=block_b, block_v=block_v, kept_maxima_columns=group)
        shape = ops.problem_shape(4096, h, 151936, bf16, bf16, spec)
        need = kept_logits._forward_need(cfg, shape, v6e)
        assert plan.forward.kept_bf16 and need >= mib * 2**20, (h, block_b, block_v, layout, group)
    uneven = dataclasses.replace(plan.forward, block_v=2048, kept_maxima_columns=768)
    zeros = jnp.zeros((8, 128), bf16)
    with pytest.raises(ValueError, match="kept_maxima_columns=768"):
        forward_call(zeros, zeros, jnp.zeros((8, 1), jnp.int32), uneven, kept_shape=(4096, 151936))


def test_the_default_keeps_where_the_budget_allows_and_keeping_pays():
    """``keep_logits=None``: kept where the extra HBM fits ``min(4 GiB, HBM / 8)`` and the roofline has it
    faster; the chunk shrinks towards 1024 tokens to fit; one chunk holds no float32 running dw."""
    from ce_core import StatsSpec
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    bf16, spec = jnp.bfloat16, StatsSpec()
    v5e, v5p, v6e = (Target(gen, CHIP_FACTS[gen].num_cores, None) for gen in ("v5e", "v5p", "v6e"))
    assert kept_logits.keep_logits_budget(v5e) == 2 * 2**30 and kept_logits.keep_logits_budget(v5p) == 4 * 2**30
    llama = (16384, 4096, 128256)
    chosen = kept_logits.choose(*llama, bf16, bf16, spec, v5p)
    assert chosen is not None and chosen.extra_bytes <= 4 * 2**30
    kept, recompute = kept_logits.estimated_seconds(chosen, bf16, v5p)
    assert kept < 0.8 * recompute  # 6NHV against 8NHV, HBM hidden
    assert kept_logits.choose(*llama, bf16, bf16, spec, v5e) is None  # its float32 dw alone is 2.1 GB > 2 GiB
    assert kept_logits.choose(*llama, bf16, bf16, spec, v5p, budget_bytes=0) is None
    assert kept_logits.choose(16384, 8192, 128256, bf16, bf16, spec, v6e) is None  # 70B: 4.2 GB of float32 dw
    # Gemma-2 9B on v5p: 1024-token chunks would hold more than 4 GiB; 512-token ones fit.
    gemma = kept_logits.choose(16384, 3584, 256000, bf16, bf16, spec, v5p)
    assert kept_logits.plan_chunks(16384, 3584, 256000, bf16, bf16, spec, v5p).extra_bytes > 4 * 2**30
    assert gemma is not None and gemma.chunk == 512 and gemma.extra_bytes <= 4 * 2**30
    # A few tokens: the float32 dw's traffic costs more than the recompute's matmuls (v6e's ridge is 560 flop/B).
    assert kept_logits.choose(256, 4096, 128256, bf16, bf16, spec, v6e) is None
    # A narrow head on v6e: the forward's float32 logits cannot hide under its matmuls (H < 2 x 560), yet
    # keeping pays (libtpu's schedule: 0.93-0.96 of the recompute's time); the forward takes the chunk whole.
    for target in (v6e, v5p):
        narrow = kept_logits.choose(16384, 896, 151936, bf16, bf16, StatsSpec(w_layout="vh"), target)
        assert narrow is not None
        kept, recompute = kept_logits.estimated_seconds(narrow, bf16, target)
        assert kept < recompute
        if target is v6e:
            assert narrow.chunk == narrow.forward.block_b == 4096
    one = kept_logits.plan_chunks(1024, 896, 151936, bf16, bf16, spec, v5p)
    # One chunk: its logits, and (v5p, an [H, V] head) its x transposed, counted as float32; no running dw.
    assert one.chunks == 1 and one.backward.x_transposed
    assert one.extra_bytes == 4 * (math.prod(one.logits_shape) + one.backward.padded_n * one.backward.hp)
    assert kept_logits.plan_chunks(4096, 4096, 128256, bf16, bf16, spec, v5e).chunk == 2048  # 2 even chunks


def test_the_backend_takes_the_kept_path_by_default_unless_its_budget_is_zero(interpret, monkeypatch):
    """Through the public API: ``keep_logits=None`` keeps at a small shape (the extra bytes fit and keeping
    pays), a backend built with ``keep_logits_budget_bytes=0`` recomputes, and ``block_sizes_for`` says which."""
    from ce_core import Problem, StatsSpec, get_backend, register_backend, unregister_backend
    from ce_pallas_tpu.backend import PallasTpuBackend

    interpret("v5p")
    n, h, v = 1024, 384, 4096  # H past twice v5p's flops per byte (166): the forward's logits hide
    x, labels, w = _problem(11, n, h, v, "hv", "float32")
    problem = Problem(n, h, v, x.dtype, w.dtype, StatsSpec())
    expected = oracle(np.asarray(x), labels, np.asarray(w))
    called: list = []
    monkeypatch.setattr(kept_logits, "row_stats_and_grads", functools.partial(_spy, called,
                                                                               kept_logits.row_stats_and_grads))
    for backend, keeps in ((get_backend("pallas_tpu"), True), (PallasTpuBackend(keep_logits_budget_bytes=0), False)):
        report = backend.block_sizes_for(problem)
        assert report is not None
        said = report.details["keep_logits"]
        assert said.endswith("bytes extra") if keeps else said == "recompute"
        register_backend("pallas_tpu", lambda backend=backend: backend, replace=True)
        called.clear()
        try:
            _, (dx, dw) = _value_and_grads(x, labels, w, keep_logits=None, options={}, weights=None)
        finally:
            unregister_backend("pallas_tpu")
        assert bool(called) is keeps
        assert max_rel_error(dx, expected["dx"]) <= TOLERANCES["float32"][1]
        assert max_rel_error(dw, expected["dw"]) <= TOLERANCES["float32"][1]
    with pytest.raises(ValueError, match="keep_logits_budget_bytes"):
        PallasTpuBackend(keep_logits_budget_bytes=-1)


@pytest.mark.slow
@pytest.mark.xdist_group("llama3_8k_recompute")  # test_pallas_aot's real shapes compile the same recompute step
# v6e's case (~120 s of libtpu at slowdown 1) was dropped on 2026-12-02 when the slow tier outgrew CI's limit: v6e's
# kept default at this head is compiled by the 4096-token test below and, over a 2x2 mesh, by test_sharded_step.
@pytest.mark.parametrize("generation", ["v5e", "v5p"])
def test_the_default_compiles_and_holds_only_the_chunk_and_the_float32_dw(generation):
    """Llama-3 8B's head at 8192 tokens, bf16, compiled for the generation with the default
    ``keep_logits=None``: on v5p and v6e it keeps the logits, holding what the recompute step holds plus
    at most one chunk's logits, the float32 dw and a bf16 ``dx`` (``KeptPlan.extra_bytes + 2NH``), within
    the budget and below the float32 logits a materialised step holds; on v5e (a 2 GiB budget
    against a 2.1 GB float32 dw) it is the recompute step."""
    from ce_core import StatsSpec
    from ce_pallas_tpu.target import current_target, targeting
    from ce_pallas_tpu.tooling.aot import compile_loss_and_grads

    n, h, v = 8192, 4096, 128256  # the recompute step is test_pallas_aot's real shape, compiled once for both
    recompute = compile_loss_and_grads(generation, n, h, v, keep_logits=False)
    default = compile_loss_and_grads(generation, n, h, v)
    with targeting(generation):
        plan = kept_logits.choose(n, h, v, jnp.bfloat16, jnp.bfloat16, StatsSpec())
        budget = kept_logits.keep_logits_budget(current_target())
    assert recompute.temp_bytes is not None and default.temp_bytes is not None
    if generation == "v5e":
        assert plan is None and default.temp_bytes == recompute.temp_bytes
        return
    assert plan is not None and plan.chunks > 1 and plan.extra_bytes <= budget
    extra = default.temp_bytes - recompute.temp_bytes
    # At least the chunk's logits; at most those, the running dw and a bf16 dx beside the recompute's buffers.
    kept_logits_bytes = plan.logits_shape[0] * plan.kept_row_bytes
    assert kept_logits_bytes <= extra <= plan.extra_bytes + 2 * n * h, (extra, plan.extra_bytes)
    # Under the float32 logits a materialised step holds alone (4.2 GB; the float32 dw is 2.1 GB of these 3.0).
    assert default.temp_bytes < 4 * n * v


@pytest.mark.slow
def test_v6e_takes_4096_tokens_of_llama3_8b_in_one_chunk_its_backward_in_pieces_within_the_budget():
    """Llama-3 8B's head at 4096 tokens compiled for v6e with the default ``keep_logits=None``: one forward
    over the 4096 tokens, its backward over the kept logits in three pieces of whole hidden size (1536, 1536
    and 1024 rows, each from its offset in the buffer), holding what the recompute step holds plus the chunk's
    logits and the float32 running ``dw`` the pieces pass on, within the budget."""
    from ce_pallas_tpu.target import current_target, targeting
    from ce_pallas_tpu.tooling.aot import compile_loss_and_grads

    n, h, v = 4096, 4096, 128256
    with targeting("v6e"):
        plan = kept_logits.choose(n, h, v, jnp.bfloat16, jnp.bfloat16, StatsSpec())
        budget = kept_logits.keep_logits_budget(current_target())
    assert plan is not None and (plan.chunks, plan.pieces, plan.backward.hidden_split) == (1, (1536, 1536, 1024), 1)
    assert plan.extra_bytes <= budget
    recompute = compile_loss_and_grads("v6e", n, h, v, keep_logits=False)
    default = compile_loss_and_grads("v6e", n, h, v)
    assert recompute.temp_bytes is not None and default.temp_bytes is not None
    extra = default.temp_bytes - recompute.temp_bytes
    held = 4 * (math.prod(plan.logits_shape) + math.prod(plan.running_dw_shape))
    assert held <= extra <= plan.extra_bytes + 2 * n * h, (extra, plan.extra_bytes)


@pytest.mark.slow
@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("generation,h", [("v5p", 8192), ("v6e", 8192), ("tpu7x", 4096)])
def test_a_wide_heads_kept_path_compiles_in_hidden_tiles(generation, h):
    """Llama-3 70B's head (Llama-3 8B's on TPU7x, whose VMEM starves even that) split eight ways over the
    vocabulary (16032 entries a device), bf16, ``keep_logits=True`` over three or more chunks, compiled for the
    generation: its backward takes the hidden size in tiles (strided windows of ``x``, ``w``, the
    running ``dw`` and the ``dx`` partials), and the program holds the recompute step's buffers plus at
    most the chunk's logits, the float32 ``dw`` and a bf16 ``dx``."""
    from ce_pallas_tpu.target import targeting
    from ce_pallas_tpu.tooling.aot import compile_loss_and_grads

    v, bf16 = 16032, jnp.bfloat16
    with targeting(generation):
        n = 4 * kept_logits.plan_chunks(16384, h, v, bf16, bf16, StatsSpec()).chunk
        plan = kept_logits.plan_chunks(n, h, v, bf16, bf16, StatsSpec())
    assert plan.backward.hidden_split > 1 and plan.chunks >= 3  # first, middle and last kernels
    recompute = compile_loss_and_grads(generation, n, h, v, keep_logits=False)
    kept = compile_loss_and_grads(generation, n, h, v, keep_logits=True)
    assert recompute.temp_bytes is not None and kept.temp_bytes is not None
    extra = kept.temp_bytes - recompute.temp_bytes
    kept_logits_bytes = plan.logits_shape[0] * plan.kept_row_bytes
    assert kept_logits_bytes <= extra <= plan.extra_bytes + 2 * n * h, (extra, plan.extra_bytes)


@pytest.mark.slow
def test_v6e_adds_a_tied_heads_label_term_by_rows_and_compiles():
    """v6e's plan for a tied ``[V, H]`` head (Qwen3-0.6B's width, a quarter of its vocabulary) adds the label's term
    by rows (``label_rows``: SMEM operands and a loop per vocab block in the backward) and keeps its logits in bf16
    below their lanes' maxima (``kept_bf16``: Mosaic lowers both kernels' forms), and ``value_and_grad`` over two
    chunks compiles for v6e within the kept path's memory: the recompute step's plus the plan's extra bytes (the
    rows' sorting and ``dx``'s float32 share among them, the bf16 logits and their maxima) and a bf16 ``dx``. So
    does one chunk of 3000 tokens, a count nobody tuned for: its buffer of 3024 rows is not a whole number of the
    forward's 1504-row blocks (Mosaic takes a buffer its blocks do not tile, each block within it)."""
    from ce_pallas_tpu.target import targeting
    from ce_pallas_tpu.tooling.aot import compile_loss_and_grads

    n, h, v, bf16 = 8192, 1024, 37984, jnp.bfloat16
    with targeting("v6e"):
        plan = kept_logits.plan_chunks(n, h, v, bf16, bf16, StatsSpec(w_layout="vh"))
    assert plan.backward.label_rows and plan.chunks >= 2
    assert plan.forward.kept_bf16 and plan.backward.kept_bf16 and plan.maxima_shape is not None
    recompute = compile_loss_and_grads("v6e", n, h, v, keep_logits=False, w_layout="vh")
    kept = compile_loss_and_grads("v6e", n, h, v, keep_logits=True, w_layout="vh")
    assert recompute.temp_bytes is not None and kept.temp_bytes is not None
    extra = kept.temp_bytes - recompute.temp_bytes
    kept_logits_bytes = plan.logits_shape[0] * plan.kept_row_bytes
    assert kept_logits_bytes <= extra <= plan.extra_bytes + 2 * n * h, (extra, plan.extra_bytes)
    untuned = 3000
    with targeting("v6e"):
        one = kept_logits.plan_chunks(untuned, h, v, bf16, bf16, StatsSpec(w_layout="vh"))
    assert one.chunks == 1 and one.logits_shape[0] == 3024 and 3024 % one.forward.block_b
    assert one.forward.kept_bf16 and one.backward.label_rows
    kept = compile_loss_and_grads("v6e", untuned, h, v, keep_logits=True, w_layout="vh")
    assert kept.temp_bytes is not None  # the recompute step's temporaries grow with the tokens: 8192's bound 3000's
    assert one.logits_shape[0] * one.kept_row_bytes <= kept.temp_bytes
    assert kept.temp_bytes <= recompute.temp_bytes + one.extra_bytes + 2 * untuned * h, (kept.temp_bytes, one)


@pytest.mark.slow
@pytest.mark.rotating(shares=2)  # one layout a CI run, the other the next (conftest.rotate)
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_v6e_holds_dx_transposed_at_a_hidden_size_that_pads_its_mxu_and_compiles(layout):
    """v6e's plan for Qwen2.5-0.5B's width (``H`` 896, 3.5 of the MXU's 256; a quarter of its vocabulary) holds the
    kept backward's ``dx`` transposed (``dx_transposed``: Mosaic lowers ``w.T @ delta.T`` from a ``[V, H]`` block and
    ``w @ delta.T`` from an ``[H, V]`` one), a ``[V, H]`` head's ``dw`` too (``kept_dw_transposed``: ``x.T @ delta``
    into ``[Hp, block_v]`` slots, each finished tile transposed on its way out), and ``value_and_grad`` compiles for
    v6e within the kept path's memory: the recompute step's plus the plan's extra bytes, a bf16 ``dx`` and the
    transposed partial's float32 copy. At 3,000 tokens, a count nobody tuned for: the chunk padded to three 1024-row
    token blocks (whole lanes of ``x.T`` and ``dx.T``), the last ragged."""
    from ce_pallas_tpu.target import targeting
    from ce_pallas_tpu.tooling.aot import compile_loss_and_grads

    n, h, v, bf16 = 3000, 896, 37984, jnp.bfloat16
    with targeting("v6e"):
        plan = kept_logits.plan_chunks(n, h, v, bf16, bf16, StatsSpec(w_layout=layout))
    assert (plan.chunks, plan.backward.block_b, plan.backward.padded_n) == (1, 1024, 3072), plan
    assert all(cfg.dx_transposed and cfg.kept_dw_transposed == (layout == "vh")
               for role in ("only", "first", "middle", "last") for cfg in plan.piece_configs(role))
    recompute = compile_loss_and_grads("v6e", n, h, v, keep_logits=False, w_layout=layout)
    kept = compile_loss_and_grads("v6e", n, h, v, keep_logits=True, w_layout=layout)
    assert recompute.temp_bytes is not None and kept.temp_bytes is not None
    assert kept.temp_bytes <= recompute.temp_bytes + plan.extra_bytes + (2 + 4) * n * h, (kept.temp_bytes, plan)


@pytest.mark.covering(layout=("hv", "vh"), extras=("plain", "z_loss+smoothing", "weights"),
                      tiles=("explicit", "default", "wider_backward", "wider_forward"), fast=1)
def test_bf16_kept_logits_below_their_lane_maxima_are_as_accurate_as_float32_ones(interpret, monkeypatch, layout,
                                                                                  extras, tiles):
    """v6e keeps a narrow head's logits of bf16 inputs in bf16 below each lane's maximum over the forward's vocab
    block (:attr:`ce_pallas_tpu.forward.ForwardConfig.kept_bf16`). Logits of standard deviation 4 (where bf16 as
    they are errs 10 times more, docs/notes/2026-12-02-kept-logits-in-bf16.md), ragged in N, V (a last block whose
    later lanes hold no column before V) and H, per-token temperatures, several chunks, the label's term by rows
    (a ``[V, H]`` head): ``dx`` and ``dw`` against the float64 oracle as close as the float32 store's (equal in
    every row when written), race-checked. Explicit tiles take vocab blocks of 128 in both kernels, default ones
    2048; ``wider_backward`` halves the forward's (a backward step reads two blocks' lane maxima, as v6e's plans
    for Qwen3-0.6B and Qwen2.5-0.5B do), ``wider_forward`` the backward's (two steps read one block's). A
    soft-capped head keeps float32 logits (:func:`ce_pallas_tpu.kept_logits._kept_in_bf16`)."""
    interpret("v6e")
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 32)
    n, h, v = 45, 200, 300 if tiles == "explicit" else 2200  # default tiles: one block of 300, not whole lanes
    halved = {"wider_backward": "_fit_forward", "wider_forward": "_fit_backward"}.get(tiles)
    if halved is not None:
        fit = getattr(kept_logits, halved)
        monkeypatch.setattr(kept_logits, halved, lambda *args, **kwargs: dataclasses.replace(
            fit(*args, **kwargs), block_v=fit(*args, **kwargs).block_v // 2))
    x, labels, w = _problem(n + len(extras), n, h, v, layout, "bfloat16")
    x = (4.0 * x.astype(jnp.float32) / jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32) @ (
        w.T if layout == "vh" else w).astype(jnp.float32))))).astype(jnp.bfloat16)
    options: dict = dict(w_layout=layout)
    if tiles == "explicit":
        options["block_sizes"] = BlockSizes(16, None, 128)
    if extras == "z_loss+smoothing":
        options.update(logsumexp_weight=1e-3, label_smoothing=0.1)
    rng = np.random.default_rng(n)
    weights = None
    if extras == "weights":
        weights = rng.uniform(-1.0, 2.0, n).astype(np.float32)
        weights[::7] = 0.0
    t = rng.uniform(0.5, 2.0, n).astype(np.float32)
    options["temperature"] = jnp.asarray(t)
    kept_configs = _config_spy(monkeypatch, "forward_call", 3)
    expected = _oracle(x, labels, w, layout, options, weights, t)
    errors = {}
    for in_bf16 in (True, False):
        errors[in_bf16] = _kept_errors_with_v6e_fact(monkeypatch, "kept_logits_bf16", in_bf16, kept_configs, x, labels,
                                                     w, options, weights, expected, "bfloat16")
        assert kept_configs and all(cfg.kept_bf16 == in_bf16 for cfg in kept_configs), kept_configs
        if in_bf16 and tiles == "default":  # 2048-column blocks of two lane-maxima groups, the second past V's
            assert all((cfg.block_v, cfg.maxima_columns) == (2048, 1024) for cfg in kept_configs), kept_configs
        races = interpret_pallas_call.races
        assert races is not None and not races.races_found
    for below_maxima, as_float32 in zip(errors[True], errors[False], strict=True):
        assert below_maxima <= 1.05 * as_float32 + 1e-6, errors


@pytest.mark.parametrize("target,maxima_columns,jump", [
    ("v6e", 256, 10.0), pytest.param("v6e", 256, 100.0, marks=pytest.mark.slow),
    pytest.param("v5p", 0, 10.0, marks=pytest.mark.interpreter), pytest.param("v5p", 0, 100.0, marks=pytest.mark.slow)])
def test_the_bf16_kept_forwards_statistics_match_the_float32_kept_ones_streamed_and_redone(
        interpret, target, maxima_columns, jump):
    """The kept forward with bf16 logits below their lanes' maxima (:attr:`ce_pallas_tpu.forward.ForwardConfig.
    kept_bf16`) takes its statistics as the float32-kept one does. One column of a middle block lies ``jump`` nats
    above every earlier logit of its row (times a row scale of 0.5-2): 10 stays inside the streamed step's margin,
    100 overflows it and the step is redone exactly (a mutation of the streamed weighted sum by 1e-4 fails the
    first). Per-row scales, the label in the kernel (an ``[H, V]`` head), the expected logit, the argmax and the
    logit sum, a ragged last block; v6e two lane-maxima groups a 512-column block, v5p the vocabulary split over
    two cores. Every statistic against the float32-kept forward's and (one core) the float64 oracle's; the kept
    values plus their maxima against the float32-kept logits."""
    interpret(target)
    n, h, vocab, spike = 53, 128, 1300, 700  # blocks of 512: the spike in the second, a ragged third
    x, labels, w = random_problem(29, (n,), h, vocab, ignore_fraction=0.0)
    x, w, labels = x.copy(), w.copy(), labels.copy()
    x[:, 0] = 1.0  # a constant feature: one weight sets the spike column's logit in every row
    w[0, :] = 0.0
    w[0, spike] = jump
    labels[::3] = spike
    scale = np.random.default_rng(29).uniform(0.5, 2.0, (n, 1)).astype(np.float32)
    spec = StatsSpec(with_sum=True, with_expected=True, with_argmax=True, with_row_scale=True,
                     block_sizes=BlockSizes(32, None, 512))
    base = dataclasses.replace(ops.make_plan(n, h, vocab, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), spec).forward,
                               keep_logits=True)
    kept_shape = (base.padded_n, base.num_cores * base.nv_per_core * base.block_v)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels).reshape(-1, 1))
    in_float32 = forward_call(*args, base, jnp.asarray(scale), kept_shape)
    below = forward_call(*args, dataclasses.replace(base, kept_bf16=True, kept_maxima_columns=maxima_columns),
                         jnp.asarray(scale), kept_shape)
    assert len(below) == len(in_float32) + 1
    for ours, theirs in zip(below[:base.n_stats], in_float32[:base.n_stats], strict=True):
        if ours.dtype == jnp.int32:
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
        else:
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-6, atol=2e-5)
    kept, maxima = np.asarray(below[-2], np.float32), np.asarray(below[-1])
    group = maxima_columns or base.block_v
    columns = np.arange(vocab)
    restored = kept[:n, :vocab] + maxima[:n, (columns // group) * 128 + columns % 128]
    raw = np.asarray(in_float32[-1])[:n, :vocab]
    np.testing.assert_allclose(restored, raw, rtol=0, atol=2.0 ** -8 * np.abs(raw).max())
    if base.num_cores == 1:  # one core's partials are the rows' statistics
        logits = scale.astype(np.float64) * (x.astype(np.float64) @ w.astype(np.float64))
        assert np.all(logits[:, spike] - np.delete(logits, spike, axis=1)[:, :512].max(axis=1) > 0.5 * jump - 6)
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        oracle_rows = [lse, logits[np.arange(n), labels], logits.sum(1),
                       (np.exp(logits - lse[:, None]) * logits).sum(1), logits.max(1), logits.argmax(1)]
        for ours, theirs in zip(below[:base.n_stats], oracle_rows, strict=True):
            np.testing.assert_allclose(np.asarray(ours)[0, :, 0], theirs, rtol=2e-5, atol=2e-5)
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found
