"""mount(8) and /etc/fstab: `mount -t fuse.lakefs-mount` runs the helper
`mount.fuse.lakefs-mount`, every option of `lakefs-mount mount` has an `-o name=value`
spelling, and a plain `umount` leaves every byte in S3 once the daemon has exited."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakefs_mount.cli.main import cli as lakefs_mount_cli
from lakefs_mount.cli.mount_options import HelperError, mount_arguments, translate
from lakefs_mount.ops.mountpoint import is_mounted
from tests.mounting import cli
from tests.ops.test_mount_errors import daemons_for
from tests.ops.test_mountpoint import needs_fuse, needs_root

# /etc/fstab and /sbin's helper link are the machine's: one test at a time (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("machine")

HELPER_LINK = Path("/sbin/mount.fuse.lakefs-mount")
HELPER = Path(sys.executable).parent / "mount.fuse.lakefs-mount"
FSTAB = Path("/etc/fstab")
EXIT_WAIT = 120.0  # seconds the daemon may take to commit what is left after umount
MOUNT_COMMAND = lakefs_mount_cli.commands["mount"]


def test_every_mount_option_has_an_o_spelling_with_underscores_or_dashes():
    for param in MOUNT_COMMAND.params:
        long_opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
        if not long_opts or long_opts[0] in ("--foreground", "--help"):
            continue
        name = long_opts[0][2:]
        item = name if param.is_flag else f"{name}=1"
        expected = [long_opts[0]] if param.is_flag else [long_opts[0], "1"]
        assert translate([item], MOUNT_COMMAND) == expected
        assert translate([item.replace("-", "_")], MOUNT_COMMAND) == expected


def test_fstab_and_systemd_items_are_passed_over_and_ro_means_read_only():
    args, _ = mount_arguments(["s3://b/p", "/mnt/x", "-o",
                               "defaults,noauto,nofail,_netdev,x-systemd.automount,"
                               "x-systemd.mount-timeout=30,comment=x,ro,cache_size=10G",
                               "-t", "fuse.lakefs-mount", "-n"])
    assert args == ["mount", "--read-only", "--cache-size", "10G", "s3://b/p", "/mnt/x"]


def test_unknown_items_fail_unless_sloppy_and_foreground_is_not_an_item():
    with pytest.raises(HelperError, match="unknown mount option 'bogus'"):
        translate(["bogus=1"], MOUNT_COMMAND)
    with pytest.raises(HelperError, match="unknown mount option 'foreground'"):
        translate(["foreground"], MOUNT_COMMAND)
    assert translate(["bogus=1", "allow_other"], MOUNT_COMMAND, sloppy=True) == \
        ["--allow-other"]


def test_flags_take_no_value_and_options_need_one():
    with pytest.raises(HelperError, match="takes no value"):
        translate(["allow_other=1"], MOUNT_COMMAND)
    with pytest.raises(HelperError, match="needs a value"):
        translate(["cache_dir"], MOUNT_COMMAND)


def test_fake_helper_call_prints_the_mount_command_and_mounts_nothing(tmp_path):
    proc = subprocess.run([str(HELPER), "s3://b/p", str(tmp_path), "-f",
                           "-o", "cache_dir=/nvme/c,max_dirty=1G"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == (f"mount.fuse.lakefs-mount: lakefs-mount mount --cache-dir "
                                   f"/nvme/c --max-dirty 1G s3://b/p {tmp_path}")
    assert not is_mounted(tmp_path)


@pytest.fixture
def helper_link() -> Iterator[None]:
    """/sbin/mount.fuse.lakefs-mount -> this environment's helper, as setup.sh links it;
    whatever was there before is put back."""
    before = os.readlink(HELPER_LINK) if HELPER_LINK.is_symlink() else None
    if HELPER_LINK.exists() and before is None:
        pytest.skip(f"{HELPER_LINK} is a file, not a link: not replacing it")
    HELPER_LINK.unlink(missing_ok=True)
    HELPER_LINK.symlink_to(HELPER)
    try:
        yield
    finally:
        HELPER_LINK.unlink(missing_ok=True)
        if before is not None:
            HELPER_LINK.symlink_to(before)


@pytest.fixture
def fstab_restored() -> Iterator[Path]:
    """/etc/fstab as the test found it, byte for byte, however the test ends."""
    original = FSTAB.read_bytes() if FSTAB.exists() else None
    try:
        yield FSTAB
    finally:
        if original is None:
            FSTAB.unlink(missing_ok=True)
        else:
            FSTAB.write_bytes(original)


def _options(m) -> str:
    return (f"cache_dir={m.cache_dir},endpoint_url={m.endpoint_url},log_file={m.log_file},"
            f"log_level=DEBUG,max_dirty=64M,_netdev,noauto,nofail,x-systemd.automount")


def _write_checkpoint(root: Path) -> dict[str, bytes]:
    """A small file and a multipart one (40 MiB: three 16 MiB parts), just closed."""
    files = {"step_1/meta.json": b'{"step": 1}\n',
             "step_1/model.bin": os.urandom(40 * 1024 * 1024)}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _umount_and_wait(m) -> None:
    """Plain umount(8), then wait for the daemon to commit and exit."""
    pid = m.pid
    proc = subprocess.run(["umount", str(m.path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(m.path)
    deadline = time.monotonic() + EXIT_WAIT
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), f"daemon still running:\n{m.log_tail()}"
    m.pid = None


def _assert_in_s3(s3, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        got = s3.get(key)
        assert got is not None, f"{key} is not in S3"
        assert got[1] == data, f"{key}: {len(got[1])} bytes in S3, {len(data)} written"


@needs_root
@needs_fuse
@pytest.mark.parametrize("session", ["native", "pyfuse3"])
def test_mount_t_fuse_lakefs_mount_mounts_and_umount_leaves_every_byte_in_s3(
        helper_link, mount_factory, s3, session):
    m = mount_factory(start=False)
    proc = subprocess.run(["mount", "-t", "fuse.lakefs-mount", m.source, str(m.path),
                           "-o", f"{_options(m)},fuse_session={session}"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stderr}\n{m.log_tail()}"
    assert is_mounted(m.path)
    status = m.status()
    m.pid = status["pid"]
    assert (status["bucket"], status["cache_dir"], status["max_dirty"],
            status["fuse_session"]) == (m.bucket, str(m.cache_dir), 64 * 1024 * 1024, session)
    files = _write_checkpoint(m.path)
    _umount_and_wait(m)
    _assert_in_s3(s3, files)
    assert "committing" in m.log_file.read_text()


@needs_root
@needs_fuse
def test_fstab_line_mounts_with_mount_dir_and_umount_leaves_every_byte_in_s3(
        helper_link, fstab_restored, mount_factory, s3):
    m = mount_factory(start=False)
    with fstab_restored.open("a") as f:
        f.write(f"\n{m.source} {m.path} fuse.lakefs-mount {_options(m)} 0 0\n")
    proc = subprocess.run(["mount", str(m.path)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stderr}\n{m.log_tail()}"
    m.pid = m.status()["pid"]
    files = _write_checkpoint(m.path)
    _umount_and_wait(m)
    _assert_in_s3(s3, files)


def test_the_mount_fuse3_command_line_of_lakefs_mount_is_a_helper_call(tmp_path):
    """mount.fuse3 runs `lakefs-mount SOURCE DIR -o ...` and adds `dev,suid` to the items;
    that command line exits as the helper does (mount(8)'s statuses)."""
    proc = cli("s3://b", str(tmp_path / "missing"), "-o", "cache_dir=/tmp/c,dev,suid,bogus=1")
    assert proc.returncode == 1
    assert "unknown mount option 'bogus'" in proc.stderr
    proc = cli("s3://b", str(tmp_path / "missing"), "-o", f"cache_dir={tmp_path / 'c'},dev,suid")
    assert proc.returncode == 32 and "does not exist" in proc.stderr  # `mount` checked it


@needs_root
@needs_fuse
@pytest.mark.skipif(shutil.which("mount.fuse3") is None, reason="fuse3 not installed")
def test_fuse3s_generic_helper_mounts_it_through_the_lakefs_mount_command(mount_factory, s3):
    """What mount(8) does where /sbin has no mount.fuse.lakefs-mount: it runs mount.fuse3,
    which runs the `lakefs-mount` it finds on PATH (called directly here, as mount(8) would
    find the installed /usr/local/bin/lakefs-mount, not this environment's)."""
    m = mount_factory(start=False)
    env = {**os.environ, "PATH": f"{HELPER.parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["mount.fuse3", m.source, str(m.path), "-t", "fuse.lakefs-mount",
                           "-o", _options(m)], capture_output=True, text=True, timeout=180,
                          env=env)
    assert proc.returncode == 0, f"{proc.stderr}\n{m.log_tail()}"
    m.pid = m.status()["pid"]
    files = _write_checkpoint(m.path)
    _umount_and_wait(m)
    _assert_in_s3(s3, files)


@pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)
def test_findmnt_shows_the_helpers_type_and_the_mounted_source(mount_factory, bucket):
    """The type is the helper's, `fuse.lakefs-mount` (so `findmnt -t fuse.lakefs-mount`
    and `umount -t` find it), and the source is what was mounted, s3://bucket/prefix."""
    m = mount_factory(prefix="ckpt/run1/")
    shown = subprocess.run(["findmnt", "-n", "-t", "fuse.lakefs-mount", "-o", "SOURCE",
                            "--mountpoint", str(m.path)], capture_output=True, text=True)
    assert shown.stdout.split() == [f"s3://{bucket}/ckpt/run1"], shown


# ------------------------------------------------- mount(8)'s exit statuses, env. items


def _helper(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELPER), *argv], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_helper_exits_1_on_incorrect_invocation(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for argv, said in ((["s3://b", str(mnt), "-o", "bogus=1"], "unknown mount option"),
                       (["s3://b", str(mnt), "-o", "part_size=3M"], "'--part-size'"),
                       (["s3://b", str(mnt), "-o", "uid=x"], "'--uid'"),
                       (["s3://b", str(mnt), "-o", "allow_root,allow_other"], "exclude"),
                       (["s3://b", str(mnt), "-o", "env.A-B=1"], "not an environment"),
                       (["s3://b"], "required")):
        proc = _helper(*argv)
        assert (proc.returncode, said in proc.stderr) == (1, True), (argv, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_the_helper_exits_32_when_the_mount_fails(mount_factory, s3_server, tmp_path):
    mounted = mount_factory()
    free = tmp_path / "free"
    free.mkdir()
    cases = {
        "missing mount point": ([f"s3://{mounted.bucket}", str(tmp_path / "nowhere")],
                                "does not exist"),
        "missing bucket": (["s3://no-such-bucket-h52", str(free)], "does not exist"),
        "busy mount point": ([f"s3://{mounted.bucket}", str(mounted.path)], "already mounted"),
    }
    for case, (argv, said) in cases.items():
        proc = _helper(*argv, "-o", f"endpoint_url={s3_server.endpoint_url},"
                                    f"cache_dir={tmp_path / 'c'},log_file={tmp_path / 'log'}")
        assert (proc.returncode, said in proc.stderr) == (32, True), (case, proc.stderr)
    assert mounted.status()["pid"] == mounted.pid  # the busy one still serves


def test_ctrl_c_to_the_helper_while_it_mounts_exits_8_and_mounts_nothing(
        bucket, fault_proxy, tmp_path):
    """mount(8)'s "user interrupt": Ctrl-C reaches the helper's process group while the
    daemon waits for an S3 that does not answer."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fault_proxy.hang = True  # the start-up bucket check waits
    proc = subprocess.Popen([str(HELPER), f"s3://{bucket}", str(mnt), "-o",
                             f"endpoint_url={fault_proxy.endpoint_url},"
                             f"cache_dir={tmp_path / 'c'},log_file={tmp_path / 'log'}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        # the helper, the `lakefs-mount mount` it runs, and the daemon that one forked
        while len(daemons_for(mnt)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(daemons_for(mnt)) == 3, "the daemon did not start"
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does: not the daemon (setsid)
        _, err = proc.communicate(timeout=60)
    finally:
        fault_proxy.hang = False
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 8, err
    assert "lakefs-mount: interrupted" in err, err
    deadline = time.monotonic() + 30
    while daemons_for(mnt) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemons_for(mnt) == [] and not is_mounted(mnt)


def test_env_items_are_shown_by_the_helper_with_secret_looking_values_masked(tmp_path):
    proc = _helper("s3://b", str(tmp_path), "-f", "-v", "-o",
                   "env.AWS_PROFILE=train,env.AWS_SECRET_ACCESS_KEY=Sup3rSecretValue,"
                   "env.AWS_SESSION_TOKEN=T0kenValue,env.AWS_CA_BUNDLE=/etc/ca.pem,max_dirty=1G")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == (
        "mount.fuse.lakefs-mount: AWS_PROFILE=train AWS_SECRET_ACCESS_KEY=*** "
        "AWS_SESSION_TOKEN=*** AWS_CA_BUNDLE=/etc/ca.pem lakefs-mount mount --max-dirty 1G "
        f"s3://b {tmp_path}")


@needs_root
@needs_fuse
def test_env_items_give_the_daemon_its_credentials_and_no_process_shows_them(
        helper_link, s3_auth_server, tmp_path):
    """Credentials only in `env.` items reach the daemon (the server refuses anyone
    else); the daemon's command line, its log and the mount's options never hold the
    secret; uid=/file_mode= items set what a foreign object shows."""
    bucket = f"env-{uuid.uuid4().hex[:12]}"
    s3_auth_server.create_bucket(bucket)
    secret = s3_auth_server.secret_key
    assert secret and s3_auth_server.access_key
    s3_auth_server.store(bucket).put("foreign.bin", b"from another tool", {})
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    options = (f"endpoint_url={s3_auth_server.endpoint_url},cache_dir={tmp_path / 'c'},"
               f"log_file={log},log_level=DEBUG,uid=4321,file_mode=0600,"
               f"env.AWS_ACCESS_KEY_ID={s3_auth_server.access_key},"
               f"env.AWS_SECRET_ACCESS_KEY={secret}")
    proc = subprocess.run(["mount", "-t", "fuse.lakefs-mount", f"s3://{bucket}", str(mnt),
                           "-o", options], capture_output=True, text=True, timeout=180)
    try:
        assert proc.returncode == 0, proc.stderr + log.read_text(errors="replace")[-3000:]
        st = os.stat(mnt / "foreign.bin")
        assert (st.st_uid, oct(st.st_mode & 0o7777)) == (4321, "0o600")
        assert (mnt / "foreign.bin").read_bytes() == b"from another tool"
        daemons = daemons_for(mnt)
        assert daemons, "no daemon"
        shown = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                 for pid in daemons]
        shown += [log.read_text(errors="replace"), Path("/proc/self/mountinfo").read_text()]
        assert not [text for text in shown if secret in text]
    finally:
        pids = daemons_for(mnt)
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)
        deadline = time.monotonic() + EXIT_WAIT
        while daemons_for(mnt) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in set(pids) & set(daemons_for(mnt)):  # (it should have exited by now)
            os.kill(pid, signal.SIGKILL)
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
