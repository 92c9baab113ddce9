"""What the static schedule is measured against: each generation's MXUs, clock and HBM per core.

The MXU minimum of a matmul ``[M, K] @ [K, N]`` is ``M * ceil(K / side) * ceil(N / side)`` rows
streamed through ``side x side`` systolic arrays, spread over the core's MXUs, ``rows_per_cycle``
LHS rows per cycle each. v5e and v5p: 4 MXUs of 128x128, one row per cycle; v6e and TPU7x: 2 MXUs
of 256x256, two rows per cycle (the only reading consistent with their peak bf16 rates). The
clock follows from the peak rate: ``flops = 2 * MXUs * side**2 * rows_per_cycle * clock``.
A plain Pallas matmul lands at 1.02-1.03 of this minimum in libtpu's estimated cycles.
"""

from __future__ import annotations

import dataclasses

from ce_pallas_tpu.layout import cdiv


@dataclasses.dataclass(frozen=True)
class ScheduleChip:
    """One TensorCore of a generation, as far as the MXU minimum and the HBM time need it."""

    mxus: int
    side: int  # systolic array is side x side
    rows_per_cycle: int  # LHS rows each MXU takes per cycle
    bf16_flops: float  # peak bf16 flop/s of one TensorCore
    hbm_bytes_per_s: float  # HBM bandwidth available to one TensorCore

    @property
    def clock_hz(self) -> float:
        return self.bf16_flops / (2 * self.mxus * self.side * self.side * self.rows_per_cycle)

    def matmul_cycles(self, m: int, k: int, n: int) -> float:
        """Fewest cycles of one bf16 ``[m, k] @ [k, n]`` on this core's MXUs."""
        tiles = cdiv(k, self.side) * cdiv(n, self.side)
        return m * tiles / (self.mxus * self.rows_per_cycle)


#: Per-TensorCore figures (v5p's HBM is shared by its two cores; TPU7x exposes each core as a device).
SCHEDULE_CHIPS: dict[str, ScheduleChip] = {
    "v5e": ScheduleChip(4, 128, 1, 197e12, 0.819e12),
    "v5p": ScheduleChip(4, 128, 1, 229.5e12, 2.765e12 / 2),
    "v6e": ScheduleChip(2, 256, 2, 918e12, 1.64e12),
    "tpu7x": ScheduleChip(2, 256, 2, 1155e12, 3.7e12),
}

#: Generations libtpu can walk a static profile for (v4's DMA model is missing).
PROFILED_GENERATIONS = tuple(SCHEDULE_CHIPS)


def kernel_matmuls(kernel: str, block_b: int, step_h: int, block_v: int,
                   kept: bool = False) -> list[tuple[int, int, int]]:
    """The ``(M, K, N)`` matmuls of one grid step of a kernel with tiles ``block_b x step_h x block_v``.

    ``step_h`` is the hidden extent of a step's tiles: the forward's hidden block, the whole padded
    hidden size ``hp`` in the backward. Forward: the logit tile ``x @ w``. Backward: the logits
    again, ``dw = x.T @ delta`` and ``dx = delta @ w.T``; with ``kept`` (the no-recompute path's backward)
    the last two only.
    """
    if kernel == "forward":
        return [(block_b, step_h, block_v)]
    if kernel == "backward":
        gradients = [(step_h, block_b, block_v), (block_b, block_v, step_h)]
        return gradients if kept else [(block_b, step_h, block_v), *gradients]
    raise ValueError(f"unknown kernel {kernel!r}")


def mxu_cycles(generation: str, kernel: str, block_b: int, step_h: int, block_v: int, kept: bool = False) -> float:
    """Fewest MXU cycles of one grid step (bf16 operands, one pass per product); arguments as in
    :func:`kernel_matmuls`."""
    chip = SCHEDULE_CHIPS[generation]
    return sum(chip.matmul_cycles(m, k, n) for m, k, n in kernel_matmuls(kernel, block_b, step_h, block_v, kept))
