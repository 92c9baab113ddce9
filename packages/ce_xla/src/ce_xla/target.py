"""Per-platform chunk budgets of the ``xla`` backend, the figures behind them, and the target platform.

A chunked pass pays for its memory bound in HBM traffic: every chunk of the outer loop streams the
operand it does not hold. Arithmetic intensity (flops per HBM byte) must stay above the chip's
ridge point (peak bf16 flop/s over HBM bytes/s) for the matmuls to run at full speed:

============  ==============  ===========  ==============
chip          bf16 dense      HBM          ridge point
============  ==============  ===========  ==============
TPU v5e       197 TFLOP/s     0.82 TB/s    240 flop/B
TPU v5p       459 TFLOP/s     2.76 TB/s    166 flop/B
TPU v6e       918 TFLOP/s     1.64 TB/s    560 flop/B
A100 SXM      312 TFLOP/s     2.04 TB/s    153 flop/B
H100 SXM      989 TFLOP/s     3.35 TB/s    295 flop/B
H200          989 TFLOP/s     4.8 TB/s     206 flop/B
============  ==============  ===========  ==============

(vendor datasheet figures). With bf16 operands and float32 accumulators the passes give:

- statistics, tokens outer: each token chunk of ``B`` rows streams all of ``w`` (``2HV`` bytes for
  ``2BHV`` flops): ``B`` flop/B. So ``B >= 1024`` rows on accelerators (above every ridge point,
  v6e's 560 included); a full-row chunk of 64 MiB holds only 128 rows at V = 128k, so on
  accelerators the statistics pass takes ``[1024, 16384]`` tiles with an online logsumexp.
- gradients, vocab outer: each vocab chunk of ``C`` columns streams ``x`` and read-modify-writes
  the float32 ``dx`` (``10NH`` bytes for ``6NHC`` flops): ``0.6 C`` flop/B, so ``C >= 1024``
  (614 flop/B); and each ``[R, C]`` tile streams its ``w`` slice (``2HC`` bytes, ``6RHC`` flops):
  ``3 R`` flop/B, so ``R >= 256``. A 32 MiB float32 ``dw`` slice gives ``C = 2048`` at H = 4096
  and 1024 at H = 8192; an 8 MiB float32 tile then gives ``R = 1024`` and 2048 rows.
- every tile's float32 logits go to HBM and back (``~14RC`` bytes for ``6RHC`` flops):
  ``0.43 H`` flop/B, independent of the chunk sizes; below H ~ 1300 (v6e) that is the bound,
  and only a kernel that keeps the tile on chip (``pallas_tpu``) avoids it.

Measured ahead of time at N=8192 H=4096 V=128256 bf16, these tiles add 0.4 MiB (v5e, v6e) and
37 MiB (v5p) to the ``4NH`` float32 ``dx`` (128 MiB); the statistics tiles are dead by then.

On GPU the same tiles ran at 2.34x the three-matmul floor (fwd+bwd, H200, N=8192 H=4096 V=128256
bf16). A loop step on a GPU is several kernel launches (the tile's products, its elementwise work)
and a loop-control round; the 63 x 8 gradient tiles of ``[1024, 2048]`` pay that 504 times, the likely
cause. Four times the budgets (256 MiB statistics tiles, 128 MiB ``dw`` slices, 64 MiB gradient and
recompute tiles: ``[2048, 8192]`` gradient tiles there, 64 of them) measured, interleaved in one run
(``benchmarks/gpu_xla_tiles.py``):

==================================  ==============  ==============  ==========  ==================
shape (bf16), objective             ACCELERATOR     x2 budgets      x4          x8 budgets
==================================  ==============  ==============  ==========  ==================
8192x4096x128256 (Llama-3 8B), mean  2.34x, 204 MiB  1.82x, 256 MiB  1.80x, 368  1.61x, 928 MiB
8192x2560x262144 (Gemma 3), mean     2.57x, 142 MiB  2.00x, 230 MiB  1.94x, 373  2.13x, 859 MiB
4096x1536x151936 (Qwen2.5-1.5B), rl  3.47x, 108 MiB  2.42x, 202 MiB  2.31x, 313  2.39x, 796 MiB
==================================  ==============  ==============  ==========  ==================

(times over the floor, fwd+bwd temporaries). x8 wins only at Llama-3 and costs 2.5x the memory; the
fused tokens-outer path with 1 GiB row chunks reached 1.44x and 1.72x on the first two, but holds a
float32 ``[H, V]`` ``dw`` (2.9-3.2 GiB), which is what vocab outer exists to avoid where memory is
short: the keep-logits budget (:func:`keep_logits_budget`, ``min(4 GiB, HBM / 8)``: 4 GiB on an
H200) now lets bf16 heads up to that size take tokens outer (:mod:`ce_xla.tiling`).

The x4 statistics tiles (``[1024, 65536]``) still sliced ``w``'s columns, and XLA copies such a slice
on a GPU, once per tile: the forward alone took 1.46x one bare matmul at Llama-3 8B, 1.40x at Gemma 3
and 1.90x for the RL objective, where whole-row tiles from 512 rows (a 512 MiB budget) took 1.02x,
1.02x and 1.26x (the reference's forward: 1.06x, 1.10x, 1.30x). Fwd+bwd, in one run: 1.76x -> 1.61x,
1.98x -> 1.85x, 2.40x -> 2.12x, temporaries unchanged at the first two (the gradient pass is the
peak) and 313 -> 478 MiB for the RL objective. A 1 GiB budget gained 0.01-0.04 more for up to 793
MiB. ``GPU`` is that: x4 with 512 MiB statistics tiles of whole rows from 512 of them.

On CPU (2-core x86, AVX-512) caches, not bandwidth, set the sizes. The statistics pass keeps the
full-row rule (64 MiB: 512 rows at V = 32k), and the gradient tiles are smaller: 8 MiB ``dw``
slices and 2 MiB tiles (at least 256 rows). At N=4096 H=512 V=32768 bf16, timed interleaved on a
shared machine (load 5-12), vocab-outer tiles of 128x4096, 256x2048, 512x4096, 1024x1024 and
1024x4096 (rows x columns) all ran within noise of each other, 0.81-0.88x the reference's time;
64x8192 ran at 0.995x, hence the row floor.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

MiB = 2**20
GiB = 2**30
#: The most extra memory the tokens-outer (keep-logits, 6NHV) path may hold beyond vocab outer's, whatever
#: the device (:func:`keep_logits_budget`).
KEEP_LOGITS_BUDGET_CAP_BYTES = 4 * GiB
#: ...and at most this fraction of the device's memory (an eighth).
KEEP_LOGITS_MEMORY_DIVISOR = 8


@dataclasses.dataclass(frozen=True)
class PlatformBudgets:
    """Byte budgets (float32 buffers) and row counts that set the default chunk plan on a platform.

    ``logits_bytes``: one statistics tile ``[token_chunk, vocab_chunk]``; tokens-outer full-row
    chunks also hold it through the fused gradient pass.
    ``grad_slice_bytes``: tokens outer, one ``dw`` update ``[H, grad_chunk]``.
    ``stats_rows``: vocab outer, the fewest rows a statistics tile should have (fewer than that
    fit a full row: the vocabulary is tiled).
    ``dw_slice_bytes``: vocab outer, the ``dw`` slice ``[H, grad_chunk]`` held across the token loop.
    ``grad_tile_bytes``: vocab outer, one gradient tile ``[grad_token_chunk, grad_chunk]``.
    ``recompute_tile_bytes``: tokens outer, one tile ``[grad_token_chunk, grad_chunk]`` of the
    recompute gradient pass (the fused pass's tiles have the statistics rows instead).
    ``memory_bytes``: the device memory assumed when the device being compiled for reports none
    (an ahead-of-time compile for another platform; a CPU host whose memory cannot be read); it sets
    the keep-logits budget (:func:`keep_logits_budget`).
    """

    logits_bytes: int = 64 * MiB
    grad_slice_bytes: int = 64 * MiB
    stats_rows: int = 1024
    dw_slice_bytes: int = 32 * MiB
    grad_tile_bytes: int = 8 * MiB
    recompute_tile_bytes: int = 8 * MiB
    memory_bytes: int = 16 * GiB


#: The budgets of each platform; platforms not listed take ``ACCELERATOR``. Assumed memory: 16 GiB of HBM on
#: accelerators (TPU v5e's, the smallest of the current TPUs; a GPU reports its own), 32 GiB of host memory.
CPU = PlatformBudgets(grad_slice_bytes=8 * MiB, stats_rows=32, dw_slice_bytes=8 * MiB, grad_tile_bytes=2 * MiB,
                      memory_bytes=32 * GiB)
ACCELERATOR = PlatformBudgets()
#: Four times the tiles on GPU: every tile of a ``fori_loop`` there is a few kernel launches and a loop
#: step, so ``ACCELERATOR``'s 504 gradient tiles at Llama-3 8B cost more than their arithmetic.
#: Its statistics tiles hold whole rows from 512 of them: a vocab-chunked tile slices ``w``'s columns, which
#: XLA copies on a GPU, once per tile (the forward at Llama-3 8B: 21.0 ms in ``[1024, 65536]`` tiles,
#: 14.7 ms in ``[1024, 128256]`` ones, one bare matmul 14.4 ms).
GPU = PlatformBudgets(logits_bytes=512 * MiB, stats_rows=512, dw_slice_bytes=128 * MiB, grad_tile_bytes=64 * MiB,
                      recompute_tile_bytes=64 * MiB)
BUDGETS = {"cpu": CPU, "gpu": GPU, "tpu": ACCELERATOR}


def budgets_for(platform: str) -> PlatformBudgets:
    """The budgets of ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``; others as accelerators)."""
    return BUDGETS.get(platform, ACCELERATOR)


def keep_logits_budget(platform: str, memory_bytes: int | None = None) -> int:
    """The keep-logits budget on ``platform``: ``min(4 GiB, memory / 8)``.

    ``memory_bytes`` is the device's memory (``None``: the platform's assumed ``memory_bytes``, so
    this is a pure function of its arguments); :func:`device_keep_logits_budget` passes the real one.
    """
    if memory_bytes is None:
        memory_bytes = budgets_for(platform).memory_bytes
    return min(KEEP_LOGITS_BUDGET_CAP_BYTES, memory_bytes // KEEP_LOGITS_MEMORY_DIVISOR)


def device_keep_logits_budget(platform: str) -> int:
    """:func:`keep_logits_budget` with the memory of the device compiled for, when this process has one.

    On TPU and GPU: ``jax.devices()[0].memory_stats()["bytes_limit"]`` (its HBM) when the default
    backend is ``platform`` and reports it; on CPU: the host's physical memory. Otherwise (an
    ahead-of-time compile for another platform, a device that reports nothing) the platform's
    assumed ``memory_bytes``.
    """
    return keep_logits_budget(platform, device_memory_bytes(platform))


@functools.cache
def device_memory_bytes(platform: str) -> int | None:
    """Memory of this process's first ``platform`` device (host memory on CPU), or ``None`` when unknown."""
    if platform != jax.default_backend():
        return None
    if platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            return None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # a runtime without memory statistics
        return None
    limit = None if stats is None else stats.get("bytes_limit")
    return int(limit) if limit else None


def target_platform() -> str:
    """The platform the code being traced is compiled for.

    The context mesh's device when there is one (ahead-of-time compiles for TPU topologies on a
    CPU host set it, as does ``jax.set_mesh``), else JAX's default backend.
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = getattr(device, "platform", None)
    return platform if platform else jax.default_backend()
