"""FUSE_INTERRUPT in the native session: a process that gets a signal (or is killed) while
its request waits on S3 is answered at once, and the daemon goes on serving (real mount,
real SeaweedFS behind a fault proxy that holds every request: `hang`).

Without interrupts a killed process waits in the kernel (D state) for the reply, which
a stuck S3 holds for as long as its connection lives. Page-cache reads are sent by the
kernel as background requests it never interrupts (the killed reader stops waiting for
the page by itself); a reader of a page it maps with MADV_RANDOM sends a READ of its own,
which the kernel interrupts, like a lookup."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.mount.test_posix import wait_for

MiB = 1024 * 1024
PROMPTLY = 5.0  # seconds: S3 is held for ever, so anything that returns was interrupted
pytestmark = pytest.mark.parametrize("fuse_session", ["native"], indirect=True)

MMAP_READER = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_RANDOM)  # no readahead: the fault sends a READ and waits for it
    print("mapped", flush=True)
    sys.stdin.readline()  # every reader has opened: an open after a fault could wait
    print("faulting", flush=True)  # for the faulting READ (the kernel drops the pages)
    m[len(m) // 2]
"""

ALARM = """
import os, signal, sys, time
class Alarm(Exception):
    pass
def ring(signum, frame):
    raise Alarm
signal.signal(signal.SIGALRM, ring)
"""

STAT_WITH_ALARM = ALARM + """
signal.setitimer(signal.ITIMER_REAL, 1.0)
started = time.monotonic()
try:
    os.stat(sys.argv[1])
    print("answered", flush=True)
except Alarm:
    print(f"interrupted after {time.monotonic() - started:.2f}", flush=True)
"""


def _child(script: str, path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _fault(readers: list[subprocess.Popen]) -> None:
    """Once every reader has opened and mapped the file, all of them fault."""
    for r in readers:
        assert r.stdout is not None and r.stdout.readline() == "mapped\n"
    for r in readers:
        assert r.stdin is not None
        r.stdin.write("go\n")
        r.stdin.flush()
    for r in readers:
        assert r.stdout is not None and r.stdout.readline() == "faulting\n"


def dies_at_once_when_killed(proc: subprocess.Popen) -> None:
    """`proc`, waiting on the daemon, dies promptly of SIGKILL (not held in D state)."""
    assert proc.poll() is None
    killed_at = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert time.monotonic() - killed_at < PROMPTLY


def _healthy(m, name: str, data: bytes) -> None:
    """S3 back: the daemon answers status and serves the file whole."""
    assert m.status()["fuse_session"] == "native"
    assert (m.path / name).read_bytes() == data
    log = m.log_file.read_text()
    assert "Traceback" not in log and "ERROR" not in log


def test_a_reader_killed_while_s3_holds_its_read_dies_at_once_and_the_next_read_is_served(
        mount_factory, s3, fault_proxy):
    data = random.randbytes(4 * MiB)
    s3.put("cold.bin", data, {})
    m = mount_factory("--metadata-ttl", "600", "--read-ahead", "0",
                      endpoint_url=fault_proxy.endpoint_url)
    assert os.stat(m.path / "cold.bin").st_size == len(data)  # looked up while S3 answers
    fault_proxy.hang = True
    before = m.counters().get("read_requests", 0)
    reader = _child(MMAP_READER, str(m.path / "cold.bin"))
    try:
        _fault([reader])
        assert wait_for(lambda: m.counters().get("read_requests", 0) > before)
        time.sleep(0.3)  # the READ waits on the held GET
        dies_at_once_when_killed(reader)
    finally:
        fault_proxy.hang = False  # a reader left in D state is answered, and dies
        reader.kill()
        reader.wait(timeout=120)
    assert "interrupt of request" in m.log_tail(200)
    _healthy(m, "cold.bin", data)


def test_a_lookup_held_by_a_stuck_s3_listing_returns_when_the_process_gets_a_signal(
        mount_factory, s3, fault_proxy):
    """The listing of a directory never listed is held while S3 answers everything else
    (a lookup there waits for it as long as S3 shows signs of life: issue 30; in a full
    black hole it answers within a moment)."""
    s3.put("d/late.bin", b"listed late", {})
    fault_proxy.parse_requests = True
    m = mount_factory("--metadata-ttl", "0.5", endpoint_url=fault_proxy.endpoint_url)
    os.listdir(m.path)
    time.sleep(1.5)  # past the TTL and the kernel's timeouts: the lookup lists the root
    fault_proxy.hold_requests(lambda method, target: "list-type=2" in target
                              and "prefix=d%2F" in target)
    prober = _child(STAT_WITH_ALARM, str(m.path / "d" / "late.bin"))
    try:
        out, _ = prober.communicate(timeout=1.0 + PROMPTLY)
    finally:
        fault_proxy.hold_requests(None)
        prober.kill()
        prober.wait(timeout=120)
    assert out.startswith("interrupted after"), out
    _healthy(m, "d/late.bin", b"listed late")


def test_readers_sharing_one_held_fetch_are_interrupted_each_and_the_file_is_then_served(
        mount_factory, s3, fault_proxy):
    """Four readers wait on one GET (shared): each is cancelled alone, the GET goes on
    for the others, and once S3 is back the file is served whole."""
    data = random.randbytes(2 * MiB)
    s3.put("many.bin", data, {})
    m = mount_factory("--metadata-ttl", "600", "--read-ahead", "0",
                      endpoint_url=fault_proxy.endpoint_url)
    assert os.stat(m.path / "many.bin").st_size == len(data)
    fault_proxy.hang = True
    readers = [_child(MMAP_READER, str(m.path / "many.bin")) for _ in range(4)]
    try:
        _fault(readers)
        time.sleep(0.5)
        killed_at = time.monotonic()
        for r in readers:
            r.send_signal(signal.SIGKILL)
        for r in readers:
            r.wait(timeout=30)
        assert time.monotonic() - killed_at < PROMPTLY
    finally:
        fault_proxy.hang = False  # a reader left in D state is answered, and dies
        for r in readers:
            r.kill()
            r.wait(timeout=120)
    _healthy(m, "many.bin", data)
