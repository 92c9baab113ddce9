"""The ``xla`` backend's chunk budgets on a GPU: fwd+bwd time and temporaries per budget, interleaved.

Each variant replaces the running platform's entry of :data:`ce_xla.target.BUDGETS` (and, optionally,
the gradient order) while its programs are traced; every variant of one shape is then timed in the same rounds
as the three-matmul floor, so the ratios of one shape's rows compare. This is how the GPU budgets
in :mod:`ce_xla.target` were chosen (docs/notes/2026-11-26-gpu-h200.md, "Choosing the GPU tiles").

    python benchmarks/gpu_xla_tiles.py [--quick] [--repeats R] [--forward] > table.md

``--forward`` times the forward alone (the loss value, no gradient) under statistics budgets only
(:data:`FORWARD_VARIANTS`), beside the materialised reference's forward and one bare matmul: whether a
larger statistics tile closes the gap between ``xla``'s forward and the reference's on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import ce_core
from ce_bench.floor import floor_fwd, floor_fwd_bwd
from ce_bench.timing import interleaved
from ce_xla import XlaBackend, target
from ce_xla.tiling import GradientOrder

MiB = 2**20

#: name -> (budgets, forced gradient order or None)
VARIANTS: dict[str, tuple[target.PlatformBudgets, GradientOrder | None]] = {
    "TPU's (64/32/8 MiB)": (target.ACCELERATOR, "vocab_outer"),
    "x2 (128/64/32)": (
        target.PlatformBudgets(
            logits_bytes=128 * MiB, dw_slice_bytes=64 * MiB, grad_tile_bytes=32 * MiB, recompute_tile_bytes=32 * MiB
        ),
        "vocab_outer",
    ),
    "x4 (256/128/64)": (
        target.PlatformBudgets(
            logits_bytes=256 * MiB, dw_slice_bytes=128 * MiB, grad_tile_bytes=64 * MiB, recompute_tile_bytes=64 * MiB
        ),
        "vocab_outer",
    ),
    "GPU's (x4, 512 MiB statistics from 512 rows)": (target.GPU, "vocab_outer"),
    "GPU's + 1 GiB statistics": (dataclasses.replace(target.GPU, logits_bytes=1024 * MiB, stats_rows=1024), None),
    "x8 (512/256/256)": (
        target.PlatformBudgets(
            logits_bytes=512 * MiB, dw_slice_bytes=256 * MiB, grad_tile_bytes=256 * MiB, recompute_tile_bytes=256 * MiB
        ),
        "vocab_outer",
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

#: name -> the statistics budgets (float32 logits of one tile, fewest rows of a full-row tile) that replace the
#: running platform's; its other budgets are kept.
FORWARD_VARIANTS: dict[str, dict[str, int]] = {
    "256 MiB, full rows from 1024 (x4)": {"logits_bytes": 256 * MiB, "stats_rows": 1024},
    "256 MiB, full rows from 256": {"logits_bytes": 256 * MiB, "stats_rows": 256},
    "GPU's (512 MiB, full rows from 512)": {},
    "1 GiB": {"logits_bytes": 1024 * MiB, "stats_rows": 1024},
    "2 GiB": {"logits_bytes": 2048 * MiB, "stats_rows": 1024},
}

SHAPES = {"llama3-8b": (8192, 4096, 128256), "gemma3": (8192, 2560, 262144), "rl-qwen2.5-1.5b": (4096, 1536, 151936)}
QUICK_SHAPES = {"tiny": (256, 128, 4096), "narrow": (256, 512, 65536)}


def forward_program(objective: str, implementation: str):
    """The forward alone: the mean loss, or the RL objective's log-probs and entropy, as a scalar."""

    def mean_loss(x, labels, w):
        return ce_core.linear_cross_entropy(x, labels, w, implementation=implementation)

    def rl(x, labels, w):
        logp, entropy = ce_core.linear_log_probs(x, labels, w, return_entropy=True, implementation=implementation)
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    return mean_loss if objective == "mean" else rl


def loss_program(objective: str):
    """``value_and_grad`` of the objective w.r.t. ``x`` and ``w``, jitted (``mean`` loss or ``rl``)."""
    return jax.jit(jax.value_and_grad(forward_program(objective, "xla"), argnums=(0, 2)))


def compile_variants(
    objective: str, x: jax.Array, labels: jax.Array, w: jax.Array, platform: str, only: str | None = None
) -> dict[str, tuple[Any, str, float]]:
    """Per variant: the compiled fwd+bwd program, its chunk plan in words and its temporaries (MiB)."""
    n, h = x.shape
    v = w.shape[1]
    variants: dict[str, tuple[Any, str, float]] = {}
    backend = ce_core.get_backend("xla")
    assert isinstance(backend, XlaBackend)
    original, saved_order = target.BUDGETS[platform], backend.gradient_order
    for name, (budgets, order) in VARIANTS.items():
        if not selected(name, only):
            continue
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


