"""Ignored tokens cost nothing on pallas_tpu (contract version 4): token blocks with no live row are skipped.

Both kernels walk the live token blocks only (``ce_pallas_tpu.common.LiveBlocks``, by scalar prefetch);
a dead block's steps keep the last live block's indices, so nothing is fetched, and run no matmul.
Checked here, in the race-checked interpreter: values and gradients against the float64 oracle for every
ignored pattern (none, all, prompts, padding, random, one live token), on one core and two, both gradient
paths (recompute and kept logits) and both head layouts; that the matmuls run in proportion to the live
blocks (a host-callback counter in the products); and data shards with different live counts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call

import ce_core
from ce_core import BlockSizes, linear_cross_entropy, linear_log_probs
from ce_core.extend import Case, compare_with_oracle, log_probs_oracle, max_rel_error, oracle, random_problem
from ce_core.extend import ignored_labels as ignored_labels_of
from ce_pallas_tpu import common, kept_logits
from ce_pallas_tpu.common import LiveBlocks

BATCH, SEQ, HIDDEN, VOCAB = 2, 61, 200, 300  # ragged everywhere: N=122 in blocks of 16, H past 128, V past 256
SIZES = BlockSizes(16, None, 128)


@pytest.fixture(autouse=True)
def _fresh_traces():
    """The chunk size and the target are read when a call is traced: no trace of another test's reused."""
    jax.clear_caches()


def ignored_labels(pattern: str, seed: int = 0, shape: tuple[int, ...] = (BATCH, SEQ)) -> np.ndarray:
    """Labels of ``shape`` with the tokens ``pattern`` names ignored (:func:`ce_core.extend.ignored_labels`)."""
    return ignored_labels_of(pattern, shape, VOCAB, seed=seed)


def test_live_blocks_walk_the_live_ones_in_order_then_stay_on_the_last():
    live = np.zeros(70, bool)
    live[[20, 21, 69]] = True  # blocks of 16: 1 and 4 (the ragged last) live
    blocks = LiveBlocks.of(jnp.asarray(live), 16)
    assert blocks.walk.tolist() == [1, 4, ~4, ~4, ~4] and blocks.n_live.tolist() == [2]  # then ~(the last live)
    none = LiveBlocks.of(jnp.zeros(70, bool), 16)
    assert none.n_live.tolist() == [0] and none.walk.tolist() == [~0] * 5


def _loss_grads(x, labels, w, *, layout: str, keep_logits: bool, options: dict):
    def loss(x_, w_):
        return linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu", keep_logits=keep_logits,
                                    w_layout=layout, block_sizes=SIZES, **options)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def _check_loss(pattern: str, layout: str, keep_logits: bool, dtype: str, options: dict, seed: int = 0) -> None:
    x, _, w = random_problem(seed, (BATCH * SEQ,), HIDDEN, VOCAB)
    labels = ignored_labels(pattern, seed).reshape(-1)
    w_in = np.ascontiguousarray(w.T) if layout == "vh" else w
    value, (dx, dw) = _loss_grads(jnp.asarray(x, dtype), labels, jnp.asarray(w_in, dtype), layout=layout,
                                  keep_logits=keep_logits, options=options)
    rounded = {name: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for name, a in (("x", x), ("w", w))}
    expected = oracle(rounded["x"], labels, rounded["w"], **options)
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    if layout == "vh":
        dw = dw.T
    for name, actual in (("loss", value), ("dx", dx), ("dw", dw)):
        assert np.all(np.isfinite(np.asarray(actual, np.float32))), name
        assert max_rel_error(actual, expected[name]) <= tolerance, name
    dead = labels == -100
    assert not np.any(np.asarray(dx, np.float32)[dead]), "a dead row's dx must be 0"
    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found


CASES = {"plain": {}, "sum+cap": {"reduction": "sum", "logit_soft_cap": 3.0},
         "z_loss+smoothing": {"logsumexp_weight": 1e-3, "label_smoothing": 0.1}}


@pytest.mark.parametrize("pattern,target,path", [("prompts", "v5e", "kept"), ("one", "v5p", "recompute")])
def test_ignored_patterns_match_float64(interpret, monkeypatch, pattern, target, path):
    """The fast tier's two: prompts on one core through the kept logits, one live token on two cores recomputing
    (the interpreter tier counts the products and runs every pattern)."""
    interpret(target)
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 48)  # three chunks, the last overlapping
    _check_loss(pattern, "hv", path == "kept", "float32", {})


