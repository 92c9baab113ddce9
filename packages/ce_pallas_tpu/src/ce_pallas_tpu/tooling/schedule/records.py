"""A schedule request (:class:`Job`) and its answer (:class:`KernelSchedule`), both plain JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

KERNELS = ("forward", "backward")
#: Where a kept-logits chunk sits in its call, which sets how its backward's float32 ``dw`` starts and ends:
#: ``only`` (a call of one chunk: from zero, out in ``w``'s dtype), ``first`` (from zero onto the running
#: sum), ``middle`` (added onto the running sum in place) and ``last`` (the running sum out in ``w``'s dtype).
CHUNK_ROLES = ("only", "first", "middle", "last")


def running_dw(chunk_role: str) -> tuple[bool, bool]:
    """``(reads, writes)``: whether a chunk of this role reads the float32 running ``dw`` (after the first chunk)
    and writes it (before the last; else the finished ``dw`` goes out in ``w``'s dtype)."""
    return chunk_role in ("middle", "last"), chunk_role in ("first", "middle")


def role_of_running_dw(reads: bool, writes: bool) -> str:
    """The chunk role (:data:`CHUNK_ROLES`) whose backward reads and writes the running ``dw`` so
    (:func:`running_dw`'s inverse)."""
    return next(role for role in CHUNK_ROLES if running_dw(role) == (reads, writes))


def chunk_roles(chunks: int) -> dict[str, int]:
    """How many chunks of a kept-logits call of ``chunks`` chunks take each role (:data:`CHUNK_ROLES`)."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if chunks == 1:
        return {"only": 1}
    return {role: count for role, count in (("first", 1), ("middle", chunks - 2), ("last", 1)) if count}


@dataclasses.dataclass(frozen=True)
class Job:
    """One kernel of one problem to measure; ``tiles`` ``(block_b, block_h, block_v)`` override that
    kernel's defaults."""

    kernel: str
    n: int
    h: int
    v: int
    x_dtype: str = "bfloat16"
    w_dtype: str = "bfloat16"
    tiles: tuple[int, int | None, int] | None = None
    w_buffers: int | None = None  # the backward's w buffers (None: as the plan chooses)
    logit_soft_cap: float | None = None
    with_sum: bool = False
    with_expected: bool = False  # the entropy's extra statistic (linear_log_probs(return_entropy=True))
    precision: str | None = None
    w_layout: str = "hv"  # "vh": a [V, H] head (tied embedding)
    with_argmax: bool = False  # the forward also tracks each row's argmax (return_argmax=True)
    #: The kernels of the no-recompute path (``keep_logits=True``) at one chunk of ``n`` tokens: the
    #: forward writing its logits, the backward reading them (two matmuls) and adding onto a float32 dw.
    keep_logits: bool = False
    #: The kept backward's hidden tiles (``None``: as the plan of one chunk of ``n`` tokens chooses).
    hidden_split: int | None = None
    #: Whether that backward forms ``delta`` once over its tiles (``None``: as the plan chooses).
    delta_over_logits: bool | None = None
    #: Whether that backward holds ``x`` transposed (``None``: as the plan chooses).
    x_transposed: bool | None = None
    #: Which chunk of its call that backward is (:data:`CHUNK_ROLES`); the forward is the same in each.
    chunk_role: str = "middle"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.chunk_role not in CHUNK_ROLES:
            raise ValueError(f"chunk_role must be one of {CHUNK_ROLES}, got {self.chunk_role!r}")
        if self.w_layout not in ("hv", "vh"):
            raise ValueError(f"w_layout must be 'hv' or 'vh', got {self.w_layout!r}")

    @property
    def variant(self) -> str:
        """What the job asks beyond the plain loss, in words (``""`` for the plain loss)."""
        parts = [name for name, on in (("vh", self.w_layout == "vh"), ("argmax", self.with_argmax),
                                       ("rl", self.with_expected), ("sum", self.with_sum),
                                       ("cap", self.logit_soft_cap is not None), ("kept", self.keep_logits)) if on]
        return "+".join(parts)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        tiles = data.get("tiles")
        return cls(**{**data, "tiles": None if tiles is None else tuple(tiles)})


@dataclasses.dataclass
class KernelSchedule:
    """The static schedule of one kernel at one problem, per grid step and in total (one TensorCore).

    ``*_per_step`` are averages over the walked core's full grid, from the bilinear fit of small
    grids; ``interior_cycles_per_step`` is a step away from the grid's edges. ``ratio`` is cycles per
    step over the MXU minimum (1.0: matmul-bound). ``hbm_us_per_step`` is the DMA traffic of a step at
    the core's HBM bandwidth (never less than the operand blocks it must move), to set beside
    ``mxu_us_per_step``: the static cycles do not see HBM.
    """

    generation: str
    kernel: str
    n: int
    h: int
    v: int
    x_dtype: str
    w_dtype: str
    tiles: tuple[int, int, int] | None = None  # block_b, block_h, block_v as the kernel uses them
    w_buffers: int | None = None  # the backward's w buffers
    variant: str = ""  # Job.variant: "" for the plain loss, else e.g. "vh+argmax" or "rl"
    grid: tuple[int, ...] | None = None  # the kernel's full grid
    cores: int | None = None
    steps_per_core: int | None = None
    cycles_per_step: float | None = None
    interior_cycles_per_step: float | None = None
    bundles_per_step: float | None = None
    vmatmuls_per_step: float | None = None
    mxu_cycles_per_step: float | None = None
    ratio: float | None = None
    dma_bytes_per_step: float | None = None  # counted from the DMA waits of the executed bundles
    hbm_bytes_per_step: float | None = None  # those, or the operand blocks a step must move if more
    hbm_us_per_step: float | None = None
    mxu_us_per_step: float | None = None
    step_us: float | None = None  # cycles per step at the clock
    kernel_us: float | None = None  # the walked core's whole grid at the clock
    hbm_floor_us: float | None = None  # the walked core's HBM bytes at its bandwidth
    roofline_us: float | None = None  # the kernel's flops at the chip's peak (all cores)
    grids_compiled: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    compile_s: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelSchedule:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in fields})
