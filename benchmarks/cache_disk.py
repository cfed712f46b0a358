"""What the cache disk allows a cold restore: its O_DIRECT bandwidth when every byte
fetched from S3 is written and then read back, against writes alone and reads alone.

A cold restore through a write-back cache writes each fetched chunk to the cache disk
and serves the reader from there, so the disk carries the checkpoint twice at once. On
a disk whose bandwidth is shared between reads and writes (most cloud volumes), the
mixed rate, not the GET rate, bounds the restore. Measured like the daemon does it:
16 writers (a cold restore's GETs in flight) and 8 readers (its readers), 1 MiB
O_DIRECT requests, page cache dropped between runs; median of --runs.

Usage: python benchmarks/cache_disk.py [--dir DIR] [--per-file-mib N] [--runs N]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
WRITERS = 16
READERS = 8


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:  # not root: O_DIRECT reads do not use the page cache anyway
        pass


def _write(path: Path, size: int, piece: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    buf = mmap.mmap(-1, len(piece))  # O_DIRECT needs aligned memory
    buf[:] = piece
    try:
        for off in range(0, size, len(piece)):
            os.pwrite(fd, buf, off)
    finally:
        os.close(fd)
        buf.close()


def _read(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)
    got = 0
    try:
        while (n := os.preadv(fd, [buf], got)) > 0:
            got += n
    finally:
        os.close(fd)
        buf.close()
    return got


def one_run(root: Path, per_file: int, writes: bool, reads: bool) -> tuple[float, float]:
    """(write GiB/s, read GiB/s) of one run; the read files exist beforehand."""
    piece = os.urandom(MiB)
    drop_page_cache()
    with ThreadPoolExecutor(WRITERS + READERS) as pool:
        start = time.monotonic()
        jobs = []
        if writes:
            jobs += [pool.submit(_write, root / f"w{i}", per_file // 2, piece)
                     for i in range(WRITERS)]
        if reads:
            jobs += [pool.submit(_read, root / f"r{i}") for i in range(READERS)]
        for job in jobs:
            job.result()
        elapsed = time.monotonic() - start
    written = WRITERS * (per_file // 2) if writes else 0
    read = READERS * per_file if reads else 0
    return written / GiB / elapsed, read / GiB / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None,
                    help="a directory on the cache disk (default: a temporary one in "
                         "/var/tmp)")
    ap.add_argument("--per-file-mib", type=int, default=256,
                    help="MiB each reader reads (writers write half as much: the same "
                         "total)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cache-disk-", dir=args.dir or "/var/tmp"))
    per_file = args.per_file_mib * MiB
    try:
        for i in range(READERS):
            _write(root / f"r{i}", per_file, os.urandom(MiB))
        results: dict[str, list[tuple[float, float]]] = {"writes": [], "reads": [],
                                                          "both": []}
        for _ in range(args.runs):
            results["writes"].append(one_run(root, per_file, True, False))
            results["reads"].append(one_run(root, per_file, False, True))
            results["both"].append(one_run(root, per_file, True, True))
        print(f"cache disk under {root.parent}, {WRITERS} writers and {READERS} readers, "
              f"1 MiB O_DIRECT requests, median of {args.runs}:")
        w = statistics.median(r[0] for r in results["writes"])
        r = statistics.median(r[1] for r in results["reads"])
        bw = statistics.median(r[0] for r in results["both"])
        br = statistics.median(r[1] for r in results["both"])
        print(f"  writes alone        {w:6.2f} GiB/s")
        print(f"  reads alone         {r:6.2f} GiB/s")
        print(f"  both at once        {bw:6.2f} GiB/s written, {br:.2f} GiB/s read")
        print(f"  => a cold restore that writes every byte and reads it back tops out "
              f"near {min(bw, br):.2f} GiB/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
