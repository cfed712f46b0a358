"""A mount by a user other than root (issue 23): the native session mounts through the
setuid fusermount3 (`_FUSE_COMMFD`), runs without passthrough (the kernel lends backing
files to CAP_SYS_ADMIN only) and says why; the data lands in S3, `unmount` ends the
daemon, and no other user (root included) can read the mount without --allow-other.

Each test makes a throwaway system user (useradd) with a private home, runs the real CLI
as that user over the session's SeaweedFS, and removes the user, its processes and its
mount afterwards, also when the test fails."""

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

import pytest

from lakefs_mount.mountpoint import find_mount, is_mounted

NOBODY = 65534
FUSE_DEVICE = Path("/dev/fuse")
ACL_XATTR = "system.posix_acl_access"
# The CLI as the user runs it: this interpreter's packages (the user may not reach the
# virtual environment's own interpreter: pyenv's lives under root's private home).
BOOT = ("import site, sys; site.addsitedir({site!r}); sys.argv[0] = 'lakefs-mount'; "
        "from lakefs_mount.cli import main; sys.exit(main())")


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

    def env(self) -> dict[str, str]:
        aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        return {**aws, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "XDG_RUNTIME_DIR": str(self.home / "run"),
                # conftest's empty AWS files are private to root: the user's are missing
                "AWS_CONFIG_FILE": str(self.home / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.home / "no-aws-credentials")}

    def _drop(self) -> None:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(argv, preexec_fn=self._drop, env=self.env(), cwd=self.home,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        site = sysconfig.get_paths()["purelib"]
        return self.run([self.python, "-c", BOOT.format(site=site), *args], timeout=timeout)

    def status(self) -> dict:
        proc = self.cli("status", str(self.mnt), "--json")
        assert proc.returncode == 0, proc.stderr
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


def _reachable_python(user: User) -> str:
    """An interpreter of this Python version that the user may run."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python"
                      f"{version}"):
        with contextlib.suppress(OSError):
            proc = user.run([candidate, "-c", "import sys; print(*sys.version_info[:2])"],
                            timeout=30)
            if proc.returncode == 0 and proc.stdout.split() == version.split("."):
                return candidate
    pytest.fail(f"no Python {version} that user {user.name} may run (tried {sys.executable} "
                f"and /usr/bin/python{version}); this test needs one")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if Path(f"/proc/{p}").exists()]
    return alive


@contextlib.contextmanager
def _fuse_device_for(uid: int) -> Iterator[None]:
    """Let `uid` open /dev/fuse where it is root's alone (no udev here to make it 0666):
    an ACL entry for that user only, taken away afterwards with the mode restored."""
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


@pytest.fixture
def user() -> Iterator[User]:
    """A new system user with a private home and a mount point it owns; removed with its
    processes and its mount afterwards."""
    name = f"lmu{uuid.uuid4().hex[:10]}"
    root = Path(tempfile.mkdtemp(prefix="lm-nonroot-"))
    root.chmod(0o755)
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                    "--home-dir", str(root / "home"), "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        uid = int(subprocess.run(["id", "-u", name], check=True, capture_output=True,
                                 text=True).stdout)
        gid = int(subprocess.run(["id", "-g", name], check=True, capture_output=True,
                                 text=True).stdout)
        u = User(name, uid, gid, root)
        for path, mode in ((u.home, 0o700), (u.home / "run", 0o700), (u.mnt, 0o755)):
            path.mkdir(mode=mode)
            os.chown(path, uid, gid)
        u.python = _reachable_python(u)
        yield u
    finally:
        with contextlib.suppress(NameError):
            for pid in u.processes():  # (only this user's: it was made for this test)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _wait_gone(u.processes(), 10)
        if is_mounted(root / "mnt"):
            subprocess.run(["fusermount3", "-uz", str(root / "mnt")], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fuse_access(user: User) -> Iterator[None]:
    with _fuse_device_for(user.uid):
        yield


def test_a_user_mounts_with_the_native_session_through_fusermount3_without_passthrough(
        user, fuse_access, s3_server, bucket, s3):
    files = {"a.bin": os.urandom(3 * 1024 * 1024 + 123), "dir/b.txt": b"by a user\n",
             "dir/empty": b""}
    source = user.home / "src"
    user.run(["mkdir", "-p", str(source / "dir")])
    for key, data in files.items():
        (source / key).write_bytes(data)
        os.chown(source / key, user.uid, user.gid)

    proc = user.cli("mount", f"s3://{bucket}", str(user.mnt),
                    "--endpoint-url", s3_server.endpoint_url)
    assert proc.returncode == 0, proc.stderr + user.log()[-3000:]
    entry = find_mount(user.mnt)
    assert entry is not None and entry.fstype == "fuse.lakefs"
    status = user.status()
    pid = int(status["pid"])
    assert Path(f"/proc/{pid}").stat().st_uid == user.uid  # the daemon runs as the user
    assert status["fuse_session"] == "native"
    assert status["passthrough"].startswith("off (") and "CAP_SYS_ADMIN" in \
        status["passthrough"], status["passthrough"]
    assert status["cache_dir"].startswith(str(user.home / ".local" / "share")), status

    copy = user.run(["/bin/sh", "-c", f"cp -r {source}/. {user.mnt}/ && "
                                      f"cmp {source}/a.bin {user.mnt}/a.bin && "
                                      f"cat {user.mnt}/dir/b.txt && ls {user.mnt}/dir"])
    assert copy.returncode == 0, copy.stderr
    assert copy.stdout == "by a user\nb.txt\nempty\n"

    # no --allow-other: the kernel keeps every other user out, root included
    with pytest.raises(PermissionError):
        os.stat(user.mnt)
    other = subprocess.run(["/bin/ls", str(user.mnt)], preexec_fn=_as_nobody,
                           capture_output=True, text=True, timeout=30, cwd="/")
    assert other.returncode != 0 and "ermission denied" in other.stderr, other

    flush = user.cli("flush", str(user.mnt))
    assert flush.returncode == 0, flush.stderr
    for key, data in files.items():
        assert s3.get(key)[1] == data, key

    unmount = user.cli("unmount", str(user.mnt))
    assert unmount.returncode == 0, unmount.stderr
    assert not is_mounted(user.mnt)
    assert _wait_gone([pid], 60) == [], "the daemon did not exit after unmount"
    lines = user.log().splitlines()
    why = [line for line in lines if "passthrough off" in line]
    assert len(why) == 1 and "CAP_SYS_ADMIN" in why[0], why
    assert any("FUSE session: native" in line for line in lines)


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _cli_in_namespace(user: User, binds: dict[Path, Path], *args: str
                      ) -> subprocess.CompletedProcess:
    """The CLI as `user` in a mount namespace of its own where each file of `binds` is
    bind-mounted on its target (e.g. /etc/fuse.conf): the machine's stay as they are."""
    site = sysconfig.get_paths()["purelib"]
    script = "".join(f"mount --bind '{src}' '{dst}' && " for src, dst in binds.items())
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
         f"{script}exec setpriv --reuid {user.uid} --regid {user.gid} --clear-groups "
         f'"$@"', "sh", user.python, "-c", BOOT.format(site=site), *args],
        env=user.env(), cwd=user.home, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL)


