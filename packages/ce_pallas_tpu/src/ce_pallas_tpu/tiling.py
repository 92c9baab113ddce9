"""Tile sizes: a tuned table by TPU generation and shape bucket, an inference rule, validation.

Both kernels read three sizes. The forward: ``b`` tokens x ``v`` vocab columns per logit tile, and
``h`` hidden rows per step (``None``: the whole hidden dimension, ``x`` then stays resident in VMEM
across the vocab loop). The backward: ``b`` and ``v`` the same way (its tiles always span the whole
hidden dimension, because ``delta`` needs complete logits) and ``h`` the chunk in which the
``dx``/``dw`` products are formed (bounding their temporaries).

Order of precedence:

1. explicit ``ce_core.BlockSizes``: used for both kernels (``None`` fields are filled from the rules
   below); a size the kernels cannot use is a ``ValueError`` that says why;
2. the tuned table ``TUNED[(generation, bucket)]``, if the entry fits this problem's VMEM;
3. inference: the tiles with the least roofline time (compute vs HBM traffic vs per-step cost,
   :mod:`ce_pallas_tpu.cost_model`) among those whose footprint fits the generation's VMEM budget.

A tile larger than its dimension covers the whole dimension (the block then equals the array's
extent, which every TPU layout accepts).
"""

from __future__ import annotations

import dataclasses
import itertools

from ce_core import BlockSizes, UnsupportedError
from ce_pallas_tpu import cost_model
from ce_pallas_tpu.cost_model import Shape
from ce_pallas_tpu.target import CHIP_FACTS, Target

#: Share of a core's VMEM the chosen tiles may use; the rest is Mosaic's internal scratch and slack.
VMEM_BUDGET_FRACTION = 0.8
#: Scoped-VMEM limit handed to Mosaic, as a share of the core's VMEM.
VMEM_LIMIT_FRACTION = 0.9

SUBLANES = 8
LANES = 128


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Token block ``b``, hidden block/chunk ``h`` (``None``: whole hidden dim), vocab block ``v``."""

    b: int
    h: int | None
    v: int


@dataclasses.dataclass(frozen=True)
class FittedTiles(KernelTiles):
    """Kernel tiles fitted to one problem: the hidden block/chunk ``h`` is always set (it divides ``Hp``)."""

    h: int


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tiles of both kernels and where they came from (``table:<gen>/<bucket>``, ``inferred``...)."""

    forward: FittedTiles
    backward: FittedTiles
    source: str


#: Shape buckets, first match wins (N tokens, H hidden, V vocab).
BUCKET_RULES: tuple[tuple[str, str], ...] = (
    ("small", "N < 2048 or V < 16384 or H < 1024"),
    ("wide", "H > 4096"),
    ("huge_batch", "N >= 32768"),
    ("large_vocab", "V > 131072"),
    ("llama3", "everything else: H <= 4096, V <= 131072, N < 32768 (Llama-3: 4096 x 128256)"),
)

#: A representative problem per bucket (N, H, V): the tuned entries were chosen at these shapes,
#: and every entry is compiled for its generation at its bucket's shape by the test suite.
BUCKET_EXAMPLES: dict[str, tuple[int, int, int]] = {
    "small": (1024, 1024, 32000),
    "wide": (8192, 8192, 128256),
    "huge_batch": (32768, 2048, 151936),
    "large_vocab": (8192, 4096, 151936),
    "llama3": (8192, 4096, 128256),
}


def shape_bucket(n: int, h: int, v: int) -> str:
    """The bucket of :data:`BUCKET_RULES` that a problem falls in."""
    if n < 2048 or v < 16384 or h < 1024:
        return "small"
    if h > 4096:
        return "wide"
    if n >= 32768:
        return "huge_batch"
    if v > 131072:
        return "large_vocab"
    return "llama3"


def _kt(b: int, h: int | None, v: int) -> KernelTiles:
    return KernelTiles(b, h, v)


#: (generation, bucket) -> (forward tiles, backward tiles). Seeded from the inference rule below
#: (roofline model and VMEM footprints fitted to libtpu's compiler) at each bucket's example shape
#: in bf16, smaller tiles for the small bucket, and compiled for each generation through libtpu's
#: deviceless topologies by the test suite. The backward entries of v5p (llama3, large_vocab) and
#: v6e (llama3, large_vocab, huge_batch) were then chosen from libtpu's static schedule (issue 11,
#: ``ce-bench schedule``; docs/benchmarks.md): the candidates with the fewest cycles per MXU minimum
#: whose HBM time per step stays below the MXU time and that the VMEM model admits. Not yet timed on
#: TPU hardware: measured entries replace these as they come.
TUNED: dict[tuple[str, str], tuple[KernelTiles, KernelTiles]] = {}


