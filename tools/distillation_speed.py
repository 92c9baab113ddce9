"""CPU time of the distillation loss beside the plain loss, fwd+bwd, interleaved in one run.

    uv run python tools/distillation_speed.py [--shape 1024x512x16384] [--k 64] [--teacher-hidden HT]
        [--divergence forward_kl] [--repeats 7] [--dtype float32]

``jax.value_and_grad`` (w.r.t. ``x`` and ``w``) of ``linear_distillation_loss`` (a top-``k`` teacher, the
hard label at temperature 1 in the same pass) and of ``linear_cross_entropy``, both on ``xla``, jitted, timed
alternately ``--repeats`` times (median ms); the ratio is the distillation's cost over the plain loss's.
With ``--teacher-hidden`` the teacher is dense (``[N, HT]`` hidden states, an ``[HT, V]`` head; no hard label),
and beside it the same loss on ``reference`` (both heads' logits materialised, its gradient recomputing them) and
as a user writes it in plain JAX (both float32 logits, ``log_softmax``, autodiff): issue 42's yardsticks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ce_core import linear_cross_entropy, linear_distillation_loss

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1024x512x16384")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--teacher-hidden", type=int, default=None)
    parser.add_argument("--divergence", default="forward_kl")
    args = parser.parse_args(argv)
    n, h, v = (int(part) for part in args.shape.split("x"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, h)), args.dtype)
    w = jnp.asarray(rng.standard_normal((h, v)) / np.sqrt(h), args.dtype)
    labels = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    indices = jnp.asarray(np.argsort(rng.random((n, v)), axis=1)[:, :args.k], jnp.int32)
    log_probs = jnp.asarray(np.log(rng.dirichlet(np.ones(args.k), n) * 0.9), jnp.float32)

    def distill(a, b, *teacher, implementation="xla"):
        if teacher:  # the teacher as arguments: as constants XLA would fold its logits at compile time
            teacher_x, teacher_w = teacher
            return linear_distillation_loss(a, b, teacher_x, teacher_w, labels, divergence=args.divergence,
                                            implementation=implementation)
        return linear_distillation_loss(a, b, labels=labels, teacher_indices=indices, teacher_log_probs=log_probs,
                                        hard_label_weight=0.1, implementation=implementation)

    def plain(a, b, *teacher):
        del teacher
        return linear_cross_entropy(a, labels, b, implementation="xla")

    contenders = [("plain", plain), ("distill", distill)]
    teacher: tuple[jax.Array, ...] = ()
    if args.teacher_hidden:
        ht = args.teacher_hidden
        teacher = (jnp.asarray(rng.standard_normal((n, ht)), args.dtype),
                   jnp.asarray(rng.standard_normal((ht, v)) / np.sqrt(ht), args.dtype))
        contenders.append(("materialised", lambda a, b, *t: distill(a, b, *t, implementation="reference")))
        contenders.append(("plain_jax", lambda a, b, tx, tw: plain_jax_divergence(a, b, tx, tw, args.divergence)))
    steps = {name: jax.jit(jax.value_and_grad(fn, argnums=(0, 1))) for name, fn in contenders}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        jax.block_until_ready(step(x, w, *teacher))
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(x, w, *teacher))
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}
    kind = f"dense Ht={args.teacher_hidden} {args.divergence}" if args.teacher_hidden else f"k={args.k}"
    line = (f"{args.shape} {args.dtype} {kind}: plain {medians['plain']:.1f} ms, distillation "
            f"{medians['distill']:.1f} ms, ratio {medians['distill'] / medians['plain']:.3f}")
    if "materialised" in medians:
        line += (f"; materialised (reference) {medians['materialised']:.1f} ms, xla / materialised "
                 f"{medians['distill'] / medians['materialised']:.3f}; plain JAX {medians['plain_jax']:.1f} ms, "
                 f"xla / plain JAX {medians['distill'] / medians['plain_jax']:.3f}")
    print(line)
    return 0


def plain_jax_divergence(x, w, teacher_x, teacher_w, divergence: str, beta: float = 0.5):
    """The mean divergence from both heads' materialised float32 logits, as a user writes it without ce_core."""
    import jax
    import jax.numpy as jnp

    log_p = jax.nn.log_softmax(jnp.dot(x, w, preferred_element_type=jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(jnp.dot(teacher_x, teacher_w, preferred_element_type=jnp.float32), axis=-1)
    log_q = jax.lax.stop_gradient(log_q)
    if divergence == "forward_kl":
        per_token = jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)
    elif divergence == "reverse_kl":
        per_token = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    else:
        log_m = jnp.logaddexp(jnp.log(beta) + log_q, jnp.log1p(-beta) + log_p)
        per_token = (beta * jnp.sum(jnp.exp(log_q) * (log_q - log_m), axis=-1)
                     + (1 - beta) * jnp.sum(jnp.exp(log_p) * (log_p - log_m), axis=-1))
    return jnp.mean(per_token)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
