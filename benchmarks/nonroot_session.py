"""Which FUSE session `auto` should choose for a user other than root: the native one
without passthrough (the kernel lends backing files to CAP_SYS_ADMIN only) against pyfuse3.

`python -m benchmarks.nonroot_session [--files 2] [--mib 256] [--rounds 3]` (root): a
throwaway user (benchmarks/asuser.py) mounts an embedded SeaweedFS bucket on 127.0.0.1
once per session per round, in alternating order, and as that user: writes every file in
1 MiB writes (timed to the last close), `flush`es, reads every file back in 1 MiB reads
after the page cache was dropped (warm: from the cache dir, through the daemon), then
mounts again with an empty cache dir and reads every file once more (cold: ranged GETs).
`--read-ahead-kb 1024` has root raise each mount's kernel read-ahead, as root's own
daemon does (a user's daemon cannot: it is a sysfs file of root's).
It prints per round each phase's rate and the daemon's CPU seconds, and the medians of the
per-round native / pyfuse3 ratios (rate; CPU)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.asuser import User, fuse_device_for, throwaway_user, wait_gone
from lakefs_mount.ops.mountpoint import set_kernel_readahead
from lakefs_mount.s3.embedded import EmbeddedS3

MiB = 1024 * 1024
SESSIONS = ("native", "pyfuse3")
WORKLOAD = """
import os, sys, time
mnt, files, mib, phase = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
block, total, t0 = os.urandom(1 << 20), 0, time.perf_counter()
for i in range(files):
    path = f"{mnt}/ckpt{i}.bin"
    if phase == "write":
        with open(path, "wb", buffering=0) as f:
            for _ in range(mib):
                total += f.write(block)
    else:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
print(total, time.perf_counter() - t0)
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Mount:
    """One mount by the user with a cache dir of its own; unmounted on exit."""

    def __init__(self, user: User, server: EmbeddedS3, bucket: str, session: str,
                 cache: Path, read_ahead_kb: int) -> None:
        self.user, self.cache = user, cache
        proc = user.cli("mount", f"s3://{bucket}", str(user.mnt), "--endpoint-url",
                        server.endpoint_url, "--fuse-session", session, "--cache-dir",
                        str(cache))
        if proc.returncode != 0:
            raise RuntimeError(f"mount ({session}) failed: {proc.stderr}")
        status = user.status()
        self.pid = int(status["pid"])
        assert status["fuse_session"] == session, status
        self.passthrough = status["passthrough"]
        if read_ahead_kb:  # what root's daemon does to its own mount, done by root here
            assert set_kernel_readahead(user.mnt, read_ahead_kb)

    def phase(self, files: int, mib: int, phase: str) -> tuple[float, float]:
        """(GiB/s, daemon CPU seconds) of one phase of the workload, run as the user."""
        cpu0 = _cpu_seconds(self.pid)
        proc = self.user.run([self.user.python, "-c", WORKLOAD, str(self.user.mnt),
                              str(files), str(mib), phase], timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{phase} failed: {proc.stderr}")
        total, seconds = proc.stdout.split()
        assert int(total) == files * mib * MiB, (phase, total)
        return int(total) / float(seconds) / 1024**3, _cpu_seconds(self.pid) - cpu0

    def close(self) -> None:
        proc = self.user.cli("unmount", str(self.user.mnt), timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"unmount failed: {proc.stderr}")
        wait_gone([self.pid], 120)
        shutil.rmtree(self.cache, ignore_errors=True)


def _drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _round(user: User, server: EmbeddedS3, session: str, args: argparse.Namespace,
           n: int) -> dict[str, tuple[float, float]]:
    files, mib = args.files, args.mib
    bucket = f"nonroot-{session}-{n}"
    server.create_bucket(bucket)
    out = {}
    m = _Mount(user, server, bucket, session, user.home / f"cache-{session}-{n}",
               args.read_ahead_kb)
    try:
        out["write"] = m.phase(files, mib, "write")
        flush = user.cli("flush", str(user.mnt), timeout=1800)
        if flush.returncode != 0:
            raise RuntimeError(f"flush failed: {flush.stderr}")
        _drop_page_cache()
        out["warm read"] = m.phase(files, mib, "read")
    finally:
        m.close()
    m = _Mount(user, server, bucket, session, user.home / f"cold-{session}-{n}",
               args.read_ahead_kb)
    try:
        _drop_page_cache()
        out["cold read"] = m.phase(files, mib, "read")
    finally:
        m.close()
    print(f"  {session} (passthrough {m.passthrough}): " + "; ".join(
        f"{k} {v[0]:.2f} GiB/s, {v[1]:.2f} s CPU" for k, v in out.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--read-ahead-kb", type=int, default=0,
                        help="root sets the mount's kernel read-ahead (a user's daemon "
                        "cannot; 0: the kernel's default stays, as for a user's mount)")
    args = parser.parse_args(argv)
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # the server checks none
        os.environ.setdefault(name, value)
    work = Path(tempfile.mkdtemp(prefix="nonroot-session-", dir="/var/tmp"))
    server = EmbeddedS3(work / "s3").start(timeout=60)
    rows: list[dict[str, dict[str, tuple[float, float]]]] = []
    started = time.monotonic()
    try:
        with throwaway_user() as user, fuse_device_for(user.uid):
            for n in range(args.rounds):
                print(f"round {n + 1}:", flush=True)
                order = SESSIONS if n % 2 == 0 else SESSIONS[::-1]
                rows.append({s: _round(user, server, s, args, n)
                             for s in order})
    finally:
        server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    print(f"medians of per-round ratios native / pyfuse3 ({args.files} x {args.mib} MiB, "
          f"{args.rounds} rounds, {time.monotonic() - started:.0f} s):")
    for phase in rows[0]["native"]:
        rate = statistics.median(r["native"][phase][0] / r["pyfuse3"][phase][0] for r in rows)
        cpu = statistics.median(r["native"][phase][1] / r["pyfuse3"][phase][1] for r in rows)
        print(f"  {phase}: rate {rate:.2f}, daemon CPU {cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
