"""How slow this machine is right now, against the one CI's tier budgets were set on.

CI's machines are shared: one day's tiers took 1.6-1.9 times as long as the day before's, the tier
neither day's change touched included (jax_min: 89 s, then 146 s). A budget in plain seconds
then fails a run for the machine's load, not for the suite's growth. ``.ci/run`` runs this between
its tiers and holds each tier to its budget times the slowdown measured around it (never less than
the budget itself), so a budget still catches a suite that grew, on a slow day as on a quiet one.

The workload is the suite's in miniature: on each of the two cores at once (the suite runs one pytest
worker per core), a process traces, compiles for the CPU and runs a fixed set of small JAX programs
of distinct shapes (a scanned, chunked cross-entropy and its gradient). It prints the slowdown,
the workload's wall time over :data:`REFERENCE_SECONDS`, its wall time on a machine as fast as
the one the budgets were measured on.

    uv run python tools/machine_speed.py            # prints e.g. 1.00
    uv run python tools/machine_speed.py --seconds  # prints the wall time instead
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# The workload's wall time on a machine at the speed CI's budgets were set for (.ci/run). Derived on
# the 2-core development machine on 2026-11-29: the workload and the jax_min tier measured back to back
# (see docs/notes/2026-11-29-ci-machine-speed.md), scaled to the jax_min tier's 89 s in the fresh-clone
# run of the last commit that landed (2,237 s in all; CI ran it in 2,215 s).
REFERENCE_SECONDS = 9.0

PROGRAMS = 8


def workload() -> None:
    """Trace, compile and run :data:`PROGRAMS` chunked cross-entropy programs, each of its own shape."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)

    def chunked_loss(x: jax.Array, w: jax.Array, labels: jax.Array) -> jax.Array:
        def chunk(total: jax.Array, rows: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            x_rows, label_rows = rows
            logits = x_rows @ w
            picked = jnp.take_along_axis(logits, label_rows[:, None], axis=-1)[:, 0]
            return total + jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked), None

        total, _ = jax.lax.scan(chunk, jnp.zeros((), x.dtype), (x.reshape(4, -1, x.shape[-1]), labels.reshape(4, -1)))
        return total

    step = jax.value_and_grad(chunked_loss, argnums=(0, 1))
    for program in range(PROGRAMS):
        tokens, hidden, vocab = 256 + 16 * program, 128, 1000 + 37 * program
        keys = jax.random.split(jax.random.key(program), 3)
        x = jax.random.normal(keys[0], (tokens, hidden)) / hidden**0.5
        w = jax.random.normal(keys[1], (hidden, vocab))
        labels = jax.random.randint(keys[2], (tokens,), 0, vocab)
        compiled = jax.jit(step).lower(x, w, labels).compile()
        for _ in range(20):
            jax.block_until_ready(compiled(x, w, labels))


def seconds_on_both_cores() -> float:
    """Wall time of the workload run in two processes at once, one per core, after each has imported JAX."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import jax, sys; print('ready', flush=True); sys.stdin.readline(); "
            "import machine_speed; machine_speed.workload()")
    command = [sys.executable, "-c", code]
    workers = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
               for _ in range(2)]
    # Start the clock once both have imported JAX: import time is the disk's, not the cores'.
    for worker in workers:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.close()
    for worker in workers:
        if worker.wait() != 0:
            raise SystemExit(f"the workload failed (exit {worker.returncode})")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description="How slow this machine is now, against CI's budgets' machine.")
    parser.add_argument("--seconds", action="store_true", help="print the workload's wall time, not the slowdown")
    args = parser.parse_args()
    seconds = seconds_on_both_cores()
    print(f"{seconds:.2f}" if args.seconds else f"{seconds / REFERENCE_SECONDS:.2f}")


if __name__ == "__main__":
    main()
