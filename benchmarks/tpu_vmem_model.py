"""The pallas_tpu VMEM model against libtpu's own figure, over seeded random kernels and tiles.

For each generation, ``--count`` kernels (forward or backward) at a model head's shape, with random
tiles and options (the entropy's statistic, a soft cap, the argmax, the logit sum, float32 products),
are compiled alone at full size through libtpu's deviceless topology
(:func:`ce_pallas_tpu.tooling.vmem.kernel_vmem`); each row prints libtpu's scoped VMEM and the
model's (:func:`ce_pallas_tpu.tooling.vmem.model_vmem`), then a summary per generation and kernel. This is how the
model's coefficients were fitted (docs/notes/2026-11-26-vmem-model-fitted.md).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python benchmarks/tpu_vmem_model.py --targets v5e,v6e --count 35 --seed 1
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from typing import Any

from ce_core import StatsSpec
from ce_pallas_tpu.layout import round_up
from ce_pallas_tpu.target import CHIP_FACTS
from ce_pallas_tpu.tile_types import KernelTiles

#: (H, V) of the model heads (issue 25's matrix) and the token counts.
HEADS = ((896, 151936), (1024, 151936), (1536, 151936), (2304, 256000), (3584, 152064), (4096, 128256),
         (8192, 128256))
TOKENS = (4096, 8192)
OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("", {}), ("", {}), ("rl", {"with_expected": True}), ("cap", {"logit_soft_cap": 30.0}),
    ("argmax", {"with_argmax": True}), ("sum", {"with_sum": True}), ("f32", {"precision": "highest"}),
)


Case = tuple[str, int, int, int, KernelTiles[int | None], str, dict[str, Any]]


def cases(generation: str, count: int, rng: random.Random) -> Iterator[Case]:
    """``count`` distinct kernels for ``generation``, each within about 1.2 times its core's VMEM."""
    vmem_mib = CHIP_FACTS[generation].vmem_bytes / 2**20
    seen: set[tuple[Any, ...]] = set()
    while len(seen) < count:
        kernel = rng.choice(("forward", "backward"))
        (h, v), n = rng.choice(HEADS), rng.choice(TOKENS)
        name, options = rng.choice(OPTIONS)
        if kernel == "forward" and name == "sum":
            continue
        if kernel == "backward" and name == "argmax":
            continue
        hp = round_up(h, 128)
        if kernel == "backward":
            block_b, block_v = rng.choice((128, 256, 512, 1024)), rng.choice((512, 1024, 1536, 2048, 4096))
            w_buffers = rng.choice((1, 2))
            tiles: KernelTiles[int | None] = KernelTiles(block_b, 512 if hp % 512 == 0 else hp, block_v, w_buffers)
            rough = (2 * block_b * hp * 2 + 2 * w_buffers * hp * block_v * 2 + hp * block_v * 4 + 2 * block_b * hp * 4)
        else:
            block_b, block_v = rng.choice((256, 512, 1024, 2048, 4096)), rng.choice((512, 1024, 2048, 4096))
            if block_b * block_v > 8 * 2**20:
                continue
            tiles = KernelTiles(block_b, None, block_v)
            rough = 1.5 * block_b * hp * 2 + 2 * hp * block_v * 2 + 2 * block_b * block_v * 4
        key = (kernel, n, h, v, tiles, name)
        if rough / 2**20 > 1.2 * vmem_mib or key in seen:
            continue
        seen.add(key)
        yield kernel, n, h, v, tiles, name, options


def main(argv: list[str] | None = None) -> None:
    from ce_pallas_tpu.tooling import vmem

    parser = argparse.ArgumentParser(description="The pallas_tpu VMEM model against libtpu's own figure.")
    parser.add_argument("--targets", default="v5e,v5p,v6e,tpu7x")
    parser.add_argument("--count", type=int, default=35, help="kernels per generation")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    ratios: dict[tuple[str, str], list[float]] = {}
    print("| gen | kernel | N x H x V | tiles (w bufs) | options | libtpu MiB | model MiB | model / libtpu |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for generation in args.targets.split(","):
        for kernel, n, h, v, tiles, name, options in cases(generation, args.count, random.Random(args.seed)):
            dtype = "float32" if name == "f32" else "bfloat16"
            spec = StatsSpec(**options)
            model = vmem.model_vmem(generation, kernel, n, h, v, tiles, dtype=dtype, spec=spec)
            label = f"{tiles.block_b}/{tiles.block_h or 'all'}/{tiles.block_v}" + (
                f" (x{tiles.w_buffers})" if tiles.w_buffers else "")
            try:
                used = vmem.kernel_vmem(generation, kernel, n, h, v, tiles, dtype=dtype, spec=spec).used
            except vmem.OutOfVmem:  # an operand's window alone exceeds the core: no figure to compare
                print(f"| {generation} | {kernel} | {n}x{h}x{v} | {label} | {name or '-'} | over the core | "
                      f"{model / 2**20:.2f} | - |", flush=True)
                continue
            ratios.setdefault((generation, kernel), []).append(model / used)
            print(f"| {generation} | {kernel} | {n}x{h}x{v} | {label} | {name or '-'} | {used / 2**20:.2f} | "
                  f"{model / 2**20:.2f} | {model / used:.2f} |", flush=True)
    print("\n| gen | kernel | kernels | model / libtpu |\n|---|---|---:|---|")
    for (generation, kernel), values in sorted(ratios.items()):
        print(f"| {generation} | {kernel} | {len(values)} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
