"""HBM temporaries of the distillation loss beside the plain loss, compiled, no TPU needed.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/distillation_memory.py [--tokens 16384] [--hidden 1024]
        [--vocab 151936] [--k 64] [--teacher-hidden HT] [--targets cpu,v5e,v5p,v6e] [--tpu-backend xla]

With ``--teacher-hidden`` the teacher is dense (``teacher_x [N, HT]``, ``teacher_w [HT, V]``, bf16, the forward
KL); without it, a top-``k`` teacher. ``--tpu-backend`` (default ``pallas_tpu``) is the backend both losses
run on for a TPU target.

``value_and_grad`` (w.r.t. ``x`` and ``w``, bf16) of ``linear_distillation_loss`` with a top-``k`` teacher and of
``linear_cross_entropy`` on the same student head, each compiled for every target (``cpu``: the ``xla``
backend on this machine; a TPU generation: ``pallas_tpu`` through libtpu's deviceless topology), and their
``memory_analysis().temp_size_in_bytes``, beside the two float32 ``[N, V]`` logit tensors that materialising
both heads would hold (the issue 42 yardstick). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def compile_temp_bytes(target: str, n: int, h: int, v: int, k: int, teacher_hidden: int | None = None,
                       tpu_backend: str = "pallas_tpu") -> dict[str, int]:
    import jax
    import jax.numpy as jnp

    from ce_core import linear_cross_entropy, linear_distillation_loss
    from ce_core.testing import compile_program

    implementation = "xla" if target == "cpu" else tpu_backend

    def distill(x, w, labels, first, second):
        if teacher_hidden:  # a dense teacher: its hidden states and head
            return linear_distillation_loss(x, w, first, second, labels, implementation=implementation)
        return linear_distillation_loss(x, w, labels=labels, teacher_indices=first, teacher_log_probs=second,
                                        implementation=implementation)

    def plain(x, w, labels, indices, log_probs):
        del indices, log_probs
        return linear_cross_entropy(x, labels, w, implementation=implementation)

    out = {}
    for name, fn in (("plain", plain), ("distill", distill)):
        def compile_fn(fn=fn):
            def args(sharding=None):
                teacher = ((((n, teacher_hidden), jnp.bfloat16), ((teacher_hidden, v), jnp.bfloat16))
                           if teacher_hidden else (((n, k), jnp.int32), ((n, k), jnp.float32)))
                shapes = (((n, h), jnp.bfloat16), ((h, v), jnp.bfloat16), ((n,), jnp.int32), *teacher)
                return tuple(jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes)

            step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
            if target == "cpu":
                return step.lower(*args()).compile()
            from ce_pallas_tpu.tooling import aot

            with aot.compiling_for(target) as device:
                return step.lower(*args(jax.sharding.SingleDeviceSharding(device))).compile()

        result = compile_program(compile_fn)[1]
        if not result.ok or result.temp_bytes is None:
            raise RuntimeError(f"{target} {name}: {result.error}")
        out[name] = result.temp_bytes
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--teacher-hidden", type=int, default=None, help="a dense teacher of this width")
    parser.add_argument("--targets", default="cpu,v5e,v5p,v6e")
    parser.add_argument("--tpu-backend", default="pallas_tpu", choices=("pallas_tpu", "xla"))
    args = parser.parse_args(argv)
    n, h, v, k = args.tokens, args.hidden, args.vocab, args.k
    logits = 2 * 4 * n * v
    teacher = f"dense teacher Ht={args.teacher_hidden}" if args.teacher_hidden else f"k={k}"
    teacher += f"; TPU targets on {args.tpu_backend}, cpu on xla"
    print(f"N={n}, H={h}, V={v}, {teacher}, bf16; two float32 [N, V] logit tensors: {logits / 1e6:,.0f} MB\n")
    print("| target | plain loss MB | distillation MB | added MB | distillation / two f32 logits |")
    print("|---|---:|---:|---:|---:|")
    for target in args.targets.split(","):
        got = compile_temp_bytes(target, n, h, v, k, args.teacher_hidden, args.tpu_backend)
        print(f"| {target} | {got['plain'] / 1e6:,.1f} | {got['distill'] / 1e6:,.1f} "
              f"| {(got['distill'] - got['plain']) / 1e6:,.1f} | {got['distill'] / logits:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
