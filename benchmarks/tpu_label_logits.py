"""What the label logit costs outside the forward kernel with a ``[V, H]`` head, from libtpu's static
schedule (no TPU needed).

With a tied head (``w_layout="vh"``) the streamed forward kernel takes no labels; the wrapper gathers
one row of ``w`` per token and takes the row products (``ce_pallas_tpu.forward.label_logits``). This
compiles the whole forward (``ops.row_stats``, jitted) for a generation's deviceless topology and
prints every op libtpu profiled with its estimated cycles: the kernel, and the XLA fusions around it
(the gathered rows' products, the merge of the statistics). The gather itself is offloaded to the
SparseCore where the chip has one (v5p, v6e, TPU7x), which the static profile does not cover: the
script says whether the compiled program offloads it. ``--gather-only`` compiles nothing but the
gather of each token's label entries, a row of ``[V, H]`` or a column of ``[H, V]`` (what the wrapper
would have to gather for an ``[H, V]`` head: XLA copies the whole head to take it).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python benchmarks/tpu_label_logits.py --shape 4096x1024x151936 --target v6e
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_CYCLES = re.compile(r"estimated_cycles:\s*(\d+)")
_PROFILE = re.compile(r"^(.*)_static_llo_profile\.textproto$")
KERNEL = "ce_pallas_tpu_forward"


def parse_shape(text: str) -> tuple[int, int, int]:
    """``NxHxV`` as three positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected NxHxV (positive integers), got {text!r}")
    n, h, v = (int(part) for part in parts)
    return n, h, v


def read_profiles(profile_dir: Path) -> dict[str, int]:
    """Estimated cycles per profiled op (the file name up to ``_static_llo_profile``)."""
    cycles = {}
    for path in sorted(profile_dir.glob("*_static_llo_profile.textproto")):
        name, found = _PROFILE.match(path.name), _CYCLES.search(path.read_text())
        if name and found:
            cycles[name.group(1)] = int(found.group(1))
    return cycles


def _worker(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import ops
    from ce_pallas_tpu.tooling import aot

    n, h, v = args.shape
    spec = StatsSpec(w_layout=args.w_layout, with_expected=args.objective == "rl")
    with aot.compiling_for(args.target) as device:
        sharding = jax.sharding.SingleDeviceSharding(device)
        w_shape = (v, h) if args.w_layout == "vh" else (h, v)
        operands = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16, sharding=sharding),
                    jax.ShapeDtypeStruct(w_shape, jnp.bfloat16, sharding=sharding),
                    jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding))
        if args.gather_only:
            axis = 0 if args.w_layout == "vh" else 1
            program = jax.jit(lambda x, w, y: jnp.take(w, y, axis=axis, mode="clip"))
        else:
            program = jax.jit(lambda x, w, y: ops.row_stats(x, w, y, spec))
        compiled = program.lower(*operands).compile()
    hlo = compiled.as_text() or ""
    print("gather offloaded to the SparseCore:", "yes" if 'execution_thread="sparsecore"' in hlo else "no")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="The forward's ops in libtpu's static schedule, kernel and "
                                     "the XLA work beside it.")
    parser.add_argument("--target", default="v6e", choices=("v5e", "v5p", "v6e", "tpu7x"))
    parser.add_argument("--shape", type=parse_shape, default=(4096, 1024, 151936), help="NxHxV")
    parser.add_argument("--w-layout", choices=("hv", "vh"), default="vh")
    parser.add_argument("--objective", choices=("loss", "rl"), default="rl")
    parser.add_argument("--gather-only", action="store_true", help="compile only the gather of the labels' entries")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags

    with tempfile.TemporaryDirectory() as root:
        profile = Path(root)
        env = dict(os.environ, LIBTPU_INIT_ARGS=libtpu_flags(profile), CE_PALLAS_TPU_TILE_CACHE="off")
        done = subprocess.run([sys.executable, __file__, "--worker", *argv], env=env, check=True,
                              capture_output=True, text=True)
        cycles = read_profiles(profile)
    n, h, v = args.shape
    print(f"{args.target}, {n}x{h}x{v}, w_layout={args.w_layout}, {args.objective}"
          + (", the gather alone" if args.gather_only else ""))
    print(done.stdout.strip().splitlines()[-1])
    if args.gather_only:
        for name, c in sorted(cycles.items(), key=lambda item: -item[1]):
            print(f"| {name} | {c:,} |")
        print(f"in all: {sum(cycles.values()):,} cycles")
        return 0
    kernel = sum(c for name, c in cycles.items() if name.startswith(KERNEL))
    if not kernel:
        raise RuntimeError(f"no profile of {KERNEL} among {sorted(cycles)}")
    print("| op | estimated cycles | of the kernel's |")
    print("|---|---:|---:|")
    for name, c in sorted(cycles.items(), key=lambda item: -item[1]):
        print(f"| {name} | {c:,} | {c / kernel:.4f} |")
    outside = sum(cycles.values()) - kernel
    print(f"outside the kernel: {outside:,} cycles, {outside / kernel:.4f} of the kernel's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
