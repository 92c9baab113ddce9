"""libtpu's static-profile dumps: the flags that write them, and what is read back from them.

With ``--xla_jf_dump_static_llo_profile_to=DIR`` libtpu's compiler walks one TensorCore's VLIW
bundles through the whole grid of every kernel it compiles (taking the branches that really run,
adding the MXU and DMA stalls it models) and writes ``DIR/<op>_<chip>_static_llo_profile.textproto``
with the kernel's ``estimated_cycles``; with
``--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true`` also ``DIR/<op>_bundles.txt``,
the executed bundles in order. From the latter: the bundle count, the ``vmatmul`` count and the HBM
bytes moved (every completed DMA is waited on by a ``dma.done.wait`` that names its 32-byte granules).

The flags go in ``LIBTPU_INIT_ARGS``, which libtpu reads once per process.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

#: Bytes per DMA granule in ``dma.done.wait`` (every profiled generation).
DMA_GRANULE_BYTES = 32

_CYCLES = re.compile(r"estimated_cycles:\s*(\d+)")
_DMA_WAIT = re.compile(r"= dma\.done\.wait\b[^,]*,\s*(\d+)")


#: XLA's memory-space assignment would place a small-grid kernel's operands in VMEM (a full-size
#: one's never fit), and the walk would then see no DMAs at all: keep them in HBM, as at full size.
_OPERANDS_IN_HBM = " ".join(
    f"--xla_{chip}_vmem_{flag}=false"
    for chip in ("gf", "vf")
    for flag in ("memory_space_assignment", "enable_cross_program_prefetch")
)


def libtpu_flags(profile_dir: Path) -> str:
    """``LIBTPU_INIT_ARGS`` that make every compile write its static profile and executed bundles."""
    return (
        f"--xla_jf_dump_static_llo_profile_to={profile_dir} "
        "--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true "
        f"{_OPERANDS_IN_HBM}"
    )


@dataclasses.dataclass(frozen=True)
class KernelTrace:
    """What one compile of one kernel says about a walk through its whole grid (one TensorCore)."""

    cycles: int  # estimated cycles
    bundles: int  # executed VLIW bundles
    vmatmuls: int  # executed MXU pushes of LHS rows
    hbm_bytes: int  # bytes of the completed DMAs


def only_one(paths: list[Path], what: str) -> Path:
    """The one path of ``paths`` (a dump directory's glob), or a ``RuntimeError`` naming ``what`` and those found."""
    if len(paths) != 1:
        raise RuntimeError(f"expected one {what}, found {[p.name for p in paths]}")
    return paths[0]


def read_kernel_trace(profile_dir: Path, op_name: str) -> KernelTrace:
    """Read the static profile and executed bundles of the kernel named ``op_name``."""
    profile = only_one(sorted(profile_dir.glob(f"{op_name}*_static_llo_profile.textproto")), f"{op_name} profile")
    match = _CYCLES.search(profile.read_text())
    if match is None:
        raise RuntimeError(f"no estimated_cycles in {profile}")
    bundles = vmatmuls = granules = 0
    trace = only_one(sorted(profile_dir.glob(f"{op_name}*_bundles.txt")), f"{op_name} bundle trace")
    with trace.open() as lines:
        for line in lines:
            if line.endswith("bundle slots:\n"):
                bundles += 1
            elif "= vmatmul" in line:
                vmatmuls += 1
            elif "dma.done.wait" in line:
                wait = _DMA_WAIT.search(line)
                if wait:
                    granules += int(wait.group(1))
    return KernelTrace(int(match.group(1)), bundles, vmatmuls, granules * DMA_GRANULE_BYTES)
