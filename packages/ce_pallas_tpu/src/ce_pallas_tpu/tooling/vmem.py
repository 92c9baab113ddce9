"""libtpu's own figure for the scoped VMEM a kernel uses: what the cost model is fitted to and checked against.

A compiled TPU program records, on each Mosaic custom call, the scoped VMEM the kernel was given
(``scoped_memory_configs``: the ``vmem_limit_bytes`` we pass) and the VMEM it actually uses
(``used_scoped_memory_configs``: every pipelined block, the scratch, and Mosaic's own working set for
the elementwise code). One deviceless compile of the kernel alone at full size gives that figure
exactly. The kernel is compiled with the core's whole VMEM as its limit (Mosaic takes a little more
working room where it is allowed more, so this errs on the large side of what the backend's own limit
gives); a compile that needs more than the core has says how much (``Used 143.23M of 127.94M vmem``).

Needs ``libtpu`` (the ``[tpu]`` extra), like :mod:`ce_pallas_tpu.tooling.aot`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ce_pallas_tpu.target import CHIP_FACTS
from ce_pallas_tpu.tile_types import KernelTiles

#: The used scoped VMEM of a Mosaic call in the compiled HLO (memory space 1 is VMEM).
_USED = re.compile(r'custom_call_target="tpu_custom_call".*?"used_scoped_memory_configs":\[\{"memory_space":"1",'
                   r'"offset":"\d+","size":"(\d+)"')
#: A compile that ran out of VMEM: how much the kernel needed.
_NEEDED = re.compile(r"Used ([\d.]+)([KMG]) of [\d.]+[KMG] vmem")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


class OutOfVmem(RuntimeError):
    """The kernel does not fit the core's VMEM, and libtpu's error gives no figure for what it needs (an
    operand's window alone exceeds the core: ``Allocation (size=...) would exceed memory``)."""


@dataclasses.dataclass(frozen=True)
class VmemUse:
    """libtpu's figure for one kernel at one choice of tiles: ``used`` bytes, and whether it fits the core."""

    used: int
    fits: bool


def used_scoped_vmem(hlo_text: str) -> int:
    """The most scoped VMEM any Mosaic call of a compiled program uses (its ``as_text()``), in bytes.

    Raises:
      ValueError: the program has no Mosaic call that reports it.
    """
    sizes = [int(match.group(1)) for match in _USED.finditer(hlo_text)]
    if not sizes:
        raise ValueError("the compiled program reports no scoped VMEM for a Mosaic call")
    return max(sizes)


def needed_vmem(error: str) -> int | None:
    """The VMEM a kernel that ran out of it needed, from libtpu's error (None: not such an error)."""
    match = _NEEDED.search(error)
    return None if match is None else round(float(match.group(1)) * _UNITS[match.group(2)])


def model_vmem(generation: str, kernel: str, n: int, hidden: int, v: int, tiles: KernelTiles[int | None], *,
               dtype: str = "bfloat16", spec: Any = None) -> int:
    """The cost model's VMEM for the kernel :func:`kernel_vmem` compiles (same arguments), in bytes."""
    from ce_core import StatsSpec
    from ce_pallas_tpu import cost_model
    from ce_pallas_tpu.layout import round_up

    spec = spec or StatsSpec()
    itemsize = 4 if dtype == "float32" else 2
    shape = cost_model.Shape(n, round_up(hidden, 128), v, itemsize, itemsize, with_sum=spec.with_sum,
                             capped=spec.logit_soft_cap is not None, with_expected=spec.with_expected,
                             with_argmax=spec.with_argmax)
    if kernel == "forward":
        block_h = shape.hp if tiles.block_h is None else tiles.block_h
        return cost_model.forward_bytes(shape, tiles.block_b, block_h, tiles.block_v, chip=CHIP_FACTS[generation])
    if tiles.block_h is None:
        raise ValueError("a backward's tiles name its hidden chunk (block_h)")
    return cost_model.backward_bytes(shape, tiles.block_b, tiles.block_h, tiles.block_v,
                                     single_w=tiles.w_buffers != 2)


def kernel_vmem(generation: str, kernel: str, n: int, hidden: int, v: int, tiles: KernelTiles[int | None], *,
                dtype: str = "bfloat16", spec: Any = None) -> VmemUse:
    """libtpu's figure for one kernel (``"forward"`` or ``"backward"``) alone at ``N x hidden x V`` with
    ``tiles`` (and the backward's ``w_buffers``), ``x`` and ``w`` both of ``dtype``, statistics ``spec``
    (a ``ce_core.StatsSpec``; default: the plain loss), compiled for ``generation`` with the backend's
    whole VMEM as its limit (see module docs).

    Raises:
      OutOfVmem: it does not fit, and libtpu says no more.
      RuntimeError: the compile failed for another reason than VMEM.
    """
    import jax

    from ce_core import StatsSpec
    from ce_pallas_tpu.tooling import aot
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config, kernel_program

    with aot.compiling_for(generation) as device:
        cfg = kernel_config(kernel, n, hidden, v, dtype, dtype, spec or StatsSpec(),
                            (tiles.block_b, tiles.block_h, tiles.block_v), tiles.w_buffers)
        cfg = dataclasses.replace(cfg, vmem_limit_bytes=CHIP_FACTS[generation].vmem_bytes)
        fn, operands = kernel_program(kernel, cfg, dtype, dtype, jax.sharding.SingleDeviceSharding(device))
        try:
            text = jax.jit(fn).lower(*operands).compile().as_text()
        except Exception as error:  # libtpu's VMEM refusal carries the figure
            needed = needed_vmem(str(error))
            if needed is None and "would exceed memory" in str(error):
                raise OutOfVmem(f"{generation} {kernel} {tiles}: {str(error)[:200]}") from error
            if needed is None:
                raise RuntimeError(f"{generation} {kernel} {tiles}: {str(error)[:300]}") from error
            return VmemUse(needed, fits=False)
    if text is None:
        raise RuntimeError(f"{generation} {kernel} {tiles}: the compiled program has no text")
    return VmemUse(used_scoped_vmem(text), fits=True)
