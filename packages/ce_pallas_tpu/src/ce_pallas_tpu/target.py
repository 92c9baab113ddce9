"""Which TPU the kernels are built for, and whether they run for real or in interpret mode.

Everything here is read at call time, never at import time, so a test (or a user preparing an
ahead-of-time compile) can set the environment after importing the package:

``CE_PALLAS_TPU_TARGET``
    ``v4``, ``v5e``, ``v5p``, ``v6e`` or ``tpu7x`` (``v5litepod``/``v6 lite``/``v7x`` spellings are
    accepted too). Sets
    the generation the block sizes are tuned for and the number of TensorCores the kernels split
    over. Needed for ahead-of-time compilation through libtpu's deviceless topologies, where the
    default device is the CPU. ``v4`` and ``v5p`` mean the megacore configuration (2 cores); make
    the v4 topology with ``chip_config_name="megacore"``.
``CE_PALLAS_TPU_INTERPRET``
    ``1`` runs the real kernels in Pallas' TPU interpret mode on any backend, with race detection,
    out-of-bounds reads raising, and as many simulated cores as the target has (the target defaults
    to v5p there, so the two-core split is exercised). ``plain`` runs them in Pallas' generic
    interpreter instead (``interpret=True``: no race detection, the grid run in order), which has no
    side effects and so runs inside ``jax.checkpoint``; it cannot run inside ``shard_map`` (it indexes
    per-device blocks with replicated values, which the varying-axes check refuses), so the backend
    refuses it there with ``UnsupportedError``.

Without either, the target is the device of the active abstract mesh when that is a TPU (inside
``jax.sharding.use_abstract_mesh`` over a deviceless topology's device, or a ``shard_map`` over TPU
devices), else the default device when it is a TPU. The number of TensorCores comes from that
device too when it has the target's generation (a v4 topology made without
``chip_config_name="megacore"`` has one core per device), else from the chip facts below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import jax

from ce_pallas_tpu.layout import cdiv

TARGET_ENV = "CE_PALLAS_TPU_TARGET"
INTERPRET_ENV = "CE_PALLAS_TPU_INTERPRET"

#: Generation used in interpret mode when no target is set: two cores, so the split is exercised.
INTERPRET_DEFAULT_GENERATION = "v5p"

_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ChipFacts:
    """What the block-size rules need to know about one TensorCore of a generation."""

    num_cores: int  # TensorCores a kernel can split over (megacore on v4/v5p)
    vmem_bytes: int  # VMEM per TensorCore
    hbm_bytes: int  # HBM of the whole chip
    bf16_flops: float  # per TensorCore
    hbm_bytes_per_s: float  # per TensorCore
    mxu_side: int = 128  # the MXUs are mxu_side x mxu_side systolic arrays
    #: Float32 ``[b, v]`` tiles of Mosaic's working set in the forward (``v``: one column chunk of the
    #: streamed step), fitted to libtpu's VMEM figures (:mod:`ce_pallas_tpu.cost_model`); TPU7x keeps
    #: about eight 256-column chunks live per token row where v6e keeps one or two.
    forward_work_tiles: float = 1.5
    #: The backward's work per logit beside its two products (``delta``: the exponential, the scale, the
    #: label's one), in MXU columns: a backward step over a hidden tile of ``t`` columns runs at about
    #: ``1 + delta_columns / t`` of its MXU time. Fitted to libtpu's static schedule of the kept backward:
    #: v6e 1.26 / 1.18 / 1.10 / 1.06 of the MXU minimum at tiles of 1536 / 2048 / 2304 / 4096 columns;
    #: v5e and v5p flat (1.03 and 1.06-1.10 from 896 to 8192 columns: nothing to fit); TPU7x's figures
    #: follow its token blocks instead (two tiles of Llama-3 8B's head at 256- and 512-row blocks: 1.54
    #: and 1.38; four at 1024: 1.21), not fitted. With ``delta`` formed once (:attr:`delta_over_logits`) v6e's
    #: two tiles still run 1.17: the per-tile cost is the tile's walk, not ``delta`` alone; the fit stands.
    delta_columns: float = 0.0
    #: Whether the kept backward in hidden tiles forms ``delta`` once and writes it over the kept logits
    #: for the later tiles (:attr:`ce_pallas_tpu.backward.BackwardConfig.delta_over_logits`). libtpu's
    #: static schedule, bf16, Llama-3 heads, backward over its MXU minimum without -> with: v6e 1.183 ->
    #: 1.134 (70B, four tiles), 1.179 -> 1.172 (8B, two); v5p 1.063 -> 1.054 (70B, four); v5e 1.032 -> 1.038
    #: (70B, two: its HBM, not its vector units, is what the split waits on); TPU7x 1.204 -> 1.233 (8B, four;
    #: 70B's 128-row blocks 2.008 -> 1.932, but its plans are 8B-like heads'). On where it gains.
    delta_over_logits: bool = False
    #: Whether the kept backward of an ``[H, V]`` head holds its chunk's ``x`` transposed
    #: (:attr:`ce_pallas_tpu.backward.BackwardConfig.x_transposed`). libtpu's static schedule, bf16, v6e,
    #: Llama-3 8B's head, backward over its MXU minimum without -> with: v6e (4096 tokens, two tiles) 1.199 ->
    #: 1.184 (a call of one chunk), 1.179 -> 1.163 (a chunk between others); v5p (512) 1.065 -> 1.059; v5e
    #: (2048) 1.031 -> 1.028, 56 us a chunk against the 41 us of its XLA transpose: left off there.
    kept_x_transposed: bool = False
    #: Whether the kept backward holds a narrow head's ``dx`` transposed where ``Hp`` is not a whole number of the
    #: MXU's side (:attr:`ce_pallas_tpu.backward.BackwardConfig.dx_transposed`). libtpu's static schedule, bf16, v6e,
    #: 4096-token chunks, backward over its MXU minimum (one chunk): Qwen2.5-0.5B (``Hp`` 896) 1.259 -> 1.196;
    #: Qwen3-0.6B (1024, where it pads nothing) 1.190 -> 1.203 with it, so only where ``Hp`` pads
    #: (docs/notes/2026-12-03-dx-transposed.md).
    kept_dx_transposed: bool = False
    #: Whether the kept backward holds a ``[V, H]`` head's ``dw`` (and its chunk's ``x``) transposed where ``Hp`` is
    #: not a whole number of the MXU's side (:attr:`ce_pallas_tpu.backward.BackwardConfig.kept_dw_transposed`).
    kept_dw_transposed: bool = False
    #: Whether the kept backward's first chunk (or only one) fills its ``dw`` slots with zeros by DMA
    #: (:attr:`ce_pallas_tpu.backward.BackwardConfig.dw_zeros_by_dma`) instead of a vector pass.
    kept_dw_zeros_by_dma: bool = False
    #: The kept backward of a ``[V, H]`` head adds the label's term by rows, not per logit
    #: (:attr:`ce_pallas_tpu.backward.BackwardConfig.label_rows`), where the schedule measured a gain. v6e, bf16,
    #: 4096-token chunks, backward over its MXU minimum (one chunk): Qwen2.5-0.5B 1.322 -> 1.240, Qwen3-0.6B
    #: 1.242 -> 1.171, Qwen2.5-1.5B 1.225 -> 1.164, Gemma-2 2B 1.122 -> 1.074 (docs/notes/2026-12-03-label-rows.md).
    #: v5e and v5p, whose narrow heads meet their goals, not measured: off.
    kept_label_rows: bool = False
    #: The kept backward of the RL objective's entropy terms takes the entropy's row cotangent into the exponent
    #: (:func:`ce_pallas_tpu.kept_logits.fold_entropy_cotangent`): one product a logit fewer. v6e, 4096-token
    #: chunks: Qwen3-0.6B 1.311 -> 1.257 of its MXU minimum, Qwen2.5-1.5B (2048 columns) 1.201 -> 1.167. v5e and
    #: v5p, whose RL steps meet their goals, not measured: off.
    kept_entropy_in_exponent: bool = False
    #: The kept path of bf16 inputs keeps its logits in bf16 below their lanes' maxima
    #: (:attr:`ce_pallas_tpu.forward.ForwardConfig.kept_bf16`) where ``Hp`` is too narrow for float32 writes to
    #: hide under the forward's matmuls (``Hp < 2 flops_per_byte``) and the backward takes the hidden size whole.
    #: Measured on v6e (docs/notes/2026-12-03-kept-logits-bf16.md); a wide head's forward hides its float32
    #: writes already and pays for the maxima (v6e, Llama-3 8B: 1.859 -> 1.902 ms a chunk), so the width rule.
    kept_logits_bf16: bool = False

    @property
    def flops_per_byte(self) -> float:
        """Arithmetic intensity a kernel needs to be compute-bound (the roofline ridge)."""
        return self.bf16_flops / self.hbm_bytes_per_s


#: Per-core facts of the generations with tuned block sizes (from Google's published chip specs,
#: the same numbers as ``jax._src.tpu_info``). ``default`` is a conservative chip for unknown TPUs.
CHIP_FACTS: dict[str, ChipFacts] = {
    "v4": ChipFacts(2, 16 * _MIB, 32 * 1024 * _MIB, 137.5e12, 0.615e12),
    "v5e": ChipFacts(1, 128 * _MIB, 16 * 1024 * _MIB, 197e12, 0.82e12),
    "v5p": ChipFacts(2, 64 * _MIB, 95 * 1024 * _MIB, 229.5e12, 1.38e12, delta_over_logits=True,
                     kept_x_transposed=True),
    "v6e": ChipFacts(1, 128 * _MIB, 32 * 1024 * _MIB, 918e12, 1.64e12, mxu_side=256, delta_columns=320.0,
                     delta_over_logits=True, kept_x_transposed=True, kept_dw_zeros_by_dma=True,
                     kept_label_rows=True, kept_entropy_in_exponent=True, kept_logits_bf16=True,
                     kept_dx_transposed=True, kept_dw_transposed=True),
    # TPU7x (Ironwood): each TensorCore is a device of its own, with 64 MiB of VMEM and half the chip's HBM.
    "tpu7x": ChipFacts(1, 64 * _MIB, 96 * 1024 * _MIB, 1155e12, 3.7e12, mxu_side=256, forward_work_tiles=8.0),
    "default": ChipFacts(1, 16 * _MIB, 16 * 1024 * _MIB, 200e12, 0.8e12),
}

_ALIASES = {
    "v4": "v4",
    "tpu v4": "v4",
    "v5e": "v5e",
    "v5 lite": "v5e",
    "v5litepod": "v5e",
    "tpu v5 lite": "v5e",
    "tpu v5e": "v5e",
    "v5p": "v5p",
    "v5": "v5p",
    "tpu v5": "v5p",
    "tpu v5p": "v5p",
    "v6e": "v6e",
    "v6 lite": "v6e",
    "tpu v6 lite": "v6e",
    "tpu v6e": "v6e",
    "tpu7x": "tpu7x",
    "tpu 7x": "tpu7x",
    "v7x": "tpu7x",
    "tpu v7x": "tpu7x",
}


@dataclasses.dataclass(frozen=True)
class Target:
    """The TPU the kernels are built for (hashable: part of the jit-static kernel config)."""

    generation: str  # a key of CHIP_FACTS
    num_cores: int
    interpret: str | None  # None (compile for the TPU), "tpu" or "plain" (see interpret_mode)

    @property
    def facts(self) -> ChipFacts:
        return CHIP_FACTS[self.generation]

    @property
    def vmem_bytes(self) -> int:
        return self.facts.vmem_bytes


def normalize_generation(name: str) -> str:
    """``"v5p"`` for ``"TPU v5"``, ``"v5p"``, ...; ``"default"`` for a TPU without tuned sizes."""
    key = name.strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    return "default"


#: ``CE_PALLAS_TPU_INTERPRET`` values that select the TPU interpreter, and the generic one.
_TPU_INTERPRETER = ("1", "true", "yes", "on")
_PLAIN_INTERPRETER = ("plain",)


def interpret_mode() -> str | None:
    """``"tpu"``, ``"plain"`` or ``None``: which interpreter ``CE_PALLAS_TPU_INTERPRET`` asks for (read now).

    Raises:
      ValueError: the variable holds anything else (a typo would otherwise compile for a real TPU).
    """
    value = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    if value in _TPU_INTERPRETER:
        return "tpu"
    if value in _PLAIN_INTERPRETER:
        return "plain"
    raise ValueError(f"{INTERPRET_ENV}={value!r}: use 1 (the TPU interpreter, race-checked), plain, or 0")


def interpret_requested() -> bool:
    """Whether ``CE_PALLAS_TPU_INTERPRET`` asks for either interpreter (read now)."""
    return interpret_mode() is not None


def target_requested() -> str | None:
    """The raw ``CE_PALLAS_TPU_TARGET`` value, or None when unset or empty (read now)."""
    value = os.environ.get(TARGET_ENV, "").strip()
    return value or None


def default_device_is_tpu() -> bool:
    try:
        return jax.default_backend() == "tpu"
    except RuntimeError:  # no backend could be initialised at all
        return False


def _tpu_device_facts() -> tuple[str, int] | None:
    """``(generation, cores)`` of the abstract mesh's TPU device, else of a TPU default device."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.platform == "tpu":
        return normalize_generation(abstract.device_kind), int(abstract.num_cores or 1)
    if default_device_is_tpu():
        device = jax.devices()[0]
        return normalize_generation(device.device_kind), int(getattr(device, "num_cores", 1) or 1)
    return None


