"""Every package builds to a wheel and an sdist that install alone and plug in by entry point.

Builds with ``uv build --all-packages`` and installs the wheels into fresh virtual environments,
outside the workspace, so a missing file, dependency or entry point fails here and not for users.
"""

from __future__ import annotations

import email.message
import email.parser
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest

#: The slow tier: builds and installs the wheels (uv run pytest -m slow).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # distribution -> (import name, backend entry points)
    "ce-core": ("ce_core", {}),
    "ce-reference": ("ce_reference", {"reference": "ce_reference:make_backend"}),
    "ce-xla": ("ce_xla", {"xla": "ce_xla:make_backend"}),
    "ce-pallas-tpu": ("ce_pallas_tpu", {"pallas_tpu": "ce_pallas_tpu:make_backend"}),
    "ce-bench": ("ce_bench", {}),
}


def uv_executable() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv is needed to build the wheels (CI installs it; `uv run pytest` sets $UV)"
    return found


def package_version(import_name: str) -> str:
    init = ROOT / "packages" / import_name / "src" / import_name / "__init__.py"
    for line in init.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip('"')
    raise AssertionError(f"no __version__ in {init}")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([uv_executable(), "build", "--all-packages", "--out-dir", str(out), "--quiet"],
                   cwd=ROOT, check=True)
    return out


def wheel_of(dist: Path, distribution: str) -> Path:
    (wheel,) = dist.glob(f"{distribution.replace('-', '_')}-*.whl")
    return wheel


def read_metadata(wheel: Path) -> tuple[email.message.Message, str]:
    with zipfile.ZipFile(wheel) as archive:
        info = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        names = archive.namelist()
        entry_points = archive.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
        assert any(name.endswith("/py.typed") for name in names), f"{wheel.name} has no py.typed"
    return metadata, entry_points


@pytest.mark.parametrize("distribution", PACKAGES)
def test_wheel_and_sdist_metadata(dist, distribution):
    import_name, backends = PACKAGES[distribution]
    assert len(list(dist.glob(f"{distribution.replace('-', '_')}-*.tar.gz"))) == 1, "sdist missing"
    metadata, entry_points = read_metadata(wheel_of(dist, distribution))
    assert metadata["Name"] == distribution
    assert metadata["Version"] == package_version(import_name)
    assert metadata["Requires-Python"] == ">=3.12"
    assert metadata["License-Expression"] == "MIT"
    readme = (ROOT / "packages" / import_name / "README.md").read_text()
    description = metadata.get_payload()
    assert isinstance(description, str), "METADATA should have one plain-text body (the long description), not parts"
    assert description.strip() == readme.strip(), "the package README is the long description"
    assert metadata["Description-Content-Type"] == "text/markdown"
    requires = metadata.get_all("Requires-Dist") or []
    if distribution != "ce-core":
        assert "ce-core<0.3,>=0.2" in requires, requires
    assert any(req.startswith("jax>=") for req in requires), requires
    declared = tomllib.loads((ROOT / "packages" / import_name / "pyproject.toml").read_text())
    for name, target in backends.items():
        assert f"{name} = {target}" in entry_points, entry_points
    assert declared["project"]["name"] == distribution
    if distribution == "ce-pallas-tpu":
        assert any("libtpu" in req and 'extra == "tpu"' in req.replace("'", '"') for req in requires), requires


def run_in(venv: Path, code: str, **env: str) -> str:
    python = venv / "bin" / "python"
    environment = {"PATH": os.environ.get("PATH", ""), "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True,
                          env=environment, cwd=venv).stdout.strip()


def test_wheels_install_alone_and_plug_in(dist, tmp_path):
    uv = uv_executable()
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", str(venv), "--python", f"{sys.version_info.major}.{sys.version_info.minor}", "--quiet"],
                   check=True)

    def install(*distributions: str) -> None:
        wheels = [str(wheel_of(dist, name)) for name in distributions]
        subprocess.run([uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--quiet", *wheels], check=True)

    probe = ("import json, ce_core; print(json.dumps([ce_core.installed_backends(), ce_core.available_backends(), "
             "ce_core.__file__]))")
    install("ce-core", "ce-xla")
    installed, available, location = json.loads(run_in(venv, probe))
    assert str(venv) in location, "ce_core must come from the fresh environment, not the workspace"
    assert installed == ["xla"] and available == ["xla"]
    loss = run_in(venv, "import numpy as np, ce_core; x = np.ones((4, 8), np.float32); "
                        "w = np.zeros((8, 10), np.float32); "
                        "print(float(ce_core.linear_cross_entropy(x, np.arange(4), w)))")
    assert abs(float(loss) - np.log(10)) < 1e-5

    install("ce-pallas-tpu")
    installed, available, _ = json.loads(run_in(venv, probe))
    assert installed == ["pallas_tpu", "xla"] and available == ["xla"]
    _, available, _ = json.loads(run_in(venv, probe, CE_PALLAS_TPU_INTERPRET="1"))
    assert available == ["pallas_tpu", "xla"]