def _problem(label: str, n: int, h: int, v: int) -> tuple[str, jax.Array, jax.Array, jax.Array]:
    """``(objective, x, labels, w)`` of one shape: bf16, logits of order 1; ``rl*`` labels the RL objective."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (h, v), jnp.float32) / h**0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    return ("rl" if label.startswith("rl") else "mean"), x, labels, w


def _row(shape: str, objective: str, name: str, described: str, timing: Any, base_ms: float | None,
         temp_mib: float, digits: int) -> str:
    """One table row: the median time, its ratio to ``base_ms`` and the temporaries (or the error)."""
    ms = timing.median_ms
    if ms is None:
        return f"| {shape} | {objective} | {name} | {described} | {timing.error} | | |"
    ratio = f"{ms / base_ms:.2f}x" if base_ms else "-"
    return f"| {shape} | {objective} | {name} | {described} | {ms:.{digits}f} | {ratio} | {temp_mib:.0f} |"


def measure_shape(label: str, n: int, h: int, v: int, repeats: int, platform: str,
                  only: str | None = None) -> list[str]:
    """The table rows of one shape: every variant and the floor, timed in the same rounds."""
    objective, x, labels, w = _problem(label, n, h, v)
    variants = compile_variants(objective, x, labels, w, platform, only)
    contenders: dict[str, Callable[[], Any]] = {
        name: functools.partial(compiled, x, labels, w) for name, (compiled, _, _) in variants.items()
    }
    contenders["matmul floor"] = functools.partial(jax.jit(floor_fwd_bwd).lower(x, w).compile(), x, w)
    timings = interleaved(contenders, repeats=repeats)
    floor_ms = timings["matmul floor"].median_ms
    rows = []
    for name, (_, described, temp_mib) in variants.items():
        rows.append(_row(f"{label} {n}x{h}x{v}", objective, name, described, timings[name], floor_ms, temp_mib, 1))
    rows.append(f"| {label} | | matmul floor | | {floor_ms:.1f} | 1.00x | |")
    return rows


def selected(name: str, only: str | None) -> bool:
    """Whether variant ``name`` is to be run: ``only`` is None (all) or comma-separated parts of names."""
    return only is None or any(part in name for part in only.split(","))


def measure_forward(label: str, n: int, h: int, v: int, repeats: int, platform: str,
                    only: str | None = None) -> list[str]:
    """The table rows of one shape's forward: every statistics budget, the reference and one matmul."""
    objective, x, labels, w = _problem(label, n, h, v)
    backend = ce_core.get_backend("xla")
    assert isinstance(backend, XlaBackend)
    original = target.BUDGETS[platform]
    programs: dict[str, tuple[Any, str]] = {}
    for name, budgets in FORWARD_VARIANTS.items():
        if not selected(name, only):
            continue
        target.BUDGETS[platform] = dataclasses.replace(original, **budgets)
        try:
            plan = backend.plan(n, h, v, ce_core.StatsSpec(), x.dtype, w.dtype)
            programs[name] = (jax.jit(forward_program(objective, "xla")).lower(x, labels, w).compile(),
                              f"{plan.token_chunk}x{plan.vocab_chunk}")
        finally:
            target.BUDGETS[platform] = original
    programs["reference"] = (jax.jit(forward_program(objective, "reference")).lower(x, labels, w).compile(), "all")
    programs["one matmul"] = (jax.jit(lambda x, labels, w: floor_fwd(x, w)).lower(x, labels, w).compile(), "")
    timings = interleaved({name: functools.partial(compiled, x, labels, w) for name, (compiled, _) in
                           programs.items()}, repeats=repeats)
    floor_ms = timings["one matmul"].median_ms
    rows = []
    for name, (compiled, described) in programs.items():
        memory = compiled.memory_analysis()
        temp_mib = memory.temp_size_in_bytes / MiB if memory is not None else float("nan")
        rows.append(_row(f"{label} {n}x{h}x{v}", objective, name, described, timings[name], floor_ms, temp_mib, 2))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, to try the script on a CPU")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--forward", action="store_true", help="the forward alone, under statistics budgets")
    parser.add_argument("--only", help="comma-separated parts of variant names: run those variants alone")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.forward:
        device = jax.devices()[0].device_kind
        print(f"{device}, jax {jax.__version__}, {args.repeats} interleaved rounds, forward only\n")
        print("| shape | objective | variant | statistics tile | fwd ms | vs one matmul | temp MiB |")
        print("|---|---|---|---|---:|---:|---:|")
        for label, (n, h, v) in shapes.items():
            rows = measure_forward(label, n, h, v, args.repeats, jax.default_backend(), args.only)
            print("\n".join(rows), flush=True)
        return 0
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.repeats} interleaved rounds; budgets: "
        "statistics logits / dw slice / gradient tile\n"
    )
    print("| shape | objective | variant | plan (stats tile; grad tile; order) | fwd+bwd ms | vs floor | temp MiB |")
    print("|---|---|---|---|---:|---:|---:|")
    for label, (n, h, v) in shapes.items():
        print("\n".join(measure_shape(label, n, h, v, args.repeats, jax.default_backend(), args.only)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
