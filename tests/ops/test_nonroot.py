"""A mount by a user other than root (issue 23): the native session mounts through the
setuid fusermount3 (`_FUSE_COMMFD`), runs without passthrough (the kernel lends backing
files to CAP_SYS_ADMIN only) and says why; the data lands in S3, `unmount` ends the
daemon, and no other user (root included) can read the mount without --allow-other.

Each test makes a throwaway system user (useradd) with a private home, runs the real CLI
as that user over the session's SeaweedFS, and removes the user, its processes and its
mount afterwards, also when the test fails."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.asuser import FUSE_DEVICE, User, fuse_device_for, throwaway_user, wait_gone
from lakefs_mount.ops.mountpoint import find_mount, is_mounted
from tests.mounting import cli

# /dev/fuse's ACL and useradd are the machine's: one test at a time (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("machine")

NOBODY = 65534


@pytest.fixture
def user() -> Iterator[User]:
    with throwaway_user() as u:
        yield u


@pytest.fixture
def fuse_access(user: User) -> Iterator[None]:
    with fuse_device_for(user.uid):
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
    assert entry is not None and entry.fstype == "fuse.lakefs-mount", entry
    assert entry.source == f"s3://{bucket}", entry
    options = next(line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if f" {user.mnt} " in line).rsplit(" ", 1)[1].split(",")
    assert f"user_id={user.uid}" in options and "max_read=131072" in options, options
    status = user.status()
    pid = int(status["pid"])
    assert Path(f"/proc/{pid}").stat().st_uid == user.uid  # the daemon runs as the user
    assert status["fuse_session"] == "native"
    assert status["passthrough"] is False and "CAP_SYS_ADMIN" in \
        status["passthrough_reason"], status["passthrough_reason"]
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
    assert wait_gone([pid], 60) == [], "the daemon did not exit after unmount"
    lines = user.log().splitlines()
    why = [line for line in lines if "passthrough off" in line]
    assert len(why) == 1 and "CAP_SYS_ADMIN" in why[0], why
    assert any("FUSE session: native" in line for line in lines)
    choice = [line for line in lines if "without CAP_SYS_ADMIN (mounted through fusermount3"
              in line]
    assert len(choice) == 1 and f"uid {user.uid}" in choice[0], choice
    assert any("KiB writes, 128 KiB reads" in line for line in lines)

    # SIGTERM: the daemon detaches its own mount (fusermount3 -uz, as the user) and exits
    # once the change is in S3
    proc = user.cli("mount", f"s3://{bucket}", str(user.mnt),
                    "--endpoint-url", s3_server.endpoint_url)
    assert proc.returncode == 0, proc.stderr + user.log()[-3000:]
    pid = int(user.status()["pid"])
    edit = user.run(["/bin/sh", "-c", f"printf changed > {user.mnt}/dir/b.txt"])
    assert edit.returncode == 0, edit.stderr
    os.kill(pid, signal.SIGTERM)
    assert wait_gone([pid], 60) == [], "the daemon did not exit after SIGTERM"
    assert not is_mounted(user.mnt)
    assert s3.get("dir/b.txt")[1] == b"changed"
    assert "Traceback" not in user.log()


def test_root_finds_the_daemon_of_a_users_mount_for_status(user, fuse_access, s3_server,
                                                            bucket):
    """The user's daemon listens under the user's runtime directory, which root's
    environment does not name: root's `status` finds it through the mount's owner
    (mountinfo's user_id) and the bound socket of that name the owner holds."""
    proc = user.cli("mount", f"s3://{bucket}", str(user.mnt),
                    "--endpoint-url", s3_server.endpoint_url)
    assert proc.returncode == 0, proc.stderr + user.log()[-3000:]
    pid = int(user.status()["pid"])
    try:
        as_root = cli("status", str(user.mnt), "--json")
        assert as_root.returncode == 0, as_root.stderr
        status = json.loads(as_root.stdout)
        assert (status["pid"], status["mountpoint"]) == (pid, str(user.mnt)), status
        table = cli("status", str(user.mnt))
        assert table.returncode == 0 and re.search(rf"^daemon pid +{pid}$", table.stdout,
                                                   re.MULTILINE), table
    finally:
        unmount = user.cli("unmount", str(user.mnt))
    assert unmount.returncode == 0, unmount.stderr
    assert wait_gone([pid], 60) == [], "the daemon did not exit after unmount"


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _cli_in_namespace(user: User, binds: dict[Path, Path], *args: str
                      ) -> subprocess.CompletedProcess:
    """The CLI as `user` in a mount namespace of its own where each file of `binds` is
    bind-mounted on its target (e.g. /etc/fuse.conf): the machine's stay as they are."""
    script = "".join(f"mount --bind '{src}' '{dst}' && " for src, dst in binds.items())
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
         f"{script}exec setpriv --reuid {user.uid} --regid {user.gid} --clear-groups "
         f'"$@"', "sh", *user.cli_argv(*args)],
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


