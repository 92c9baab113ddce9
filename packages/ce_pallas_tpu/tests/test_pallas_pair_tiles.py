"""The pair kernels' tile rule (:func:`ce_pallas_tpu.pair.make_configs`): the tiles the schedule measured for the
model pairs, and tiles within each generation's VMEM for pairs too wide for them (compiled in
``test_pallas_pair_aot.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from ce_core.extend import PairSpec
from ce_pallas_tpu import pair, tiling
from ce_pallas_tpu.layout import round_up
from ce_pallas_tpu.target import CHIP_FACTS, Target

BF16 = jnp.dtype(jnp.bfloat16)
#: ``(student H, teacher H, V)``
PAIRS = {"qwen3": (1024, 4096, 151936), "gemma2": (2304, 3584, 256000), "llama3-70b": (4096, 8192, 128256)}


def _configs(generation: str, name: str) -> tuple[pair.PairConfig, pair.PairConfig]:
    hs, ht, v = PAIRS[name]
    target = Target(generation, CHIP_FACTS[generation].num_cores, None)
    return pair.make_configs(4096, hs, ht, v, (BF16, BF16, BF16, BF16), PairSpec("jsd"), target)


@pytest.mark.parametrize(("generation", "name", "stats_tiles"), [
    ("v6e", "qwen3", (2048, 1024)), ("v6e", "gemma2", (1024, 1024)),
    ("v5e", "qwen3", (512, 512)), ("v5p", "gemma2", (512, 512))])
def test_the_model_pairs_take_the_statistics_tiles_their_schedule_was_measured_at(generation, name, stats_tiles):
    stats, _ = _configs(generation, name)
    assert (stats.block_b, stats.block_v) == stats_tiles


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_both_kernels_tiles_fit_the_vmem_model(generation, name):
    hs, ht, _ = PAIRS[name]
    hsp, htp = round_up(hs, 128), round_up(ht, 128)
    target = Target(generation, CHIP_FACTS[generation].num_cores, None)
    stats, grad = _configs(generation, name)
    sizes = [2, 2, 2, 2]
    assert pair._stats_vmem_bytes(stats.block_b, stats.block_v, hsp, htp, *sizes) <= tiling.vmem_limit(target)
    assert pair._grad_vmem_bytes(grad.block_b, hsp, htp, grad.block_v, *sizes) <= tiling.vmem_limit(target) * 3 // 4


def test_a_pair_too_wide_for_the_tiles_narrows_the_vocab_block_before_the_rows():
    """Llama-3 70B teaching 8B: 121.55 MiB at v6e's 1,024 x 1,024 against its 115.2 MiB limit (libtpu's figure)."""
    stats, _ = _configs("v6e", "llama3-70b")
    assert (stats.block_b, stats.block_v) == (1024, 512)
    _, grad = _configs("v5p", "llama3-70b")
    assert (grad.block_b, grad.block_v) == (128, 256)
