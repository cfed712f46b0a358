"""FUSE passthrough through the native session: the kernel reads and writes the cache file
itself, no READ or WRITE request reaches the daemon, and S3 still ends with the bytes the
application wrote (real mount, real SeaweedFS)."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import random
import signal
import sqlite3
import subprocess
import threading
import time

import pytest

from tests.mount.test_posix import body, flushed, wait_for
from tests.mounting import CLI

MiB = 1024 * 1024
pytestmark = pytest.mark.parametrize("fuse_session", ["native"], indirect=True)


@pytest.fixture
def pt(mount_factory):
    """A native mount with passthrough on, 8 MiB parts."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "0")
    assert m.status()["passthrough"] is True
    return m


def test_a_new_file_is_written_by_the_kernel_and_lands_byte_identical_in_s3(pt, s3):
    data = random.randbytes(40 * MiB + 4321)
    with open(pt.path / "model.bin", "wb") as f:
        for i in range(0, len(data), MiB):
            f.write(data[i:i + MiB])
    c = pt.counters()
    assert c["passthrough_opens"] == 1
    assert c.get("write_requests", 0) == 0  # not one WRITE crossed into the daemon
    assert os.stat(pt.path / "model.bin").st_size == len(data)
    flushed(pt)
    assert body(s3, "model.bin") == data


def test_random_overwrites_of_streamed_parts_reach_s3(pt, s3):
    data = bytearray(random.randbytes(33 * MiB))
    (pt.path / "f").write_bytes(data)
    flushed(pt)
    rnd = random.Random(7)
    with open(pt.path / "f", "r+b") as f:  # fully cached and clean: passthrough again
        for _ in range(20):
            off = rnd.randrange(len(data) - 5000)
            piece = rnd.randbytes(rnd.randrange(1, 5000))
            f.seek(off)
            f.write(piece)
            data[off:off + len(piece)] = piece
        f.seek(len(data))
        f.write(b"tail")
        data += b"tail"
    assert pt.counters()["passthrough_opens"] == 2
    assert pt.counters().get("write_requests", 0) == 0
    flushed(pt)
    assert body(s3, "f") == bytes(data)


def test_parts_go_up_while_the_writer_still_writes_and_only_once(pt, s3):
    data = random.randbytes(44 * MiB)  # 6 parts of 8 MiB, the last one short
    with open(pt.path / "stream.bin", "wb") as f:
        f.write(data[:40 * MiB])
        f.flush()
        # the watcher sees the file grow: the 4 parts wholly behind its end go up now
        assert wait_for(lambda: pt.counters().get("parts_uploaded", 0) >= 4, 30)
        f.write(data[40 * MiB:])
    flushed(pt)
    assert body(s3, "stream.bin") == data
    assert pt.counters()["parts_uploaded"] == 6  # each part once