def _fill_table() -> None:
    entries = {
        "v4": {
            "small": (_kt(256, None, 512), _kt(128, 512, 512)),
            "wide": (_kt(512, 256, 512), _kt(32, 512, 128)),
            "huge_batch": (_kt(256, None, 512), _kt(64, 512, 512)),
            "large_vocab": (_kt(256, None, 256), _kt(64, 512, 256)),
            "llama3": (_kt(256, None, 256), _kt(64, 512, 256)),
        },
        "v5e": {
            "small": (_kt(512, None, 512), _kt(256, 512, 512)),
            "wide": (_kt(512, None, 256), _kt(128, 512, 512)),
            "huge_batch": (_kt(512, None, 1024), _kt(512, 512, 512)),
            "large_vocab": (_kt(512, None, 512), _kt(256, 512, 512)),
            "llama3": (_kt(512, None, 512), _kt(256, 512, 512)),
        },
        "v5p": {
            "small": (_kt(512, None, 512), _kt(256, 512, 512)),
            "wide": (_kt(512, None, 256), _kt(64, 512, 512)),
            "huge_batch": (_kt(512, None, 1024), _kt(512, 512, 512)),
            "large_vocab": (_kt(512, None, 512), _kt(256, 512, 512)),
            "llama3": (_kt(512, None, 512), _kt(256, 512, 512)),
        },
        "v6e": {
            "small": (_kt(512, None, 1024), _kt(256, 512, 1024)),
            "wide": (_kt(1024, None, 512), _kt(128, 512, 1024)),
            "huge_batch": (_kt(1024, None, 2048), _kt(512, 512, 2048)),
            "large_vocab": (_kt(1024, None, 1024), _kt(256, 512, 2048)),
            "llama3": (_kt(1024, None, 1024), _kt(256, 512, 2048)),
        },
    }
    for generation, buckets in entries.items():
        for bucket, tiles in buckets.items():
            TUNED[(generation, bucket)] = tiles


_fill_table()


def vmem_budget(target: Target) -> int:
    return int(target.vmem_bytes * VMEM_BUDGET_FRACTION)


def vmem_limit(target: Target) -> int:
    return int(target.vmem_bytes * VMEM_LIMIT_FRACTION)


# ---------------------------------------------------------------------------------------------
# Resolving tiles for one problem.


