"""The static schedule of a whole training step: ``value_and_grad`` of a scalar mean loss, every op.

A TPU program runs its ops one after another, so the step's estimate is the sum over its compiled ops
of libtpu's ``estimated_cycles`` (``--xla_jf_dump_static_llo_profile_to``), each op walked once by the
profiler: an op inside a ``while`` body counts ``trip count`` times (read from the HLO's
``known_trip_count``). Walking a full-size step takes too long and too much host memory (the
materialised baseline needs more than 15 GB at 8192 tokens), so the step is compiled at a few small
token counts ``N`` with the full ``H`` and ``V``, and the sum is fitted linearly in ``N`` and
extrapolated (:func:`linear_fit`). The head is ``[H, V]``, or with ``w_layout="vh"`` a tied ``[V, H]`` embedding
(the materialised loss then over ``x @ w.T``, as a user writes it). The paths (:data:`STEP_PATHS`):

- ``recompute``: ``ce_core.linear_cross_entropy(..., implementation="pallas_tpu")`` today: its two
  kernels come from the grid fit of :func:`ce_pallas_tpu.tooling.schedule.measure` at full size; the
  step's compile gives the XLA ops between and around them (merging the per-core statistics, the
  cotangents, summing the dx partials, casts), extrapolated.
- ``materialised``: what a user writes without the library, ``optax.softmax_cross_entropy_with_integer_labels``
  over ``jnp.dot(x, w, preferred_element_type=jnp.float32)`` (the same math in ``jnp`` where optax is
  missing): every op, extrapolated.
- ``materialised_rl``: the RL objective as a user writes it over the same materialised logits: GRPO's clipped
  ratio with an entropy bonus (``ce_core.policy.PolicyLoss(entropy_coefficient=0.01)``), the label's
  log-probability and the entropy from ``jax.nn.log_softmax`` of the logits (:func:`_materialised_rl`).
- ``keep_logits``: ``linear_cross_entropy(..., keep_logits=True)`` (its kernels run in an XLA loop over
  token chunks): every op of the small-N compile, kernels included, loop bodies times their trip
  count, extrapolated. Skipped where ``ce_core`` has no such option.

libtpu's profiler aborts the process on a few ops (a ``reduce`` fed by a ``dma-general``: the sum of
the per-core dx partials on v5p). Such an op, and any other op the abort left without a profile,
is estimated from its HBM bytes (operands and result) at the core's bandwidth, and the record names
it (``estimated_ops``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS
from ce_pallas_tpu.tooling.schedule.dumps import _OPERANDS_IN_HBM as OPERANDS_IN_HBM

#: Whole-step paths; each builds ``loss(x, labels, w) -> scalar`` (see :func:`step_loss`).
STEP_PATHS = ("recompute", "materialised", "keep_logits", "materialised_rl")
#: Paths whose pallas kernels are timed by the existing grid fit at full size (their XLA ops come from the step):
#: the recompute kernels over all N; the kept-logits kernels at one chunk of its plan, times the chunks
#: (:func:`loop_plan`). The small compiles' own kernels are not counted for them (on v5p the profiler aborts
#: on an XLA op of the step before the kernels are walked).
KERNELS_FROM_FIT = {"recompute": ("forward", "backward"), "keep_logits": ("forward", "backward")}
#: Default token counts the step is compiled at, per path (the fit needs two; a third checks it).
DEFAULT_STEP_TOKENS: dict[str, tuple[int, ...]] = {
    "recompute": (512, 1024),
    "materialised": (256, 512),
    "materialised_rl": (256, 512),
    "keep_logits": (1024, 2048),
}

#: Opcodes that emit no code of their own (no profile is written for them).
_NO_CODE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done",
})
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "bf16": 16, "f16": 16, "s32": 32, "u32": 32,
         "f32": 32, "s64": 64, "u64": 64, "f64": 64, "s4": 4, "u4": 4, "f8e4m3fn": 8, "f8e5m2": 8}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_OP_LINE = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>.+?)\s+(?P<opcode>[a-z][a-z0-9-]*)\("
                      r"(?P<operands>[^)]*)\)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%[^\s,]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CYCLES = re.compile(r"estimated_cycles:\s*(\d+)")
_EQUIVALENTS = re.compile(r"num_equivalent_hlos:\s*(\d+)")
_HLO_NAME = re.compile(r'hlo_op_name:\s*"([^"]*)"')
#: The line of an absl FATAL log naming the op the profiler could not walk.
_PROFILE_FAILED = re.compile(r"Static LLO profiling of (\S+) failed: (.*)")


class StepPathUnavailableError(RuntimeError):
    """The path cannot be built here (``keep_logits`` before ce_core has it, ``optax`` missing is handled)."""


# --------------------------------------------------------------------------------------------- profiles

@dataclasses.dataclass(frozen=True)
class OpProfile:
    """One ``*_static_llo_profile.textproto``: an op's estimated cycles, walked once, and how many ops of
    the program are equivalent to it (libtpu writes one file for them all)."""

    name: str
    cycles: int
    equivalents: int = 1


def read_op_profiles(profile_dir: Path) -> list[OpProfile]:
    """Every op profile libtpu wrote under ``profile_dir``."""
    profiles = []
    for path in sorted(profile_dir.glob("*_static_llo_profile.textproto")):
        text = path.read_text()
        cycles, name = _CYCLES.search(text), _HLO_NAME.search(text)
        if cycles is None:
            continue
        equivalents = _EQUIVALENTS.search(text)
        profiles.append(OpProfile(name.group(1) if name else path.name.split("_static_llo_profile")[0],
                                  int(cycles.group(1)), int(equivalents.group(1)) if equivalents else 1))
    return profiles


# --------------------------------------------------------------------------------------------- HLO

@dataclasses.dataclass(frozen=True)
class HloOp:
    name: str
    opcode: str
    type: str  # the result type as printed (layouts included)
    operands: tuple[str, ...]
    computation: str
    is_kernel: bool  # a Pallas kernel (``custom-call`` to ``tpu_custom_call``)
    flops: int = 0  # a ``convolution`` or ``dot``: 2 * result elements * contracted size
    called: tuple[str, ...] = ()  # the computations a fusion calls

    @property
    def emits_code(self) -> bool:
        """An op that gets a profile: not bookkeeping, and not a scalar (scalar ops run inline)."""
        if self.opcode in _NO_CODE:
            return False
        return any(dims for _, dims in _ARRAY.findall(_strip_layouts(self.type)))


def _strip_layouts(type_text: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", type_text)


def type_bytes(type_text: str) -> int:
    """Bytes of an HLO type (a tuple's elements added)."""
    total = 0
    for dtype, dims in _ARRAY.findall(_strip_layouts(type_text)):
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += count * _BITS.get(dtype, 32) // 8
    return total


@dataclasses.dataclass
class HloModule:
    """The ops of a compiled module by name, and how many times each runs per step (while loops)."""

    ops: dict[str, HloOp]
    runs: dict[str, int]  # op name -> times it runs (product of the trip counts of its enclosing loops)
    members: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # computation -> its ops

    def flops(self, op: HloOp) -> int:
        """The matmul flops of ``op``: its own, or those of the computations a fusion calls."""
        return op.flops + sum(self.ops[name].flops for called in op.called for name in self.members.get(called, []))


def _dims(type_text: str) -> list[int]:
    arrays = _ARRAY.findall(_strip_layouts(type_text))
    return [int(d) for d in arrays[0][1].split(",") if d] if arrays else []


def _matmul_flops(opcode: str, line: str, type_text: str, operands: tuple[str, ...], ops: dict[str, HloOp]) -> int:
    """``2 * result elements * contracted size`` of a ``convolution`` (``dim_labels``) or ``dot``."""
    if opcode not in ("convolution", "dot") or not operands or operands[0] not in ops:
        return 0
    lhs = _dims(ops[operands[0]].type)
    contracted = 1
    if opcode == "convolution":
        labels = re.search(r"dim_labels=([a-z0-9]+)_", line)
        if labels is None or "f" not in labels.group(1) or len(lhs) != len(labels.group(1)):
            return 0
        contracted = lhs[labels.group(1).index("f")]
    else:
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        for d in (dims.group(1).split(",") if dims and dims.group(1) else []):
            contracted *= lhs[int(d)]
    return 2 * math.prod(_dims(type_text)) * contracted


def parse_hlo(text: str) -> HloModule:
    """The ops of ``compiled.as_text()`` and their run counts: an op in a ``while`` body runs the loop's
    ``known_trip_count`` times (a loop without one counts once, and ``unknown_trip_counts`` names it)."""
    ops: dict[str, HloOp] = {}
    members: dict[str, list[str]] = {}
    calls: dict[str, list[tuple[str, int]]] = {}  # computation -> (called computation, times per run)
    entry = current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group("name")
            members.setdefault(current, [])
            if line.startswith("ENTRY"):
                entry = current
            continue
        match = _OP_LINE.match(line)
        if match is None or current is None:
            continue
        operands = tuple(re.findall(r"%([^\s,)]+)", match.group("operands")))
        opcode = match.group("opcode")
        called = [re.findall(r"%([^\s,}]+)", m.group(1)) for m in re.finditer(r"\bcalls=(\{[^}]*\}|%[^\s,]+)", line)]
        op = HloOp(match.group("name"), opcode, match.group("type"), operands, current,
                   'custom_call_target="tpu_custom_call"' in line,
                   _matmul_flops(opcode, line, match.group("type"), operands, ops),
                   tuple(name for names in called for name in names) if opcode == "fusion" else ())
        ops[op.name] = op
        members[current].append(op.name)
        if op.opcode == "fusion":
            continue  # a fusion's computation is its own body, profiled as the fusion
        trip = _TRIP.search(line)
        for kind, called in _CALLED.findall(line):
            names = re.findall(r"%?([^\s{},%]+)", called)
            times = int(trip.group(1)) if (op.opcode == "while" and kind == "body" and trip) else 1
            if op.opcode == "while" and kind == "condition" and trip:
                times = int(trip.group(1)) + 1
            calls.setdefault(current, []).extend((name, times) for name in names)
    runs: dict[str, int] = {}
    if entry is None:
        return HloModule(ops, runs, members)
    stack = [(entry, 1)]
    seen: dict[str, int] = {}
    while stack:
        computation, times = stack.pop()
        seen[computation] = seen.get(computation, 0) + times
        for name in members.get(computation, []):
            runs[name] = runs.get(name, 0) + times
        for called, factor in calls.get(computation, []):
            stack.append((called, times * factor))
    return HloModule(ops, runs, members)


def unknown_trip_counts(text: str) -> list[str]:
    """The ``while`` ops of ``text`` whose trip count XLA does not know (counted once)."""
    return [m.group("name") for line in text.splitlines() if (m := _OP_LINE.match(line))
            and m.group("opcode") == "while" and not _TRIP.search(line)]


# --------------------------------------------------------------------------------------------- one compile

@dataclasses.dataclass
class StepOps:
    """The ops of one compiled step at one token count: cycles summed with their run counts."""

    n: int
    kernel_cycles: float = 0.0  # the Pallas kernels' profiles (walked at this N)
    xla_cycles: float = 0.0  # every other op: profiled, or estimated from its HBM bytes
    estimated_cycles: float = 0.0  # the part of xla_cycles estimated from HBM bytes
    estimated_ops: list[str] = dataclasses.field(default_factory=list)
    ops: int = 0  # ops counted (with their equivalents)
    unprofiled_kernels: list[str] = dataclasses.field(default_factory=list)  # kernels the abort left without a profile
    abort: str | None = None  # the profiler's abort message, if it aborted


def hbm_cycles(op: HloOp, module: HloModule, generation: str) -> float:
    """An op's operands and result at the core's HBM bandwidth, in cycles."""
    chip = SCHEDULE_CHIPS[generation]
    nbytes = type_bytes(op.type) + sum(type_bytes(module.ops[name].type) for name in op.operands if name in module.ops)
    return nbytes / chip.hbm_bytes_per_s * chip.clock_hz


def unprofiled_cycles(op: HloOp, module: HloModule, generation: str, cores: int = 1, floor: float = 0.0) -> float:
    """The estimate of an op without a profile: the longest of its HBM bytes at the core's bandwidth, its
    matmul flops at the peak of ``cores`` TensorCores (XLA splits a large matmul over a megacore's two),
    and ``floor`` (the cheapest profiled op of the program: what any op costs at least)."""
    chip = SCHEDULE_CHIPS[generation]
    mxu = module.flops(op) / (chip.bf16_flops * cores) * chip.clock_hz
    return max(hbm_cycles(op, module, generation), mxu, floor)


def _cover(module: HloModule, profiles: Sequence[OpProfile]) -> tuple[list[tuple[HloOp, int]], list[HloOp]]:
    """``(profiled, missing)``: each op with the cycles of its profile (its own, or that of an equivalent
    op: same opcode and type, libtpu writes one file for them all), and the ops the program runs that emit
    code and have none."""
    profiled: list[tuple[HloOp, int]] = []
    covered: set[str] = set()
    for profile in profiles:
        op = module.ops.get(profile.name)
        if op is None:
            op = HloOp(profile.name, "unknown", "", (), "", "ce_pallas_tpu" in profile.name)
        covered.add(op.name)
        profiled.append((op, profile.cycles))
    # Only ops of computations the program runs (not those inside a fusion's computation).
    missing = [op for op in module.ops.values() if op.emits_code and op.name not in covered and op.name in module.runs]
    for profile in profiles:
        op = module.ops.get(profile.name)
        for _ in range(profile.equivalents - 1):
            twin = next((m for m in missing if op is not None and m.opcode == op.opcode and m.type == op.type), None)
            if twin is None:
                break
            missing.remove(twin)
            profiled.append((twin, profile.cycles))
    return profiled, missing


def sum_step(n: int, generation: str, hlo_text: str, profiles: Sequence[OpProfile],
             abort: str | None = None, cores: int = 1) -> StepOps:
    """The cycles of a step's ops: each profile times its op's run count (and those of its equivalents:
    ops with no profile of their own, the same opcode and type), the rest by :func:`unprofiled_cycles`."""
    module = parse_hlo(hlo_text)
    result = StepOps(n, abort=abort)

    def add(op: HloOp, cycles: float, estimated: bool = False) -> None:
        times = module.runs.get(op.name, 1)
        result.ops += 1
        if op.is_kernel:
            result.kernel_cycles += cycles * times
            return
        result.xla_cycles += cycles * times
        if estimated:
            result.estimated_cycles += cycles * times
            result.estimated_ops.append(op.name if times == 1 else f"{op.name} x{times}")

    profiled, missing = _cover(module, profiles)
    for op, cycles in profiled:
        add(op, cycles)
    floor = min((cycles for op, cycles in profiled if not op.is_kernel), default=0.0)
    for op in missing:
        add(op, unprofiled_cycles(op, module, generation, cores, floor), estimated=not op.is_kernel)
        if op.is_kernel:
            result.unprofiled_kernels.append(op.name)
    return result


# --------------------------------------------------------------------------------------------- extrapolation

@dataclasses.dataclass(frozen=True)
class LinearFit:
    """``value(N) = intercept + slope * N`` through the two largest token counts; the smaller ones check it.

    The two largest, not a least-squares line: at small N a step's matmuls are bound by reading ``w``
    (a cost that does not grow with N) and only become MXU-bound past the chip's ridge (about 170
    tokens on v5p, 240 on v5e, 560 on v6e for bf16 ``w``), so the largest points are the most linear.
    """

    intercept: float
    slope: float
    max_residual: float  # largest |fit - point| / point over the smaller points (0 with two points)

    @classmethod
    def of(cls, points: dict[int, float]) -> LinearFit:
        if not points:
            raise ValueError("no points to fit")
        xs = sorted(points)
        if len(xs) == 1:
            return cls(0.0, points[xs[0]] / xs[0], 0.0)  # proportional to N
        (x0, y0), (x1, y1) = ((x, points[x]) for x in xs[-2:])
        slope = (y1 - y0) / (x1 - x0)
        intercept = y0 - slope * x0
        residual = max((abs(intercept + slope * x - points[x]) / points[x] if points[x] else 0.0) for x in xs)
        return cls(intercept, slope, residual)

    def at(self, n: float) -> float:
        return self.intercept + self.slope * n


def linear_fit(points: dict[int, float]) -> LinearFit:
    """Fit ``points`` (token count -> cycles) linearly in the token count."""
    return LinearFit.of(points)


# --------------------------------------------------------------------------------------------- the paths

def _recompute(x: Any, labels: Any, w: Any, w_layout: str = "hv") -> Any:
    import ce_core

    return ce_core.linear_cross_entropy(x, labels, w, implementation="pallas_tpu", w_layout=w_layout)


def _keep_logits(x: Any, labels: Any, w: Any, w_layout: str = "hv") -> Any:
    import ce_core

    return ce_core.linear_cross_entropy(x, labels, w, implementation="pallas_tpu", keep_logits=True,
                                        w_layout=w_layout)


def _materialised(x: Any, labels: Any, w: Any, w_layout: str = "hv") -> Any:
    import jax.numpy as jnp

    # A tied [V, H] head as a user writes it: the product with the embedding's transpose (XLA contracts in place).
    logits = jnp.dot(x, w.T if w_layout == "vh" else w, preferred_element_type=jnp.float32)
    try:
        import optax
    except ImportError:  # the same math: logsumexp minus the label's logit
        import jax

        label_logit = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return (jax.nn.logsumexp(logits, axis=-1) - label_logit).mean()
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


#: The entropy bonus's weight in the RL baseline (:func:`_materialised_rl`).
RL_ENTROPY_COEFFICIENT = 0.01


def _materialised_rl(x: Any, labels: Any, w: Any, w_layout: str = "hv") -> Any:
    """GRPO's token loss with an entropy bonus over materialised float32 logits, the token mean: what a user writes
    without the library (``log_softmax``, the label's log-probability, ``-sum p log p``), fed to the same token
    function as the fused objective (``ce_core.policy.PolicyLoss``). On-policy, as a GRPO step's first update: the
    sampler's log-probabilities are the current ones, detached; advantages +-1 by token (per-token arrays cost the
    same whatever their values)."""
    import jax
    import jax.numpy as jnp

    from ce_core.policy import PolicyInputs, PolicyLoss

    logits = jnp.dot(x, w.T if w_layout == "vh" else w, preferred_element_type=jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    inputs = PolicyInputs(old_logp=jax.lax.stop_gradient(logp), advantages=jnp.where(labels % 2 == 0, 1.0, -1.0),
                          weights=jnp.full(labels.shape, 1.0 / labels.size, jnp.float32))
    return jnp.sum(PolicyLoss(entropy_coefficient=RL_ENTROPY_COEFFICIENT)(logp, entropy, inputs))


#: path -> ``loss(x, labels, w, w_layout)``: adding a path is one entry here (and in :data:`STEP_PATHS`).
LOSSES: dict[str, Callable[[Any, Any, Any, str], Any]] = {
    "recompute": _recompute,
    "materialised": _materialised,
    "keep_logits": _keep_logits,
    "materialised_rl": _materialised_rl,
}


def path_unavailable(path: str) -> str | None:
    """Why ``path`` cannot be built here (None: it can)."""
    if path not in LOSSES:
        return f"unknown path {path!r}: one of {sorted(LOSSES)}"
    if path == "keep_logits":
        import inspect

        import ce_core

        if not _accepts_option(ce_core.linear_cross_entropy, "keep_logits", inspect):
            return "ce_core.linear_cross_entropy has no keep_logits option yet"
    return None


def _accepts_option(fn: Callable[..., Any], name: str, inspect: Any) -> bool:
    """Whether ``fn`` takes ``name``: a parameter, or a key of the ``TypedDict`` its ``**options`` unpack."""
    import typing

    parameters = inspect.signature(fn).parameters
    if name in parameters:
        return True
    for parameter in parameters.values():
        if parameter.kind is not parameter.VAR_KEYWORD:
            continue
        try:
            hint = typing.get_type_hints(fn).get(parameter.name)
        except Exception:  # an annotation that does not resolve here: assume the option may be there
            return True
        options = typing.get_args(hint)[0] if typing.get_args(hint) else hint
        return name in typing.get_type_hints(options) if isinstance(options, type) else True
    return False


def loop_plan(path: str, generation: str, n: int, h: int, v: int,
              w_dtype: str = "bfloat16", w_layout: str = "hv") -> tuple[int, int, int] | None:
    """``(tokens per chunk, hidden tiles, rows of its longest backward piece or 0)`` of ``path``'s step at ``n``
    tokens on ``generation`` (None: the path has no token loop).

    The ``keep_logits`` path loops over the chunks its plan for the whole ``n`` takes (:func:`kept_plan`). Its
    ops are compiled at whole multiples of that chunk with the plan pinned to it (:func:`measure_step_ops`'s
    ``loop``), so that the profiled loop body (walked once, run ``trip count`` times) is the one the full-size
    step runs and the fit in ``N`` is exact at multiples of the chunk: left to itself, the plan at a few chunks'
    tokens may take other chunks (v6e, Llama-3 70B's head: 2048-token chunks at 16384 tokens, one chunk of
    4096 at 4096)."""
    if path != "keep_logits":
        return None
    plan = kept_plan(generation, n, h, v, w_dtype, w_layout)
    return plan.chunk, plan.backward.hidden_split, plan.pieces[0] if plan.pieces else 0


def kept_plan(generation: str, n: int, h: int, v: int, w_dtype: str = "bfloat16", w_layout: str = "hv") -> Any:
    """The ``keep_logits`` path's plan (:func:`ce_pallas_tpu.kept_logits.plan_chunks`, which weighs chunk counts,
    hidden tiles and backward pieces per ``n``) for the plain mean loss over an ``[H, V]`` head (``w_layout="vh"``:
    a ``[V, H]`` one), as :func:`step_program` builds it."""
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    target = Target(generation, CHIP_FACTS[generation].num_cores, None)
    return kept_logits.plan_chunks(n, h, v, jnp.dtype(w_dtype), jnp.dtype(w_dtype),
                                   StatsSpec(keep_logits=True, w_layout=w_layout), target)


def materialised_library() -> str:
    """What the materialised path's loss is written with here."""
    try:
        import optax
    except ImportError:
        return "jnp (logsumexp - take_along_axis; optax missing)"
    return f"optax {optax.__version__} softmax_cross_entropy_with_integer_labels"


def step_program(path: str, n: int, h: int, v: int, sharding: Any, dtype: str = "bfloat16",
                 w_layout: str = "hv") -> tuple[Any, tuple]:
    """``(fn, operands)``: ``jax.jit(fn).lower(*operands).compile()`` is the step of ``path`` (``w`` ``[H, V]``, or
    ``[V, H]`` with ``w_layout="vh"``)."""
    import jax
    import jax.numpy as jnp

    loss = LOSSES[path]
    operands = (jax.ShapeDtypeStruct((n, h), jnp.dtype(dtype), sharding=sharding),
                jax.ShapeDtypeStruct((v, h) if w_layout == "vh" else (h, v), jnp.dtype(dtype), sharding=sharding),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding))
    return jax.value_and_grad(lambda x, w, labels: loss(x, labels, w, w_layout), argnums=(0, 1)), operands


# --------------------------------------------------------------------------------------------- processes

def _child_env(profile_dir: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    # Without a profile directory: the same compile (operands kept in HBM), without the dumps.
    # (No executed-bundle traces: the op totals are all the step needs.)
    flags = OPERANDS_IN_HBM if profile_dir is None else (
        f"--xla_jf_dump_static_llo_profile_to={profile_dir} {OPERANDS_IN_HBM}")
    env["LIBTPU_INIT_ARGS"] = f"{env.get('LIBTPU_INIT_ARGS', '')} {flags}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.pop("CE_PALLAS_TPU_INTERPRET", None)
    return env


#: An LLO check failure names the op being lowered (``... in HLO [fusion.12]``).
_IN_HLO = re.compile(r"in HLO \[([^\]]+)\]")


def _compile_child(generation: str, path: str, n: int, h: int, v: int, dtype: str, root: Path,
                   profile_dir: Path | None, loop: tuple[int, int, int] | None = None,
                   w_layout: str = "hv") -> tuple[int, str | None, set[str], list[str]]:
    """Compile one step in a child process: ``(returncode, abort message, ops named by the abort, stderr tail)``."""
    pinned = [str(part) for part in loop] if loop else ["-", "-", "-"]
    command = [sys.executable, "-m", "ce_pallas_tpu.tooling.schedule.step", generation, path, str(n), str(h),
               str(v), dtype, w_layout, str(root / "step.hlo.txt"), *pinned]
    abort, failed_ops, tail = None, set(), []
    with subprocess.Popen(command, env=_child_env(profile_dir), stderr=subprocess.PIPE, text=True) as child:
        assert child.stderr is not None
        for line in child.stderr:
            failed = _PROFILE_FAILED.search(line)
            if failed:
                failed_ops.add(failed.group(1))
            if abort is None and (failed or "Check failed" in line):
                abort = line.strip()[-300:]
            if abort is not None and (named := _IN_HLO.search(line)):
                failed_ops.add(named.group(1))
            tail = [*tail, line.rstrip()][-8:]
    return child.returncode, abort, failed_ops, tail


#: Compiles with the profile flags per step and token count at most: libtpu profiles a program's ops in
#: parallel and an abort loses those not finished yet, so a compile that aborts is repeated until every op
#: but the ones it aborts on has a profile from some attempt (the compile is deterministic: same op names).
MAX_PROFILE_ATTEMPTS = 4


def measure_step_ops(generation: str, path: str, n: int, h: int, v: int, dtype: str = "bfloat16",
                     attempts: int = MAX_PROFILE_ATTEMPTS, loop: tuple[int, int, int] | None = None,
                     w_layout: str = "hv") -> StepOps:
    """Compile the step of ``path`` at ``n`` tokens for ``generation`` (its head in ``w_layout``) with the profile
    flags and sum its ops (:func:`sum_step`); ``loop`` pins the ``keep_logits`` path's ``(chunk, hidden tiles,
    longest piece)`` (:func:`loop_plan`). Where the profiler aborts, the HLO comes from a compile without the
    profile flags, the profiles of repeated attempts are pooled, and the ops still without one (those
    the profiler aborts on) are estimated from their HBM bytes."""
    with tempfile.TemporaryDirectory(prefix="ce-step-") as tmp:
        root = Path(tmp)
        hlo = root / "step.hlo.txt"
        profiles: dict[str, OpProfile] = {}
        aborts: list[str] = []
        failed_ops: set[str] = set()
        attempt = 0
        previous: set[str] = set()
        for attempt in range(attempts):
            profile_dir = root / f"profile{attempt}"
            profile_dir.mkdir()
            code, abort, failed, tail = _compile_child(generation, path, n, h, v, dtype, root, profile_dir, loop,
                                                       w_layout)
            for profile in read_op_profiles(profile_dir):
                profiles.setdefault(profile.name, profile)
            if abort is None and code == 0 and hlo.exists():
                break
            aborts.append(abort or f"exit {code}: {tail[-1] if tail else ''}"[:300])
            failed_ops |= failed
            if not hlo.exists():
                code2, abort2, _, tail2 = _compile_child(generation, path, n, h, v, dtype, root, None, loop, w_layout)
                if not hlo.exists():
                    lines = "\n".join(tail2)
                    raise RuntimeError(f"the {path} step at N={n} does not compile for {generation} "
                                       f"(exit {code2}): {abort2 or lines}")
            _, missing = _cover(parse_hlo(hlo.read_text()), list(profiles.values()))
            still = {op.name for op in missing}
            if still <= failed_ops or still == previous:  # done, or another attempt would not help
                break
            previous = still
        abort_text = None
        if aborts:
            names = ", ".join(sorted(failed_ops)) or "?"
            abort_text = f"aborted on {names} in {len(aborts)} of {attempt + 1} compiles: {aborts[0]}"[:400]
        return sum_step(n, generation, hlo.read_text(), list(profiles.values()), abort_text, _cores(generation))


def _cores(generation: str) -> int:
    """TensorCores that split an XLA matmul on ``generation`` (1 where the chip is not known)."""
    from ce_pallas_tpu.target import CHIP_FACTS

    return CHIP_FACTS[generation].num_cores if generation in CHIP_FACTS else 1


@dataclasses.dataclass(frozen=True)
class OpCycles:
    """One op of a compiled step: its profiled cycles (None where the profiler aborted on it), what
    :func:`sum_step` charges it without a profile (:func:`unprofiled_cycles`, no floor), and its matmul flops."""

    op: str
    profiled: int | None
    unprofiled: float
    flops: int


def measure_ops(generation: str, path: str, n: int, h: int, v: int, dtype: str = "bfloat16",
                w_layout: str = "hv") -> dict[str, OpCycles]:
    """Each op of the step of ``path`` at ``n`` tokens that emits code, by name (one compile with the profile flags;
    the HLO from a compile without them where that one aborts): for pricing an op the profiler cannot walk at one
    point (its compile killed for memory) from its profiles at smaller points."""
    with tempfile.TemporaryDirectory(prefix="ce-op-") as tmp:
        root = Path(tmp)
        profile_dir = root / "profile"
        profile_dir.mkdir()
        _compile_child(generation, path, n, h, v, dtype, root, profile_dir, None, w_layout)
        hlo = root / "step.hlo.txt"
        if not hlo.exists():
            _compile_child(generation, path, n, h, v, dtype, root, None, None, w_layout)
        if not hlo.exists():
            raise RuntimeError(f"the {path} step at N={n}, V={v} does not compile for {generation}")
        module = parse_hlo(hlo.read_text())
        profiled = {p.name: p.cycles for p in read_op_profiles(profile_dir)}
    cores = _cores(generation)
    return {op.name: OpCycles(op.name, profiled.get(op.name), unprofiled_cycles(op, module, generation, cores),
                              module.flops(op))
            for op in module.ops.values() if op.emits_code and op.name in module.runs and not op.is_kernel}


def _main(argv: list[str]) -> int:
    """Child process: compile one step for a deviceless TPU and write its HLO text."""
    generation, path, n, h, v, dtype, w_layout, out, chunk, split, piece = argv
    import jax

    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.tooling import aot

    if chunk != "-":  # the loop of the full-size step's plan (loop_plan); its pieces' backward takes H whole
        kept_logits.CHUNK_TOKENS, kept_logits.PIECE_TOKENS = int(chunk), int(piece) or None
        kept_logits.HIDDEN_SPLIT = None if int(piece) else int(split)

    with aot.compiling_for(generation) as device:
        fn, operands = step_program(path, int(n), int(h), int(v), jax.sharding.SingleDeviceSharding(device), dtype,
                                    w_layout)
        compiled = jax.jit(fn).lower(*operands).compile()
        Path(out).write_text(compiled.as_text() or "")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
