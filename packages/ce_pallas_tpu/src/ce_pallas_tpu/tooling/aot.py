"""Compile the loss for a TPU generation on a machine without a TPU (libtpu's deviceless topologies).

``jax.experimental.topologies.get_topology_desc`` describes one chip of a generation; its device can
be the sharding of ``ShapeDtypeStruct`` inputs, and ``jax.jit(f).lower(...).compile()`` then runs the
real TPU compiler, Mosaic and its VMEM checks included. ``compiled.memory_analysis()`` gives the HBM
the program needs. The tests compile every tuned tile entry this way; the AOT report uses it too.

Needs ``libtpu`` (the ``[tpu]`` extra). Set ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` before JAX starts when
another process on the machine may hold libtpu's lockfile (safe here: no TPU is driven).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ce_core
from ce_core.extend import CompileResult, compile_program, quiet_libtpu_without_tpu
from ce_pallas_tpu.target import targeting

#: Generation -> (topology name of one chip, extra topology options). v4 and v5p are taken in
#: their megacore configuration: one device with two TensorCores; TPU7x shows each TensorCore of a
#: chip as its own device, and the first one is used.
TOPOLOGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "v4": ("v4:1x1x1", {"chip_config_name": "megacore"}),
    "v5e": ("v5e:1x1", {}),
    "v5p": ("v5p:1x1x1", {}),
    "v6e": ("v6e:1x1", {}),
    "tpu7x": ("tpu7x:1x1x1", {}),  # one chip, two devices of one TensorCore each
}

_devices: dict[str, Any] = {}

def topology_devices(name: str, **options: Any) -> list[Any]:
    """The devices of a deviceless TPU topology such as ``"v5p:2x2x1"`` (compile only, no TPU needed)."""
    from jax.experimental import topologies

    quiet_libtpu_without_tpu()
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices)


def topology_device(generation: str) -> Any:
    """The device of a one-chip deviceless topology of ``generation`` (cached)."""
    if generation not in _devices:
        name, options = TOPOLOGIES[generation]
        _devices[generation] = topology_devices(name, **options)[0]
    return _devices[generation]


@contextlib.contextmanager
def compiling_for(generation: str) -> Iterator[Any]:
    """``CE_PALLAS_TPU_TARGET=generation`` and an abstract mesh over its device; yields the device."""
    device = topology_device(generation)
    mesh = jax.sharding.Mesh(np.array([device]), ("aot",))
    with targeting(generation), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield device


def compile_loss_and_grads(
    generation: str,
    n: int,
    h: int,
    v: int,
    *,
    implementation: str = "pallas_tpu",
    dtype: Any = jnp.bfloat16,
    block_sizes: Any = None,
    raise_errors: bool = True,
    **options: Any,
) -> CompileResult:
    """Compile ``value_and_grad`` of the mean loss w.r.t. ``x`` and ``w`` for ``generation`` (``w`` ``[V, H]`` with
    ``w_layout="vh"`` among ``options``, else ``[H, V]``).

    With ``raise_errors=False`` a failed compile is a result (``ok=False`` and the error's first line).
    """

    def compile_fn() -> Any:
        with compiling_for(generation) as device:
            sharding = jax.sharding.SingleDeviceSharding(device)

            def loss(x, w, labels):
                return ce_core.linear_cross_entropy(
                    x, labels, w, implementation=implementation, block_sizes=block_sizes, **options
                )

            args = (
                jax.ShapeDtypeStruct((n, h), dtype, sharding=sharding),
                jax.ShapeDtypeStruct((v, h) if options.get("w_layout") == "vh" else (h, v), dtype, sharding=sharding),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding),
            )
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()

    _, result = compile_program(compile_fn, raise_errors=raise_errors)
    if result.ok and result.temp_bytes is None:
        raise RuntimeError(f"the compiler reports no memory analysis for {generation}")
    return result