def _divisor_at_most(hp: int, h: int) -> int:
    """The largest multiple of 128 that divides ``hp`` and is at most ``h`` (at least 128)."""
    for candidate in range(min(h, hp) // LANES * LANES, 0, -LANES):
        if hp % candidate == 0:
            return candidate
    return LANES


def _fit(shape: Shape, tiles: KernelTiles, *, backward: bool) -> FittedTiles:
    """Clamp tiles to the problem: a block never exceeds its dimension; ``h`` divides ``Hp``."""
    b = shape.n if shape.n <= tiles.b else tiles.b
    v = shape.v if shape.v <= tiles.v else tiles.v
    if backward:
        h = _divisor_at_most(shape.hp, tiles.h or 512)
    else:
        h = shape.hp if tiles.h is None else _divisor_at_most(shape.hp, tiles.h)
    return FittedTiles(b, h, v)


def _fits(shape: Shape, forward: FittedTiles, backward: FittedTiles, budget: int) -> bool:
    return (
        cost_model.forward_bytes(shape, forward.b, forward.h, forward.v) <= budget
        and cost_model.backward_bytes(shape, backward.b, backward.h, backward.v) <= budget
    )


def _infer(shape: Shape, target: Target, budget: int) -> Tiles:
    """Tiles within 3% of the least roofline time that fit ``budget``; the smallest footprint wins.

    Raises:
      UnsupportedError: not even the smallest tiles fit (a hidden size too large for this VMEM).
    """
    facts = target.facts
    tokens = (2048, 1024, 512, 256, 128, 64, 32, 16, 8)
    columns = (2048, 1024, 512, 256, 128)
    hiddens = [None] + [h for h in (4096, 2048, 1024, 512, 256, 128) if h < shape.hp and shape.hp % h == 0]

    forward_options = []
    for b, v, h in itertools.product(tokens, columns, hiddens):
        tiles = _fit(shape, KernelTiles(b, h, v), backward=False)
        need = cost_model.forward_bytes(shape, tiles.b, tiles.h, tiles.v)
        if need <= budget:
            seconds = cost_model.forward_seconds(shape, facts, target.num_cores, tiles.b, tiles.h, tiles.v)
            forward_options.append((seconds, need, tiles))

    backward_options = []
    for b, v in itertools.product(tokens, columns):
        tiles = _fit(shape, KernelTiles(b, 512, v), backward=True)
        need = cost_model.backward_bytes(shape, tiles.b, tiles.h, tiles.v)
        if need <= budget:
            seconds = cost_model.backward_seconds(shape, facts, target.num_cores, tiles.b, tiles.v)
            backward_options.append((seconds, need, tiles))

    if not forward_options or not backward_options:
        smallest = _fit(shape, KernelTiles(8, 128, 128), backward=True)
        need = cost_model.backward_bytes(shape, smallest.b, smallest.h, smallest.v)
        raise UnsupportedError(
            f"pallas_tpu: hidden size H={shape.hp} needs at least {need / 2**20:.1f} MiB of VMEM even "
            f"with the smallest tiles, more than the {budget / 2**20:.1f} MiB budget on {target.generation}"
        )
    return Tiles(_pick(forward_options), _pick(backward_options), "inferred")


def _pick(options: list[tuple[float, int, FittedTiles]]) -> FittedTiles:
    """Among options within 3% of the fastest, the one with the smallest VMEM footprint."""
    fastest = min(seconds for seconds, _, _ in options)
    near = [(need, -tiles.b, -tiles.v, tiles) for seconds, need, tiles in options if seconds <= 1.03 * fastest]
    return min(near, key=lambda item: item[:3])[3]


def tuned_tiles(shape: Shape, target: Target) -> Tiles:
    """The table entry for this problem when it fits, else the inferred tiles."""
    budget = vmem_budget(target)
    bucket = shape_bucket(shape.n, shape.hp, shape.v)
    entry = TUNED.get((target.generation, bucket))
    if entry is not None:
        forward, backward = _fit(shape, entry[0], backward=False), _fit(shape, entry[1], backward=True)
        if _fits(shape, forward, backward, budget):
            return Tiles(forward, backward, f"table:{target.generation}/{bucket}")
    return _infer(shape, target, budget)


def backward_w_buffers(shape: Shape, tiles: FittedTiles, target: Target) -> int:
    """Two VMEM buffers for the backward's ``w`` and ``dw`` blocks where they fit the budget, else one."""
    double = cost_model.backward_bytes(shape, tiles.b, tiles.h, tiles.v, single_w=False)
    return 2 if double <= vmem_budget(target) else 1


def validate_explicit(block_sizes: BlockSizes, hp: int) -> None:
    """``ValueError`` (saying why) for explicit sizes the kernels can never use."""
    b, h, v = block_sizes.b_block_size, block_sizes.h_block_size, block_sizes.v_block_size
    if b is not None and b % SUBLANES:
        raise ValueError(
            f"pallas_tpu: BlockSizes.b_block_size={b} must be a multiple of {SUBLANES} "
            "(TPU sublanes: a token block is the second-minor dimension of its tiles)"
        )
    if v is not None and v % LANES:
        raise ValueError(
            f"pallas_tpu: BlockSizes.v_block_size={v} must be a multiple of {LANES} "
            "(TPU lanes: a vocab block is the minor dimension of the logit and w tiles)"
        )
    if h is not None and (h % LANES or hp % h):
        raise ValueError(
            f"pallas_tpu: BlockSizes.h_block_size={h} must be a multiple of {LANES} that divides the "
            f"hidden size padded to {LANES} (Hp={hp}): hidden blocks are contracted, so none may be ragged"
        )


def resolve_tiles(shape: Shape, target: Target, block_sizes: BlockSizes | None) -> Tiles:
    """Tiles for one problem: explicit sizes over the table over inference (see module docs)."""
    if block_sizes is None:
        return tuned_tiles(shape, target)
    validate_explicit(block_sizes, shape.hp)
    base = tuned_tiles(shape, target)
    b, h, v = block_sizes.b_block_size, block_sizes.h_block_size, block_sizes.v_block_size
    forward = _fit(
        shape,
        KernelTiles(b or base.forward.b, h if h is not None else base.forward.h, v or base.forward.v),
        backward=False,
    )
    backward = _fit(
        shape, KernelTiles(b or base.backward.b, h or base.backward.h, v or base.backward.v), backward=True
    )
    capacity = target.vmem_bytes
    need_forward = cost_model.forward_bytes(shape, forward.b, forward.h, forward.v)
    need_backward = cost_model.backward_bytes(shape, backward.b, backward.h, backward.v)
    if max(need_forward, need_backward) > vmem_limit(target):
        raise ValueError(
            f"pallas_tpu: {block_sizes} needs about {need_forward / 2**20:.1f} MiB (forward) and "
            f"{need_backward / 2**20:.1f} MiB (backward) of VMEM per core at N={shape.n}, Hp={shape.hp}, "
            f"V={shape.v}; {target.generation} has {capacity / 2**20:.0f} MiB (usable "
            f"{vmem_limit(target) / 2**20:.0f} MiB): use smaller blocks"
        )
    return Tiles(forward, backward, "explicit")


def table_rows() -> list[tuple[str, str, KernelTiles, KernelTiles]]:
    """The tuned table as rows ``(generation, bucket, forward, backward)`` (README and tests)."""
    return [(g, bucket, f, b) for (g, bucket), (f, b) in TUNED.items() if g in CHIP_FACTS]