def _in_namespace_of(pid: int, uid: int, gid: int, argv: list[str], env: dict[str, str]
                     ) -> subprocess.CompletedProcess:
    """`argv` as uid:gid in the mount namespace of process `pid`."""
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-m", "--", "setpriv", "--reuid", str(uid), "--regid",
         str(gid), "--clear-groups", *argv], env=env, cwd="/", capture_output=True,
        text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_a_user_mount_with_allow_other_where_root_allowed_it_lets_other_users_in(
        user, fuse_access, s3_server, bucket, s3):
    """With user_allow_other in (its namespace's) /etc/fuse.conf, the user's --allow-other
    mount lets user nobody read a 0644 file and not write it (default_permissions)."""
    conf = user.root / "fuse.conf"
    conf.write_text("user_allow_other\n")
    proc = _cli_in_namespace(user, {conf: Path("/etc/fuse.conf")}, "mount", f"s3://{bucket}",
                             str(user.mnt), "--endpoint-url", s3_server.endpoint_url,
                             "--allow-other")
    assert proc.returncode == 0, proc.stderr + user.log()[-3000:]
    pid = int(user.status()["pid"])  # (its socket is reachable from here; its mount is not)
    as_user = _in_namespace_of(pid, user.uid, user.gid, ["/bin/sh", "-c",
                               f"printf shared > {user.mnt}/f && chmod 644 {user.mnt}/f"],
                               user.env())
    assert as_user.returncode == 0, as_user.stderr
    read = _in_namespace_of(pid, NOBODY, NOBODY, ["/bin/cat", f"{user.mnt}/f"], {})
    assert read.returncode == 0 and read.stdout == "shared", read
    write = _in_namespace_of(pid, NOBODY, NOBODY, ["/bin/sh", "-c", f"printf x >> {user.mnt}/f"],
                             {})
    assert write.returncode != 0 and "ermission denied" in write.stderr, write
    unmount = _in_namespace_of(pid, user.uid, user.gid, user.cli_argv("unmount",
                                                                     str(user.mnt)), user.env())
    assert unmount.returncode == 0, unmount.stderr
    assert wait_gone([pid], 60) == [], "the daemon did not exit after unmount"
    assert s3.get("f")[1] == b"shared"


def test_a_user_mount_with_allow_root_lets_root_in_and_no_other_user(
        user, fuse_access, s3_server, bucket):
    """--allow-root, where root allowed it (user_allow_other in its namespace's
    /etc/fuse.conf): root reads the user's files, user nobody is refused (EACCES from
    the daemon, as libfuse's allow_root) even where the mode would let it read."""
    conf = user.root / "fuse.conf"
    conf.write_text("user_allow_other\n")
    proc = _cli_in_namespace(user, {conf: Path("/etc/fuse.conf")}, "mount", f"s3://{bucket}",
                             str(user.mnt), "--endpoint-url", s3_server.endpoint_url,
                             "--allow-root")
    assert proc.returncode == 0, proc.stderr + user.log()[-3000:]
    pid = int(user.status()["pid"])
    try:
        as_user = _in_namespace_of(pid, user.uid, user.gid, ["/bin/sh", "-c",
                                   f"printf mine > {user.mnt}/f && chmod 644 {user.mnt}/f"],
                                   user.env())
        assert as_user.returncode == 0, as_user.stderr
        root = _in_namespace_of(pid, 0, 0, ["/bin/cat", f"{user.mnt}/f"], {})
        assert root.returncode == 0 and root.stdout == "mine", root
        other = _in_namespace_of(pid, NOBODY, NOBODY, ["/bin/cat", f"{user.mnt}/f"], {})
        assert other.returncode != 0 and "ermission denied" in other.stderr, other
    finally:
        unmount = _in_namespace_of(pid, user.uid, user.gid,
                                   user.cli_argv("unmount", str(user.mnt)), user.env())
    assert unmount.returncode == 0, unmount.stderr
    assert wait_gone([pid], 60) == [], "the daemon did not exit after unmount"