def current_target() -> Target:
    """The target for a call made now (see the module docstring for the order of precedence).

    Raises:
      ValueError: ``CE_PALLAS_TPU_TARGET`` names an unknown generation, or interpret mode is on while
        the call is compiled for a TPU that is not attached (a deviceless topology's device).
      RuntimeError: no TPU, no target and no interpret mode (callers check availability first).
    """
    interpret = interpret_mode()
    requested = target_requested()
    device = _tpu_device_facts()
    if interpret and device is not None and not default_device_is_tpu():
        raise ValueError(
            f"{INTERPRET_ENV}={os.environ.get(INTERPRET_ENV)!r} while compiling for a TPU that is not attached "
            "(a deviceless topology): the interpreter runs kernels on the host and cannot be compiled ahead of "
            f"time for a TPU (libtpu crashes on it). Unset {INTERPRET_ENV} to compile the real kernels."
        )
    if requested is not None:
        generation = normalize_generation(requested)
        if generation == "default" and requested.lower() != "default":
            raise ValueError(
                f"{TARGET_ENV}={requested!r} is not a known TPU generation; use one of "
                f"{sorted(g for g in CHIP_FACTS if g != 'default')} (or 'default')"
            )
    elif device is not None:
        generation = device[0]
    elif interpret:
        generation = INTERPRET_DEFAULT_GENERATION
    else:
        raise RuntimeError(
            f"pallas_tpu needs a TPU default device, {TARGET_ENV}=<generation> or {INTERPRET_ENV}=1"
        )
    if device is not None and device[0] == generation and not interpret:
        num_cores = device[1]
    else:
        num_cores = CHIP_FACTS[generation].num_cores
    return Target(generation, num_cores, interpret)


