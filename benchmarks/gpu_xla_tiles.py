"""The ``xla`` backend's chunk budgets on a GPU: fwd+bwd time and temporaries per budget, interleaved.

Each variant replaces the running platform's entry of :data:`ce_xla.target.BUDGETS` (and, optionally,
the gradient order) while its programs are traced; every variant of one shape is then timed in the same rounds
as the three-matmul floor, so the ratios of one shape's rows compare. This is how the GPU budgets
in :mod:`ce_xla.target` were chosen (docs/benchmarks.md, "GPU").

    python benchmarks/gpu_xla_tiles.py [--quick] [--repeats R] > table.md
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import ce_core
from ce_bench.floor import floor_fwd_bwd
from ce_bench.timing import interleaved
from ce_xla import XlaBackend, target
from ce_xla.tiling import GradientOrder

MiB = 2**20

#: name -> (budgets, forced gradient order or None)
VARIANTS: dict[str, tuple[target.PlatformBudgets, GradientOrder | None]] = {
    "TPU's (64/32/8 MiB)": (target.ACCELERATOR, None),
    "x2 (128/64/32)": (
        target.PlatformBudgets(
            logits_bytes=128 * MiB, dw_slice_bytes=64 * MiB, grad_tile_bytes=32 * MiB, recompute_tile_bytes=32 * MiB
        ),
        None,
    ),
    "GPU's (256/128/64)": (target.GPU, None),
    "x8 (512/256/256)": (
        target.PlatformBudgets(
            logits_bytes=512 * MiB, dw_slice_bytes=256 * MiB, grad_tile_bytes=256 * MiB, recompute_tile_bytes=256 * MiB
        ),
        None,
    ),
    "tokens outer, 512 MiB rows": (
        target.PlatformBudgets(logits_bytes=512 * MiB, grad_slice_bytes=256 * MiB, recompute_tile_bytes=256 * MiB),
        "tokens_outer",
    ),
    "tokens outer, 1 GiB rows": (
        target.PlatformBudgets(logits_bytes=1024 * MiB, grad_slice_bytes=256 * MiB, recompute_tile_bytes=256 * MiB),
        "tokens_outer",
    ),
}

SHAPES = {"llama3-8b": (8192, 4096, 128256), "gemma3": (8192, 2560, 262144), "rl-qwen2.5-1.5b": (4096, 1536, 151936)}
QUICK_SHAPES = {"tiny": (256, 128, 4096), "narrow": (256, 512, 65536)}


def loss_program(objective: str):
    """``value_and_grad`` of the objective w.r.t. ``x`` and ``w``, jitted (``mean`` loss or ``rl``)."""

    def mean_loss(x, labels, w):
        return ce_core.linear_cross_entropy(x, labels, w, implementation="xla")

    def rl(x, labels, w):
        logp, entropy = ce_core.linear_log_probs(x, labels, w, return_entropy=True, implementation="xla")
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    return jax.jit(jax.value_and_grad(mean_loss if objective == "mean" else rl, argnums=(0, 2)))


def compile_variants(
    objective: str, x: jax.Array, labels: jax.Array, w: jax.Array, platform: str
) -> dict[str, tuple[Any, str, float]]:
    """Per variant: the compiled fwd+bwd program, its chunk plan in words and its temporaries (MiB)."""
    n, h = x.shape
    v = w.shape[1]
    variants: dict[str, tuple[Any, str, float]] = {}
    backend = ce_core.get_backend("xla")
    assert isinstance(backend, XlaBackend)
    original, saved_order = target.BUDGETS[platform], backend.gradient_order
    for name, (budgets, order) in VARIANTS.items():
        target.BUDGETS[platform], backend.gradient_order = budgets, order
        try:
            plan = backend.plan(n, h, v, ce_core.StatsSpec(), x.dtype, w.dtype)
            compiled = loss_program(objective).lower(x, labels, w).compile()
        finally:
            target.BUDGETS[platform], backend.gradient_order = original, saved_order
        memory = compiled.memory_analysis()
        temp_mib = memory.temp_size_in_bytes / MiB if memory is not None else float("nan")
        described = (
            f"{plan.token_chunk}x{plan.vocab_chunk}; {plan.grad_token_chunk}x{plan.grad_chunk}; {plan.gradient_order}"
        )
        variants[name] = (compiled, described, temp_mib)
    return variants


def measure_shape(label: str, n: int, h: int, v: int, repeats: int, platform: str) -> list[str]:
    """The table rows of one shape: every variant and the floor, timed in the same rounds."""
    objective = "rl" if label.startswith("rl") else "mean"
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (h, v), jnp.float32) / h**0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    variants = compile_variants(objective, x, labels, w, platform)
    contenders: dict[str, Callable[[], Any]] = {
        name: functools.partial(compiled, x, labels, w) for name, (compiled, _, _) in variants.items()
    }
    contenders["matmul floor"] = functools.partial(jax.jit(floor_fwd_bwd).lower(x, w).compile(), x, w)
    timings = interleaved(contenders, repeats=repeats)
    floor_ms = timings["matmul floor"].median_ms
    rows = []
    for name, (_, described, temp_mib) in variants.items():
        ms = timings[name].median_ms
        if ms is None:
            rows.append(f"| {label} | {objective} | {name} | {described} | {timings[name].error} | | |")
            continue
        ratio = f"{ms / floor_ms:.2f}x" if floor_ms else "-"
        rows.append(
            f"| {label} {n}x{h}x{v} | {objective} | {name} | {described} | {ms:.1f} | {ratio} | {temp_mib:.0f} |"
        )
    rows.append(f"| {label} | | matmul floor | | {floor_ms:.1f} | 1.00x | |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, to try the script on a CPU")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.repeats} interleaved rounds; budgets: "
        "statistics logits / dw slice / gradient tile\n"
    )
    print("| shape | objective | variant | plan (stats tile; grad tile; order) | fwd+bwd ms | vs floor | temp MiB |")
    print("|---|---|---|---|---:|---:|---:|")
    for label, (n, h, v) in (QUICK_SHAPES if args.quick else SHAPES).items():
        print("\n".join(measure_shape(label, n, h, v, args.repeats, jax.default_backend())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