def test_writers_that_keep_every_core_busy_leave_their_parts_for_later(mount_factory, s3):
    """Streaming needs CPU, and the writers come first: while the passthrough writers alone
    keep every core busy, no part goes up (here the daemon counts on one core, and one
    writer at 320 MiB/s keeps it busy); once the writer pauses, the parts go up while the
    file is still open."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "0", "--test-hook", "cores=1")
    pieces = [random.randbytes(8 * MiB) for _ in range(24)]
    with open(m.path / "busy.bin", "wb", buffering=0) as f:
        began = time.monotonic()
        for i, piece in enumerate(pieces):  # 8 MiB every 25 ms: 5 x BUSY_WRITER
            f.write(piece)
            time.sleep(max(0.0, began + (i + 1) * 0.025 - time.monotonic()))
        held = m.counters()
        # (a look in which the other test worker kept the writer below BUSY_WRITER lets
        # that moment's parts go: CI-like runs at 160 MiB/s saw 3 and 9 of 24; without
        # WritersFirst all but the last go)
        assert held.get("parts_uploaded", 0) <= len(pieces) // 2, held
        assert held.get("streaming_held", 0) > 0
        assert wait_for(lambda: m.counters().get("parts_uploaded", 0) >= 20, 30)
    flushed(m)
    assert body(s3, "busy.bin") == b"".join(pieces)
    assert m.counters()["parts_uploaded"] == 24  # each part once


def test_a_file_whose_size_was_set_first_streams_only_what_was_written(pt, s3):
    """safetensors sets the size first (ftruncate) and fills the file from the start:
    the watcher took every chunk behind the size for written, streamed zeros, and sent
    each part again at the commit (some S3 refused: changed while being sent). Now only
    the chunks before the first hole go up while it writes."""
    data = random.randbytes(44 * MiB)  # 6 parts of 8 MiB, the last one short
    with open(pt.path / "preset.bin", "wb") as f:
        os.ftruncate(f.fileno(), len(data))
        time.sleep(0.5)  # the watcher sees the size: nothing of it is written
        f.write(data[:20 * MiB])
        f.flush()
        assert wait_for(lambda: pt.counters().get("parts_uploaded", 0) >= 2, 30)
        time.sleep(0.5)
        assert pt.counters().get("parts_uploaded", 0) == 2  # not the zeros past 20 MiB
        f.write(data[20 * MiB:])
    flushed(pt)
    assert body(s3, "preset.bin") == data
    assert pt.counters()["parts_uploaded"] == 6  # each part once


def test_a_flush_right_after_close_waits_for_what_the_daemon_learns_at_the_close(
        mount_factory, s3):
    """The kernel answers close() before the daemon hears of it, and the daemon learns
    what a passthrough writer wrote only then. DCP writes `.metadata.tmp`, fsyncs, closes,
    renames it and returns; a flush at once committed the file as the daemon knew it
    before the writes (an empty object) and returned 0: a cold load failed with EOFError.
    Here that take-over is slowed, so the flush comes in the middle of it."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "0", "--test-hook", "slow_take_over=2")
    small, large = random.randbytes(70_000), random.randbytes(20 * MiB)
    for name, data in (("ckpt/.metadata", small), ("ckpt/shard.distcp", large)):
        (m.path / "ckpt").mkdir(exist_ok=True)
        with open(m.path / f"{name}.tmp", "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        os.rename(m.path / f"{name}.tmp", m.path / name)
        flushed(m)
        assert body(s3, name) == data
    assert m.counters()["passthrough_opens"] == 2


def test_a_stat_right_after_close_gives_the_size_the_writer_left(mount_factory, s3):
    """After the last close, the daemon takes the writes over; a stat that came in
    meanwhile got the size the watcher had seen in the middle of the writes, and the
    kernel kept it (torch.save of 256 MiB, then stat: 234 MiB). Here the take-over is
    slowed, so the stat always comes in the middle of it."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "0", "--test-hook", "slow_take_over=2")
    first, rest = random.randbytes(3 * MiB), random.randbytes(5 * MiB + 17)
    with open(m.path / "model.pt", "wb", buffering=0) as f:
        f.write(first)
        time.sleep(0.5)  # the watcher sees the file 3 MiB long
        f.write(rest)
    time.sleep(0.5)  # the daemon has the release, and takes it over for 2 s
    assert os.stat(m.path / "model.pt").st_size == len(first) + len(rest)
    flushed(m)
    assert body(s3, "model.pt") == first + rest


def test_a_umount_right_after_close_commits_what_was_written(mount_factory, s3):
    """A umount right after the close ends the session while the daemon is still taking
    the last writer's release over; the requests under way are cancelled at the session's
    end. The take-over was cut with them, and the exit flush committed the file as the
    daemon knew it before (CI: 34 of 40 MiB in S3 after `umount`). It runs to its end
    now; here it is slowed, so the umount always comes in the middle of it."""
    m = mount_factory("--part-size", "8M", "--test-hook", "slow_take_over=2")
    pid = m.status()["pid"]
    data = random.randbytes(20 * MiB + 123)
    (m.path / "model.bin").write_bytes(data)
    proc = subprocess.run(["umount", str(m.path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 120), m.log_tail()
    m.pid = None
    assert body(s3, "model.bin") == data


def test_a_streamed_part_the_writer_changes_again_is_sent_again(pt, s3):
    data = bytearray(random.randbytes(30 * MiB))
    with open(pt.path / "header.bin", "wb") as f:
        f.write(data)
        f.flush()
        assert wait_for(lambda: pt.counters().get("parts_uploaded", 0) >= 3, 30)
        f.seek(100)  # as a saver that fills in a header at the end
        f.write(b"HEADER")
        data[100:106] = b"HEADER"
    flushed(pt)
    assert body(s3, "header.bin") == bytes(data)
    assert pt.counters()["parts_uploaded"] == 5  # 4 parts, the first one twice


def test_truncate_while_open_in_passthrough(pt, s3):
    with open(pt.path / "t", "wb") as f:
        f.write(random.randbytes(20 * MiB))
        f.truncate(9 * MiB + 7)
        f.seek(0)
        f.write(b"head")
        assert os.fstat(f.fileno()).st_size == 9 * MiB + 7
    expected = (pt.path / "t").read_bytes()
    assert len(expected) == 9 * MiB + 7 and expected[:4] == b"head"
    flushed(pt)
    assert body(s3, "t") == expected


def test_two_writers_and_a_reader_share_one_passthrough_file(pt, s3):
    a = open(pt.path / "shared", "w+b")  # noqa: SIM115
    b = open(pt.path / "shared", "r+b")  # noqa: SIM115
    a.write(b"A" * MiB)
    a.flush()
    b.seek(MiB)
    b.write(b"B" * MiB)
    b.flush()
    reader = open(pt.path / "shared", "rb")  # noqa: SIM115
    assert reader.read() == b"A" * MiB + b"B" * MiB  # sees both writers at once
    for f in (a, b, reader):
        f.close()
    assert pt.counters()["passthrough_opens"] == 3
    flushed(pt)
    assert body(s3, "shared") == b"A" * MiB + b"B" * MiB


def test_stat_while_writing_shows_the_size_the_kernel_wrote(pt):
    with open(pt.path / "growing", "wb") as f:
        f.write(b"x" * 3 * MiB)
        f.flush()
        assert os.stat(pt.path / "growing").st_size == 3 * MiB
        before = os.stat(pt.path / "growing").st_mtime_ns
        time.sleep(0.05)
        f.write(b"y")
        f.flush()
        st = os.stat(pt.path / "growing")
        assert st.st_size == 3 * MiB + 1
        assert st.st_mtime_ns > before


def test_shared_mmap_writes_reach_s3(pt, s3):
    (pt.path / "mm").write_bytes(bytes(2 * MiB))
    with open(pt.path / "mm", "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[100:105] = b"hello"
        mm[MiB:MiB + 5] = b"world"
        mm.flush()
    flushed(pt)
    got = body(s3, "mm")
    assert got[100:105] == b"hello" and got[MiB:MiB + 5] == b"world" and len(got) == 2 * MiB


def test_a_warm_file_is_read_by_the_kernel_without_requests(mount_factory, s3):
    data = random.randbytes(12 * MiB)
    s3.put("warm.bin", data, {})
    m = mount_factory("--part-size", "8M")
    assert (m.path / "warm.bin").read_bytes() == data  # cold: GETs, through the daemon
    before = m.counters()
    assert before.get("passthrough_opens", 0) == 0 and before["read_requests"] > 0
    assert (m.path / "warm.bin").read_bytes() == data  # every chunk cached: passthrough
    after = m.counters()
    assert after["passthrough_opens"] == 1
    assert after["read_requests"] == before["read_requests"]
    assert after["gets"] == before["gets"]


def test_kill9_in_the_middle_of_a_passthrough_write_loses_no_written_byte(pt, s3):
    """D21: the journal says `passthrough` before the open is answered; the next mount
    takes every byte of the cache file as dirty, also where S3 holds an older version."""
    data = bytearray(random.randbytes(20 * MiB + 5))
    (pt.path / "crash.bin").write_bytes(data)
    flushed(pt)  # committed: chunks the journal does not name would come from S3
    patch = random.randbytes(MiB)
    data[9 * MiB:10 * MiB] = patch
    data += b"appended"
    script = (f"import sys,time\nf=open({str(pt.path / 'crash.bin')!r},'r+b')\n"
              f"f.seek({9 * MiB})\nf.write(sys.stdin.buffer.read({MiB}))\n"
              f"f.seek({len(data) - 8})\nf.write(b'appended')\nf.flush()\n"
              "print('written',flush=True)\ntime.sleep(60)\n")
    writer = subprocess.Popen(["python3", "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        writer.stdin.write(patch)
        writer.stdin.close()
        assert writer.stdout.readline().strip() == b"written"
        pt.kill9()  # the writer still holds the file open
    finally:
        writer.kill()
        writer.wait()
    pt.start()
    assert pt.counters()["recovered_files"] == 1
    flushed(pt)
    assert body(s3, "crash.bin") == bytes(data)


def journal_rows(m) -> list[tuple[str, int]]:
    """(key, passthrough) of the files the journal holds pending."""
    with contextlib.closing(sqlite3.connect(m.cache_dir / "journal.db")) as db:
        return db.execute("SELECT key, passthrough FROM files ORDER BY key").fetchall()


def small_files(m, count: int) -> dict[str, bytes]:
    """`count` small files, each created, written and closed as a checkpoint's shards are."""
    written = {f"shard-{i}.bin": random.randbytes(1000 + i) for i in range(count)}
    (m.path / "shards").mkdir()
    for name, data in written.items():
        with open(m.path / "shards" / name, "wb") as f:
            f.write(data)
    return written


def test_a_small_file_created_in_passthrough_costs_one_journal_transaction(pt, s3):
    """Its row carries the passthrough flag from the create, with its first chunk dirty;
    neither the open nor the last close writes it again, and the commit drops it, flag
    and all."""
    before = pt.counters()
    written = small_files(pt, 20)
    after = pt.counters()
    assert after["passthrough_opens"] - before.get("passthrough_opens", 0) == 20
    assert after["intents_journalled"] - before.get("intents_journalled", 0) == 20
    assert after.get("write_requests", 0) == 0
    flushed(pt)
    assert journal_rows(pt) == []  # committed: no row kept for its flag
    for name, data in written.items():
        assert body(s3, f"shards/{name}") == data


def test_kill9_after_small_files_were_closed_in_passthrough_loses_nothing(mount_factory, s3,
                                                                        fault_proxy):
    """D21: the row written at the create, flagged, is all the journal holds of each file
    (size 0, the create's mtime); the next mount takes size and mtime from the cache file
    the kernel wrote, and commits every byte."""
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.fail = True  # nothing can reach S3 before the crash
    written = small_files(m, 8)
    seen = {name: os.stat(m.path / "shards" / name) for name in written}
    assert all(flag == 1 for _, flag in journal_rows(m))
    m.kill9()
    fault_proxy.fail = False
    m.start()
    assert m.counters()["recovered_files"] == len(written)
    for name, data in written.items():
        st = os.stat(m.path / "shards" / name)
        assert (st.st_size, st.st_mtime_ns) == (len(data), seen[name].st_mtime_ns)
    flushed(m)
    assert journal_rows(m) == []
    for name, data in written.items():
        assert body(s3, f"shards/{name}") == data
        assert os.stat(m.path / "shards" / name).st_mtime_ns == seen[name].st_mtime_ns


class _Writer(threading.Thread):
    """Writes `data` in 1 MiB pieces to `path` in this process (not the daemon), counting
    what its write()s returned."""

    def __init__(self, path, data: bytes) -> None:
        super().__init__(daemon=True)
        self.path, self.data, self.written, self.error = path, data, 0, None

    def run(self) -> None:
        try:
            with open(self.path, "wb") as f:
                for i in range(0, len(self.data), MiB):
                    self.written += f.write(self.data[i:i + MiB])
        except OSError as exc:
            self.error = exc


def _held_mount(mount_factory, fault_proxy):
    """A mount whose PUTs the proxy holds (until `release_keys`): S3 takes nothing."""
    fault_proxy.parse_requests = True
    fault_proxy.delay_requests(lambda method, target: method == "PUT")
    return mount_factory("--part-size", "8M", "--max-dirty", "16M", "--cache-size", "64M",
                         "--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)


def test_a_passthrough_writer_waits_at_max_dirty_until_uploads_drain(mount_factory,
                                                                     fault_proxy, s3):
    """The daemon never sees a passthrough write, yet the writer is held at --max-dirty,
    as one through the daemon is: the kernel asks the daemon (fanotify) before each write
    of a file near the bound. With S3 taking nothing, the writer stops within a write of
    16 MiB; once S3 takes the parts it goes on, and S3 gets every byte."""
    m = _held_mount(mount_factory, fault_proxy)
    data = random.randbytes(48 * MiB)
    writer = _Writer(m.path / "big.bin", data)
    writer.start()
    time.sleep(3)
    assert writer.is_alive() and writer.written <= 17 * MiB, writer.written
    c = m.counters()
    assert c["passthrough_opens"] == 1 and c["passthrough_writes_held"] >= 1
    assert m.status()["dirty_bytes"] <= 17 * MiB
    fault_proxy.release_keys()
    writer.join(60)
    assert not writer.is_alive() and writer.error is None and writer.written == len(data)
    flushed(m)
    assert body(s3, "big.bin") == data


def test_a_held_passthrough_writer_goes_on_when_its_daemon_is_killed(mount_factory,
                                                                   fault_proxy, s3):
    """A writer held at --max-dirty is never left stuck by a daemon that dies: the kernel
    lets its held write go when the daemon's fanotify group goes (then the dead
    connection refuses the next write or the close, as after any crash), and every byte
    acknowledged before reaches S3 through the next mount's recovery (D21)."""
    m = _held_mount(mount_factory, fault_proxy)
    data = random.randbytes(32 * MiB)
    writer = _Writer(m.path / "big.bin", data)
    writer.start()
    assert wait_for(lambda: m.counters().get("passthrough_writes_held", 0) >= 1, 10)
    m.kill9()
    writer.join(20)
    assert not writer.is_alive(), "the writer is still held after its daemon died"
    assert writer.error is None or writer.error.errno in (errno.ENOTCONN, errno.ECONNABORTED), \
        writer.error
    acknowledged = writer.written
    assert acknowledged >= 8 * MiB
    fault_proxy.release_keys()
    m.start()
    flushed(m)
    landed = body(s3, "big.bin")
    assert len(landed) >= acknowledged and landed[:acknowledged] == data[:acknowledged]


def test_eviction_leaves_a_passthrough_file_alone(mount_factory, s3):
    held = random.randbytes(16 * MiB)
    s3.put("held.bin", held, {})
    for i in range(3):
        s3.put(f"other{i}.bin", random.randbytes(16 * MiB), {})
    m = mount_factory("--part-size", "8M", "--cache-size", "40M", "--max-dirty", "16M")
    assert (m.path / "held.bin").read_bytes() == held
    with open(m.path / "held.bin", "rb") as f:  # cached: passthrough
        assert m.counters()["passthrough_opens"] == 1
        for i in range(3):  # 48 MiB more through a 40 MiB cache: evictions
            (m.path / f"other{i}.bin").read_bytes()
        assert m.counters()["cache_evictions"] > 0
        gets = m.counters()["gets"]
        assert f.read() == held  # from the cache file, whole: no hole was punched
        assert m.counters()["gets"] == gets


def test_status_says_which_session_and_whether_passthrough_is_on(mount_factory):
    native = mount_factory(name="native")
    st = native.status()
    assert st["fuse_session"] == "native" and st["passthrough"] is True
    classic = mount_factory("--fuse-session", "pyfuse3", name="classic")
    st = classic.status()
    assert st["fuse_session"] == "pyfuse3" and st["passthrough"] is False


def test_without_cap_sys_admin_the_native_session_serves_without_passthrough_saying_why(
        s3_server, bucket, s3, tmp_path, fuse_session):
    """In a user namespace the daemon is root there but has no CAP_SYS_ADMIN where the
    kernel checks backing files: the native session mounts, every open goes through the
    daemon, and status and log say why."""
    mnt, status_file = tmp_path / "mnt", tmp_path / "status.json"
    mnt.mkdir()
    script = f"""
set -e
trap '{CLI} unmount {mnt} >/dev/null 2>&1 || true' EXIT
{CLI} mount s3://{bucket} {mnt} --endpoint-url {s3_server.endpoint_url} \\
    --cache-dir {tmp_path / 'cache'} --log-file {tmp_path / 'daemon.log'} \
    --fuse-session {fuse_session}
{CLI} status {mnt} --json > {status_file}
printf 'through the daemon' > {mnt}/f
cat {mnt}/f > {tmp_path / 'read-back'}
{CLI} status {mnt} --json > {tmp_path / 'after.json'}
{CLI} flush {mnt}
"""
    pid = None
    try:
        proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               script], capture_output=True, text=True, timeout=120)
        if status_file.exists() and status_file.read_text():
            pid = json.loads(status_file.read_text())["pid"]
        assert proc.returncode == 0, proc.stderr
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    status = json.loads(status_file.read_text())
    assert status["fuse_session"] == "native"
    assert (status["passthrough"], status["passthrough_reason"]) == (
        False, "the kernel refused a backing file: Operation not permitted")
    after = json.loads((tmp_path / "after.json").read_text())["counters"]
    assert after.get("passthrough_opens", 0) == 0 and after["write_requests"] >= 1
    assert (tmp_path / "read-back").read_text() == "through the daemon"
    assert body(s3, "f") == b"through the daemon"
    assert "passthrough off (the kernel refused" in (tmp_path / "daemon.log").read_text()
