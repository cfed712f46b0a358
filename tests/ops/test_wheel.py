"""The distribution: `python -m build` makes a wheel and an sdist from the tracked files,
the wheel holds every module of the tree at its import path, and it installs into a fresh
virtualenv whose commands run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Folder of the checkout -> the package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {"lakefs_mount": "lakefs_mount", "cache": "lakefs_mount/cache",
                "uring": "lakefs_mount/uring", "cli": "lakefs_mount/cli"}
COMMANDS = ("lakefs-mount", "mount.fuse.lakefs-mount")
BUILD_TIMEOUT = 600


def _run(*cmd: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    return _run("git", "ls-files", cwd=REPO).stdout.splitlines()


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """Wheel and sdist built from a copy of the tracked files (nothing lands in the repo)."""
    src = tmp_path_factory.mktemp("src")
    for name in _tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name, follow_symlinks=False)  # links stay links
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--outdir", out, src)
    return out


@pytest.mark.slow
def test_build_makes_one_wheel_and_one_sdist(dist):
    assert len(list(dist.glob("lakefs_mount-*-py3-none-any.whl"))) == 1
    assert len(list(dist.glob("lakefs_mount-*.tar.gz"))) == 1


@pytest.mark.slow
def test_wheel_holds_every_module_at_its_import_path_and_both_commands(dist):
    wheel = zipfile.ZipFile(next(dist.glob("*.whl")))
    names = set(wheel.namelist())
    expected = {PACKAGE_DIRS[name.split("/", 1)[0]] + "/" + name.split("/", 1)[1]
                for name in _tracked_files()
                if name.endswith(".py") and name.split("/", 1)[0] in PACKAGE_DIRS}
    assert expected and not expected - names, sorted(expected - names)
    assert not {n.split("/", 1)[0] for n in names} & {"cache", "cli", "uring"}
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = wheel.read(entry_points).decode()
    assert all(f"{command} = " in scripts for command in COMMANDS), scripts


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_its_commands_run(dist, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    _run(venv / "bin" / "pip", "install", "-q", next(dist.glob("*.whl")))
    assert "Usage: lakefs-mount" in _run(venv / "bin" / "lakefs-mount", "--help").stdout
    assert _run(venv / "bin" / "lakefs-mount", "--version").stdout.startswith(
        "lakefs-mount, version ")
    assert "usage: mount.fuse.lakefs-mount" in _run(
        venv / "bin" / "mount.fuse.lakefs-mount", "--help").stdout
    # the daemon's imports (pyfuse3, trio, boto3, prometheus-client) resolve there too
    _run(venv / "bin" / "python", "-I", "-c",
         "import lakefs_mount.daemon.daemon, lakefs_mount.ops.metrics_server", cwd=tmp_path)