def active_cores(num_cores: int, num_blocks: int) -> int:
    """Cores to split ``num_blocks`` contiguous vocab blocks over so that none is left without any."""
    cores = max(1, min(num_cores, num_blocks))
    while cores > 1 and (cores - 1) * cdiv(num_blocks, cores) >= num_blocks:
        cores -= 1
    return cores


def is_available() -> bool:
    """A TPU default device, interpret mode or an explicit target (read now)."""
    return interpret_requested() or target_requested() is not None or default_device_is_tpu()


def interpret_params(target: Target):
    """``pltpu.InterpretParams`` for the TPU interpreter, ``True`` for the plain one, or ``False`` to compile."""
    if target.interpret is None:
        return False
    if target.interpret == "plain":
        return True
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        detect_races=True,
        out_of_bounds_reads="raise",
        num_cores_or_threads=target.num_cores,
    )


@contextlib.contextmanager
def targeting(generation: str | None) -> Iterator[None]:
    """``CE_PALLAS_TPU_TARGET=generation`` inside the block, the previous value after (``None``: unchanged).

    For compiling ahead of time for a generation the running machine does not have.
    """
    if generation is None:
        yield
        return
    previous = os.environ.get(TARGET_ENV)
    os.environ[TARGET_ENV] = generation
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(TARGET_ENV, None)
        else:
            os.environ[TARGET_ENV] = previous
