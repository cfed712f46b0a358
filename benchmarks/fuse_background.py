"""Warm restore through one mount with the kernel's FUSE `max_background` switched between
reads, against raw disk reads of the same bytes in the same round.

Why one mount: two mounts alive at once are no fair A/B here. On the development VM the
one mounted second read its warm cache 15-20 % slower whatever code it ran (control: the
same build in both places), so the knob is switched on a single mount, in alternating
order each round, with the page cache dropped before every read.

8 objects of --file-mib MiB, made with boto3; a cold read fills the cache; then --runs
rounds of: raw disk read, and one warm read per value (checksummed against the bodies).
Usage: python benchmarks/fuse_background.py [--file-mib 256] [--runs 4] [--values 12,64]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import s3_config  # noqa: E402
from benchmarks.targets import LakefsTarget  # noqa: E402
from benchmarks.workers import Result, run_parallel, span  # noqa: E402
from lakefs_mount.embedded import EmbeddedS3  # noqa: E402
from lakefs_mount.mountpoint import find_mount, fuse_connection  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
FILES = 8  # one reader process per file, as in the suite's restore


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def body(i: int, size: int) -> bytes:
    piece = random.Random(i).randbytes(16 * MiB)
    return (piece * -(-size // len(piece)))[:size]


def timed_read(paths: list[Path], crcs: list[int]) -> float:
    """GiB/s of FILES parallel readers, each checked against what was uploaded."""
    drop_caches()
    results: list[Result] = run_parallel("read", [(str(p), MiB) for p in paths])
    for p, r, want in zip(paths, results, crcs, strict=True):
        if r.crc != want:
            raise SystemExit(f"{p}: CRC-32 {r.crc:#x}, want {want:#x}")
    t0, t1, n = span(results)
    return n / GiB / (t1 - t0)


def set_background(conn: Path, requests: int) -> None:
    (conn / "max_background").write_text(f"{requests}\n")
    (conn / "congestion_threshold").write_text(f"{requests * 3 // 4}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--values", default="12,64", help="max_background values to compare")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/lakefs-mount-fusebg"))
    a = ap.parse_args()
    values = [int(v) for v in a.values.split(",")]
    size = a.file_mib * MiB
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    shutil.rmtree(a.workdir, ignore_errors=True)
    a.workdir.mkdir(parents=True)
    s3 = EmbeddedS3(a.workdir / "seaweedfs").start(timeout=120)
    target = None
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
                              config=s3_config(8))
        client.create_bucket(Bucket="restore")
        raw, crcs = [], []
        for i in range(FILES):
            data = body(i, size)
            client.put_object(Bucket="restore", Key=f"ckpt/f{i}", Body=data)
            (a.workdir / f"raw{i}").write_bytes(data)
            raw.append(a.workdir / f"raw{i}")
            crcs.append(zlib.crc32(data))
        target = LakefsTarget(a.workdir / "mount", s3.endpoint_url, "restore", "uring")
        target.start()
        entry = find_mount(target.path)
        assert entry is not None
        conn = fuse_connection(entry)
        files = [target.path / "ckpt" / f"f{i}" for i in range(FILES)]
        print(f"{FILES} x {a.file_mib} MiB, cold read {timed_read(files, crcs):.3f} GiB/s")
        time.sleep(6)  # fetched chunks are written back within 5 s (cache FRESH_FOR)
        rates: dict[int, list[float]] = {v: [] for v in values}
        ratios: dict[int, list[float]] = {v: [] for v in values}
        for r in range(a.runs):
            disk = timed_read(raw, crcs)
            line = f"round {r + 1}: raw disk {disk:.3f}"
            for v in values if r % 2 == 0 else values[::-1]:
                set_background(conn, v)
                rates[v].append(timed_read(files, crcs))
                ratios[v].append(rates[v][-1] / disk)
                line += f" | max_background {v}: {rates[v][-1]:.3f}"
            print(line + " GiB/s", flush=True)
        first = values[0]
        for v in values:
            pairs = [x / y for x, y in zip(rates[v], rates[first], strict=True)]
            print(f"  max_background {v}: median {statistics.median(rates[v]):.3f} GiB/s, "
                  f"{statistics.median(ratios[v]):.2f} x raw disk, "
                  f"{statistics.median(pairs):.2f} x max_background {first} "
                  f"(faster or equal in {sum(p >= 1 for p in pairs)} of {len(pairs)} rounds)")
    finally:
        if target is not None:
            target.stop()
        s3.stop()
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
