"""Issue 39, point 12: what installing the wheel brings — declared imports, a licence-compatible checksum package,
no test filesystem registered for every user, extras named for what they install."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}


def test_numpy_is_declared_and_the_checksum_package_is_apache_licensed():
    deps = _names(_project()["project"]["dependencies"])
    assert "numpy" in deps  # imported by the package
    assert "google-crc32c" in deps and "crc32c" not in deps  # crc32c is LGPL-2.1-or-later


def test_the_faulty_test_filesystem_is_not_registered_by_installing_or_importing():
    project = _project()["project"]
    assert "fsspec.specs" not in project.get("entry-points", {})
    # (An environment installed from an older checkout still lists the entry point until it is reinstalled.)
    code = (
        "import fsspec, lightning_async_ckpt.lightning, lightning_async_ckpt.storage.store;"
        "from fsspec.registry import registry; print('faulty' in registry)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_lightning_cli_extra_has_its_name_and_the_old_one_stays_an_alias():
    extras = _project()["project"]["optional-dependencies"]
    assert extras["lightning-cli"] == extras["cli"]