def test_a_user_mount_that_root_did_not_allow_fails_in_one_line_with_the_remedy(
        user, s3_server, bucket):
    """/dev/fuse closed to the user, or --allow-other without user_allow_other in
    /etc/fuse.conf: the mount fails before any daemon starts, one line saying what root
    must change. Each case in a mount namespace with its own /dev/fuse or fuse.conf."""
    closed_device = user.root / "fuse-device"
    closed_device.write_bytes(b"")
    closed_device.chmod(0o600)
    conf = user.root / "fuse.conf"
    conf.write_text("# mount_max = 1000\n#user_allow_other\n")
    open_device = user.root / "open-device"  # (only checked for access, never opened)
    open_device.write_bytes(b"")
    open_device.chmod(0o666)
    mount = ("mount", f"s3://{bucket}", str(user.mnt), "--endpoint-url",
             s3_server.endpoint_url)
    cases = {
        "chmod 0666 /dev/fuse": _cli_in_namespace(user, {closed_device: FUSE_DEVICE}, *mount),
        "user_allow_other in /etc/fuse.conf": _cli_in_namespace(
            user, {open_device: FUSE_DEVICE, conf: Path("/etc/fuse.conf")}, *mount,
            "--allow-other"),
    }
    for remedy, proc in cases.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and remedy in lines[0], proc
    assert user.processes() == [] and not is_mounted(user.mnt)
    assert not (user.home / ".local").exists()  # no cache dir, no log: nothing started
