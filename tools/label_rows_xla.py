"""libtpu's static profile of the XLA work of the label's term by rows (``BackwardConfig.label_rows``), per call.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/label_rows_xla.py GEN --heads a,b [--tokens 4096]

For each tied head of ``ce_bench.presets.MODEL_HEADS`` (``[V, H]``) whose kept plan at ``--tokens`` adds the
label's term by rows, ``ce_pallas_tpu.label_rows.label_rows`` of one backward call's rows compiled alone for
``GEN`` (the kept logits' gather at the labels, the sort by label, the rows' offsets, ``dx``'s share from the
gathered rows of ``w``), its ops' estimated cycles summed. Recorded in docs/notes/data/kept-logits-matrix.json
under ``label_rows_xla`` (``tools/kept_matrix.py table`` adds them to the kept path's XLA time, once per
backward call). An upper bound: in a step ``dx``'s share is added in the fusion that sums the cores' ``dx``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kept_matrix  # tools/ is not a package


def measure(gen: str, names: list[str], tokens: int) -> dict[str, dict]:
    profiles_dir = Path(tempfile.mkdtemp())
    from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags

    os.environ["LIBTPU_INIT_ARGS"] = libtpu_flags(profiles_dir)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from ce_pallas_tpu.label_rows import label_rows
    from ce_pallas_tpu.tooling.aot import compiling_for
    from ce_pallas_tpu.tooling.schedule.step import read_op_profiles

    found = {}
    for name, h, v in kept_matrix.heads(",".join(names)):
        for stale in profiles_dir.glob("*"):
            stale.unlink()
        with compiling_for(gen) as device:
            plan = kept_matrix.kept_plan(gen, tokens, h, v, "vh")
            cfg = plan.backward
            if not cfg.label_rows:
                print(f"{name}: the plan adds the label's term per logit", file=sys.stderr)
                continue
            sharding = jax.sharding.SingleDeviceSharding(device)

            def operand(shape, dtype, sharding=sharding):
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

            column = operand((cfg.n, 1), jnp.float32)
            logits = operand(plan.logits_shape, jnp.bfloat16 if cfg.kept_bf16 else jnp.float32)
            maxima = None if plan.maxima_shape is None else operand(plan.maxima_shape, jnp.float32)
            args = (logits, operand((v, h), jnp.bfloat16), operand((cfg.n, 1), jnp.int32), column, column, maxima)
            program = jax.jit(lambda lg, w, y, lse, g, m, cfg=cfg: label_rows(lg, w, y, lse, g, None, None, cfg, m))
            program.lower(*args).compile()
        cycles = sum(p.cycles * p.equivalents for p in read_op_profiles(profiles_dir))
        found[name] = {"rows": cfg.n, "h": h, "v": v, "cycles": cycles}
        print(f"{name}: {cfg.n} rows, {cycles} cycles", file=sys.stderr)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description="the label rows' XLA work in libtpu's static profile")
    parser.add_argument("gen")
    parser.add_argument("--heads", required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    found = measure(args.gen, args.heads.split(","), args.tokens)
    data = kept_matrix.load()
    data.setdefault("label_rows_xla", {}).setdefault(args.gen, {}).update(found)
    kept_matrix.save(data)


if __name__ == "__main__":
    main()