#: One row per pattern, the other factors spread over them (the fast tier adds prompts and one live token).
PATTERN_ROWS = [
    ("none", "v5p", "recompute", "vh", "bfloat16", "sum+cap"),
    ("all", "v5e", "kept", "hv", "float32", "plain"),
    ("prompts", "v5p", "recompute", "hv", "float32", "z_loss+smoothing"),
    ("padding", "v5e", "kept", "vh", "bfloat16", "z_loss+smoothing"),
    ("random", "v5p", "kept", "hv", "bfloat16", "sum+cap"),
    ("one", "v5e", "recompute", "vh", "float32", "plain"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("pattern,target,path,layout,dtype,case", PATTERN_ROWS)
def test_every_ignored_pattern_matches_float64(interpret, monkeypatch, pattern, target, path, layout, dtype, case):
    interpret(target)
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 48)
    _check_loss(pattern, layout, path == "kept", dtype, CASES[case], seed=len(case))


@pytest.mark.interpreter
@pytest.mark.parametrize("pattern,target,per_token_temperature", [("prompts", "v5p", True), ("one", "v5e", False)])
def test_log_probs_and_entropy_with_ignored_tokens_match_float64(interpret, pattern, target, per_token_temperature):
    """Per-token outputs (the recompute path, with the expected logit) skip dead blocks too."""
    interpret(target)
    x, _, w = random_problem(4, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels(pattern, seed=1)
    rng = np.random.default_rng(5)
    temperature = rng.uniform(0.5, 1.5, (BATCH, 1)).astype(np.float32) if per_token_temperature else 1.0
    g_logp, g_ent = (rng.standard_normal(labels.shape).astype(np.float32) for _ in range(2))

    def objective(x_, w_):
        logp, entropy = linear_log_probs(x_, labels, w_, return_entropy=True, implementation="pallas_tpu",
                                         block_sizes=SIZES, temperature=temperature, logit_soft_cap=5.0)
        return jnp.sum(g_logp * logp + g_ent * entropy), (logp, entropy)

    (_, (logp, entropy)), (dx, dw) = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(x, w)
    expected = log_probs_oracle(x, labels, w, temperature=temperature, logit_soft_cap=5.0, logp_cotangent=g_logp,
                                entropy_cotangent=g_ent)
    for name, actual in (("logp", logp), ("entropy", entropy), ("dx", dx), ("dw", dw)):
        assert max_rel_error(actual, expected[name]) <= 1e-4, name


def _counting(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Count every product ``common.<name>`` forms inside the interpreted kernels (a host callback each)."""
    counters: dict[str, list[int]] = {name: [] for name in names}
    for name in names:
        original = getattr(common, name)

        def counted(*args, _original=original, _counter=counters[name], **kwargs):
            jax.debug.callback(lambda: _counter.append(1))
            return _original(*args, **kwargs)

        monkeypatch.setattr(common, name, counted)
    return counters


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["recompute", "kept"])
def test_dead_blocks_run_no_matmul(interpret, monkeypatch, path):
    """Every product of both kernels runs once per live token block: none for a dead one (a counter in
    the interpreted products, against the count with no token ignored)."""
    interpret("v5p" if path == "recompute" else "v5e")  # v5p: the vocab over two cores, the last a block short
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 32)  # two chunks of two 16-row blocks
    n = 64  # four token blocks of 16
    x, labels, w = random_problem(6, (n,), HIDDEN, VOCAB)
    patterns = {"none": labels, "all": np.full(n, -100, np.int32),
                "blocks 1 and 3": np.where((np.arange(n) // 16) % 2 == 1, labels, -100)}
    patterns["blocks 1 and 3"][[16, 17, 50]] = -100  # dead tokens inside live blocks are computed, inert
    products = ("matmul", "matmul_nt", "matmul_tn")  # [H, V]: the logits (both kernels), dx, dw
    counters = _counting(monkeypatch, products)
    counts = {}
    for pattern, pattern_labels in patterns.items():
        for counter in counters.values():
            counter.clear()
        jax.clear_caches()
        jax.block_until_ready(_loss_grads(jnp.asarray(x), pattern_labels, jnp.asarray(w), layout="hv",
                                          keep_logits=path == "kept", options={}))
        counts[pattern] = {name: len(counter) for name, counter in counters.items()}
    for name in products:
        assert counts["none"][name] > 0 and counts["all"][name] == 0, name
        # Half the blocks live, in both chunks of the kept path: half the products.
        assert 2 * counts["blocks 1 and 3"][name] == counts["none"][name], name


@pytest.mark.interpreter
@pytest.mark.parametrize("mesh_shape,pattern", [((2, 2), "uneven"), ((2, 1), "one_per_shard")])
def test_shards_with_different_live_counts_match_float64(monkeypatch, mesh_shape, pattern):
    """Data shards skip their own dead blocks (different counts, or one live token each); vocab shards agree."""
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5e")
    mesh = jax.make_mesh(mesh_shape, ("data", "vocab"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x, _, w = random_problem(8, (4, 32), HIDDEN, VOCAB)
    labels = ignored_labels("random", seed=5, shape=(4, 32))
    if pattern == "uneven":
        labels[:2, 1:] = -100  # the first data shard: two live tokens; the second: about half
    else:
        labels[:2, :], labels[2:, :] = -100, -100
        labels[0, 5], labels[3, 30] = 7, 201  # one live token on each data shard
    loss_fn = functools.partial(ce_core.sharded_linear_cross_entropy, mesh=mesh, vocab_axis="vocab")
    for case in (Case(), Case(reduction="none", logit_soft_cap=4.0)):
        compare_with_oracle("pallas_tpu", case, x, labels, w, loss_fn=loss_fn, block_sizes=SIZES)
