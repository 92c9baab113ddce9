"""Repository-wide pytest set-up.

JAX sees 8 simulated CPU devices, so the sharding tests can build real meshes on one machine
(the flag is read when JAX first initialises its CPU backend, which happens after this file runs).

With ``CE_FAIL_ON_SKIP=1`` (set by ``.ci/run``) a skipped test fails the run: in CI every test,
the TPU interpret-mode and ahead-of-time ones included, must really run.
"""

from __future__ import annotations

import os

import pytest

from ce_core.contract.tpu_host import quiet_libtpu_without_tpu

# Deviceless TPU compiles load libtpu, which refuses to start while another process holds its
# lockfile; no TPU is driven here, so several loads are safe.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Without a TPU, libtpu (installed to compile for TPU topologies) would print start-up complaints
# about the absent TPU host in every test process.
quiet_libtpu_without_tpu()

# The user's own tile cache (ce_pallas_tpu.tile_cache) must not steer the tests' tiles: the tests that
# exercise it point it at their own temporary file.
os.environ["CE_PALLAS_TPU_TILE_CACHE"] = "off"

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CE_FAIL_ON_SKIP") != "1":
        return
    reporter: pytest.TerminalReporter | None = session.config.pluginmanager.get_plugin("terminalreporter")
    if not reporter:  # e.g. under -p no:terminal
        return
    skipped = reporter.stats.get("skipped", [])
    if skipped and session.exitstatus == 0:
        names = ", ".join(report.nodeid for report in skipped[:10])
        reporter.ensure_newline()
        reporter.write_line(f"CE_FAIL_ON_SKIP=1: {len(skipped)} test(s) skipped, which fails this run: {names}",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
