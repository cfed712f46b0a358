"""A throwaway user other than root, for what a user's mount does differently (no
CAP_SYS_ADMIN: fusermount3, no passthrough): `with throwaway_user() as user:` makes a
system user with a private home and a mount point it owns, runs the real CLI as that user,
and removes its processes, its mount and the user afterwards. Root only. Used by
tests/ops/test_nonroot.py and benchmarks/nonroot_session.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lakefs_mount
from lakefs_mount.ops.mountpoint import is_mounted

FUSE_DEVICE = Path("/dev/fuse")
ACL_XATTR = "system.posix_acl_access"
# The CLI as the user runs it: this interpreter's packages (the user may not reach the
# virtual environment's own interpreter: pyenv's lives under root's private home).
# The package itself is a copy in the user's folder: the checkout may lie where only root
# can read it (under /root, for one), and an editable install points there.
BOOT = ("import site, sys; site.addsitedir({site!r}); sys.path.insert(0, {lib!r}); "
        "sys.argv[0] = 'lakefs-mount'; from lakefs_mount.cli import main; sys.exit(main())")


@dataclass
class User:
    name: str
    uid: int
    gid: int
    root: Path  # 0755, root's: holds home/ and mnt/
    python: str = ""

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def mnt(self) -> Path:
        return self.root / "mnt"

    @property
    def lib(self) -> Path:
        """Holds the copy of the lakefs_mount package that the user's CLI runs."""
        return self.root / "lib"

    def env(self) -> dict[str, str]:
        aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        return {**aws, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "XDG_RUNTIME_DIR": str(self.home / "run"),
                # root's AWS files (a test's empty ones) may be private: the user's are missing
                "AWS_CONFIG_FILE": str(self.home / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.home / "no-aws-credentials")}

    def drop(self) -> None:
        """In a child before exec: become the user."""
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(argv, preexec_fn=self.drop, env=self.env(), cwd=self.home,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def cli_argv(self, *args: str) -> list[str]:
        site = sysconfig.get_paths()["purelib"]
        return [self.python, "-c", BOOT.format(site=site, lib=str(self.lib)), *args]

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(self.cli_argv(*args), timeout=timeout)

    def status(self) -> dict:
        proc = self.cli("status", str(self.mnt), "--json")
        if proc.returncode != 0:
            raise RuntimeError(f"status as {self.name} failed: {proc.stderr}")
        return json.loads(proc.stdout)

    def log(self) -> str:
        """The daemon's log (default place under the user's home), "" if none yet."""
        logs = sorted((self.home / ".local/share/lakefs-mount/logs").glob("*.log"))
        return logs[0].read_text(errors="replace") if logs else ""

    def processes(self) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == self.uid:
                        pids.append(int(entry.name))
        return pids


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The processes of `pids` still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if Path(f"/proc/{p}").exists()]
    return alive


def _reachable_python(user: User) -> str:
    """An interpreter of this Python version that the user may run."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    tried = [sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for candidate in tried:
        with contextlib.suppress(OSError):
            proc = user.run([candidate, "-c", "import sys; print(*sys.version_info[:2])"],
                            timeout=30)
            if proc.returncode == 0 and proc.stdout.split() == version.split("."):
                return candidate
    raise RuntimeError(f"no Python {version} that user {user.name} may run (tried "
                       f"{', '.join(tried)})")


@contextlib.contextmanager
def fuse_device_for(uid: int) -> Iterator[None]:
    """Let `uid` open /dev/fuse where it is root's alone (no udev to make it 0666): an ACL
    entry for that user only, taken away afterwards with the mode restored."""
    mode = FUSE_DEVICE.stat().st_mode & 0o7777
    if mode & 0o006 == 0o006:
        yield
        return
    entries = [(0x01, 6, 0xFFFFFFFF), (0x02, 6, uid), (0x04, (mode >> 3) & 7, 0xFFFFFFFF),
               (0x10, 6, 0xFFFFFFFF), (0x20, mode & 7, 0xFFFFFFFF)]  # user, group, mask
    os.setxattr(FUSE_DEVICE, ACL_XATTR,
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.removexattr(FUSE_DEVICE, ACL_XATTR)
        FUSE_DEVICE.chmod(mode)


@contextlib.contextmanager
def throwaway_user() -> Iterator[User]:
    """A new system user with a private home and a mount point it owns; afterwards its
    processes are killed (only its: it was made here), its mount detached, it is gone."""
    name = f"lmu{uuid.uuid4().hex[:10]}"
    root = Path(tempfile.mkdtemp(prefix="lm-nonroot-"))
    root.chmod(0o755)
    made = False
    try:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--home-dir", str(root / "home"), "--shell", "/usr/sbin/nologin",
                        name], check=True, capture_output=True)
        made = True
        ids = [int(subprocess.run(["id", flag, name], check=True, capture_output=True,
                                  text=True).stdout) for flag in ("-u", "-g")]
        user = User(name, ids[0], ids[1], root)
        for path, mode in ((user.home, 0o700), (user.home / "run", 0o700), (user.mnt, 0o755)):
            path.mkdir(mode=mode)
            os.chown(path, user.uid, user.gid)
        shutil.copytree(Path(lakefs_mount.__file__).parent, user.lib / "lakefs_mount",
                        ignore=shutil.ignore_patterns("__pycache__"))
        user.python = _reachable_python(user)
        yield user
    finally:
        if made:
            uid = int(subprocess.run(["id", "-u", name], capture_output=True,
                                     text=True).stdout or -1)
            left = User(name, uid, uid, root).processes() if uid >= 0 else []
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            wait_gone(left, 10)
        if is_mounted(root / "mnt"):
            subprocess.run(["fusermount3", "-uz", str(root / "mnt")], capture_output=True)
        if made:
            subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
