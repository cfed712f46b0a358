"""Write throughput of the cache-file I/O engines vs. a raw os.pwrite thread loop.

8 concurrent writers, each filling its own file with 1 MiB writes; median of 3 runs.
Usage: python benchmarks/uring_engines.py [--quick] [--per-task-mib N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

import trio

from lakefs_mount.uring import open_engine

MiB = 1 << 20


def _files(root: str, tasks: int) -> list[int]:
    return [os.open(os.path.join(root, f"w{i}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            for i in range(tasks)]


def _cleanup(fds: list[int], root: str) -> None:
    for fd in fds:
        os.close(fd)
    for name in os.listdir(root):
        os.unlink(os.path.join(root, name))


def run_engine(kind: str, root: str, tasks: int, per_task: int, chunk: int, fsync: bool) -> float:
    buf = os.urandom(chunk)
    fds = _files(root, tasks)

    async def main() -> float:
        async with open_engine(kind) as engine:
            async def writer(fd: int) -> None:
                for off in range(0, per_task, chunk):
                    await engine.write(fd, buf, off)
                if fsync:
                    await engine.fsync(fd)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for fd in fds:
                    nursery.start_soon(writer, fd)
            return time.perf_counter() - start

    try:
        return trio.run(main)
    finally:
        _cleanup(fds, root)


def run_raw(root: str, tasks: int, per_task: int, chunk: int, fsync: bool) -> float:
    buf = os.urandom(chunk)
    fds = _files(root, tasks)

    def writer(fd: int) -> None:
        for off in range(0, per_task, chunk):
            os.pwrite(fd, buf, off)
        if fsync:
            os.fsync(fd)

    threads = [threading.Thread(target=writer, args=(fd,)) for fd in fds]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    _cleanup(fds, root)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="256 MiB in total instead of 4 GiB")
    ap.add_argument("--per-task-mib", type=int, default=None)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fsync", action="store_true", help="fsync each file at the end")
    ap.add_argument("--dir", default=None, help="scratch dir (default: a temp dir)")
    args = ap.parse_args()
    per_task_mib = args.per_task_mib or (256 // args.tasks if args.quick else 512)
    per_task, chunk = per_task_mib * MiB, args.chunk_kib * 1024
    root = tempfile.mkdtemp(prefix="uring-bench-", dir=args.dir)
    same = os.stat(root).st_dev == os.stat("/work").st_dev if os.path.exists("/work") else None
    total_gib = per_task * args.tasks / (1 << 30)
    print(f"{args.tasks} writers x {per_task_mib} MiB in {args.chunk_kib} KiB writes "
          f"({total_gib:.2f} GiB/run, median of {args.runs}) in {root} "
          f"(same disk as /work: {same})")
    try:
        results: dict[str, float] = {}
        for name in ("uring", "threads", "raw-pwrite-threads"):
            times = []
            for _ in range(args.runs):
                if name == "raw-pwrite-threads":
                    times.append(run_raw(root, args.tasks, per_task, chunk, args.fsync))
                else:
                    times.append(run_engine(name, root, args.tasks, per_task, chunk, args.fsync))
            results[name] = total_gib / statistics.median(times)
        raw = results["raw-pwrite-threads"]
        for name, gibs in results.items():
            print(f"{name:>20}: {gibs:6.2f} GiB/s  ({gibs / raw:4.2f}x raw pwrite)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
