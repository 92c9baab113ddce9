"""libtpu on a machine without a TPU: keep its start-up complaints out of the output.

With libtpu installed (it compiles for TPU topologies without a TPU), JAX's platform discovery loads
it in every process, and off a Cloud TPU VM libtpu prints "Failed to find host bounds ..." and an
``E0000 ... TPU_WORKER_HOSTNAMES`` error, which look like failures. ``ce-bench`` and the test
suite call :func:`quiet_libtpu_without_tpu` before JAX starts.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Google's PCI vendor id, which every TPU chip reports (as JAX's own hardware probe reads it).
_GOOGLE_PCI_VENDOR = "0x1ae0"


def host_has_tpu() -> bool:
    """Whether a TPU chip is attached to this machine (a PCI device of Google's vendor id)."""
    for vendor in Path("/sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor.read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def quiet_libtpu_without_tpu() -> None:
    """Spare a machine with no TPU libtpu's start-up complaints about its (absent) TPU host.

    Off a Cloud TPU VM nothing describes the local TPU host, and libtpu, loaded only to compile for
    a deviceless topology, prints "Failed to find host bounds ..." and an ``E0000 ...
    TPU_WORKER_HOSTNAMES`` error that look like failures. A one-host description silences them and
    does not change what is compiled. Variables already set are kept, and a machine with a TPU is
    left alone, so real start-up errors there still show. Call before libtpu first loads.
    """
    if host_has_tpu():
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
