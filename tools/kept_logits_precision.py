"""What storing the kept logits in bfloat16 would do to the gradients, before any kernel stores them so.

The kept-logits path (``keep_logits``) writes each chunk's float32 logits to HBM in the forward and reads
them back in the backward: 4 bytes per logit each way. On v6e (560 flops per HBM byte) the forward's
writes cannot hide under its matmuls below ``H = 1120`` (2 H flops per 4 bytes), which leaves the narrow
heads of the RL models (Qwen2.5-0.5B, Qwen3-0.6B) HBM-bound; bfloat16 would halve the traffic and the
buffer. Issue 44 allows a compressed form only if the ``dx`` and ``dw`` errors stay those of today's path.

This measures it on the CPU in float64 arithmetic around each rounding the kernels make: bf16 ``x`` and
``w``, float32 logits (the MXU's accumulation), ``delta = softmax - onehot`` cast to bf16 for the
gradient products, ``dx`` and ``dw`` rounded to bf16 on output. The kept logits are stored four ways:

- ``float32``: today's path (the same numbers as the recompute);
- ``bf16``: the logit rounded as it is (its error grows with the logit's magnitude);
- ``bf16 - block max``: the logit minus its vocab block's row maximum, with that maximum kept in
  float32 beside it (one ``[rows, vocab blocks]`` column per block: a kernel knows it when it writes);
- ``bf16 - lane max``: minus the maximum over the block's columns of the same lane (``c mod 128``), what a
  streamed kernel step can form with one elementwise ``max`` per logit (no cross-lane reduction);
- ``bf16 - lse``: minus the row's logsumexp (known only after the row's last block: a bound, not a plan).

Each is the worst over seeds of ``max|err| / max|oracle|`` (``ce_core.testing.max_rel_error``) of ``dx``
and ``dw`` against the float64 oracle, after and before the bf16 output rounding.

    uv run python tools/kept_logits_precision.py [--seeds 4] [--tokens 512] [--hidden 256] [--vocab 4000]
"""

from __future__ import annotations

import argparse

import numpy as np

from ce_core.testing import max_rel_error

LANES = 128
STORES = ("float32", "bf16", "bf16 - block max", "bf16 - lane max", "bf16 - lse")


def _bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (to nearest even), back in float64."""
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


def errors(seed: int, n: int, h: int, v: int, scale: float, block_v: int,
           soft_cap: float | None) -> dict[str, tuple[float, float, float, float]]:
    """Per store: the ``dx`` and ``dw`` errors after the bf16 output rounding, then before it."""
    rng = np.random.default_rng(seed)
    x = _bf16(rng.standard_normal((n, h)))
    w = _bf16(rng.standard_normal((h, v)) * scale / np.sqrt(h))
    labels = rng.integers(0, v, n)
    onehot = np.zeros((n, v))
    onehot[np.arange(n), labels] = 1.0

    def capped(z: np.ndarray) -> np.ndarray:
        return z if soft_cap is None else soft_cap * np.tanh(z / soft_cap)

    def chain(z: np.ndarray) -> np.ndarray:  # d capped / d z
        return np.ones_like(z) if soft_cap is None else 1.0 - np.tanh(z / soft_cap) ** 2

    raw = x @ w
    z = capped(raw)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    delta = (p - onehot) * chain(raw) / n
    dx_oracle, dw_oracle = delta @ w.T, x.T @ delta

    raw32 = _f32(raw)  # the MXU's float32 accumulation of bf16 products
    z32 = _f32(capped(raw32))
    row_max = z32.max(1, keepdims=True)
    lse = row_max + np.log(np.exp(z32 - row_max).sum(1, keepdims=True))
    blocks = -(-v // block_v)
    block_max = np.concatenate([np.repeat(z32[:, j * block_v:(j + 1) * block_v].max(1, keepdims=True),
                                          min(block_v, v - j * block_v), axis=1) for j in range(blocks)], axis=1)
    lane_max = np.empty_like(z32)
    for start in range(0, v, block_v):
        block = z32[:, start:start + block_v]
        for lane in range(min(LANES, block.shape[1])):
            lane_max[:, start + lane:start + block_v:LANES] = block[:, lane::LANES].max(1, keepdims=True)
    kept = {"float32": z32, "bf16": _bf16(z32), "bf16 - block max": _bf16(z32 - block_max) + block_max,
            "bf16 - lane max": _bf16(z32 - lane_max) + lane_max, "bf16 - lse": _bf16(z32 - lse) + lse}
    out = {}
    for store, logits in kept.items():
        d = _bf16((np.exp(logits - lse) - onehot) * _f32(chain(raw32)) / n)  # delta, bf16 for the MXU
        dx, dw = d @ w.T, x.T @ d
        out[store] = (max_rel_error(_bf16(dx), dx_oracle), max_rel_error(_bf16(dw), dw_oracle),
                      max_rel_error(dx, dx_oracle), max_rel_error(dw, dw_oracle))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--block-v", type=int, default=1024)
    args = parser.parse_args()
    print("| logits (std) | soft cap | store | dx err | dw err | dx before rounding | dw before rounding |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for scale, cap in ((1.0, None), (4.0, None), (16.0, None), (16.0, 30.0)):
        worst = {store: np.zeros(4) for store in STORES}
        for seed in range(args.seeds):
            for store, errs in errors(seed, args.tokens, args.hidden, args.vocab, scale, args.block_v, cap).items():
                worst[store] = np.maximum(worst[store], errs)
        for store in STORES:
            a = worst[store]
            print(f"| {scale:g} | {cap or '-'} | {store} | {a[0]:.2e} | {a[1]:.2e} | {a[2]:.2e} | {a[3]:.2e} |")


if __name__ == "__main__":
    main()
