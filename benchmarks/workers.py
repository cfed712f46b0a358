"""Process-level workers of the benchmark suite: writers, readers, ranged-GET readers,
small-file writers/readers and their boto3 PutObject/GetObject counterparts.

Every worker runs in its own process (spawned, so no locks or threads are inherited from
the driver), waits on a shared barrier, then does the timed work; it reports
(start, end, bytes, crc32) with CLOCK_MONOTONIC times, which are comparable across
processes on Linux. The aggregate throughput is total bytes / (last end - first start).

Data is incompressible and deterministic: writer i fills its file with a pool of
`POOL_BYTES` random bytes from `random.Random(seed)`, generated once per process before
the barrier and cycled in 1 MiB write() calls. The expected CRC-32 of every file is
computed by the writer after its timed section, so restores can be verified.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.s3config import s3_config

MiB = 1 << 20
POOL_BYTES = 16 * MiB


@dataclass
class Result:
    start: float
    end: float
    nbytes: int
    crc: int
    extra: dict[str, Any]


def make_pool(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(min(size, POOL_BYTES))


def expected_crc(pool: bytes, size: int, chunk: int) -> int:
    crc = 0
    off = 0
    while off < size:
        n = min(chunk, size - off)
        start = off % len(pool)
        piece = pool[start:start + n]
        if len(piece) < n:  # chunk straddles the end of the pool
            piece = piece + pool[:n - len(piece)]
        crc = zlib.crc32(piece, crc)
        off += n
    return crc


def _write_one(barrier: Any, path: str, size: int, chunk: int, seed: int, fsync: bool,
               checksum: bool) -> Result:
    pool = make_pool(seed, size)
    views = memoryview(pool + pool[:chunk])  # wrap-around slices without copies
    barrier.wait()
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < size:
            n = min(chunk, size - off)
            p = off % len(pool)
            written = os.write(fd, views[p:p + n])
            if written != n:
                raise OSError(f"short write to {path}: {written} of {n}")
            off += n
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    end = time.monotonic()
    crc = expected_crc(pool, size, chunk) if checksum else 0
    return Result(start, end, size, crc, {})


def _read_crc(path: str, view: memoryview) -> tuple[int, int]:
    """Read `path` to EOF in len(view)-sized reads: its CRC-32 and size."""
    crc = total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [view]):
            crc = zlib.crc32(view[:n], crc)
            total += n
    finally:
        os.close(fd)
    return crc, total


def _read_one(barrier: Any, path: str, chunk: int) -> Result:
    barrier.wait()
    start = time.monotonic()
    crc, total = _read_crc(path, memoryview(bytearray(chunk)))
    return Result(start, time.monotonic(), total, crc, {})


def _get_one(barrier: Any, endpoint: str, bucket: str, key: str, size: int, part: int,
             window: int) -> Result:
    """Parallel ranged GETs of one object (`window` in flight), checksummed in order."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=s3_config(window + 2))
    ranges = [(o, min(o + part, size) - 1) for o in range(0, size, part)]

    def fetch(rng: tuple[int, int]) -> bytes:
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={rng[0]}-{rng[1]}")
        return resp["Body"].read()

    client.head_bucket(Bucket=bucket)  # connection set up outside the timed section
    barrier.wait()
    start = time.monotonic()
    crc = 0
    total = 0
    with ThreadPoolExecutor(window) as pool:
        futures = [pool.submit(fetch, r) for r in ranges[:window]]
        nxt = window
        while futures:
            data = futures.pop(0).result()
            if nxt < len(ranges):
                futures.append(pool.submit(fetch, ranges[nxt]))
                nxt += 1
            crc = zlib.crc32(data, crc)
            total += len(data)
    return Result(start, time.monotonic(), total, crc, {})


def _small_files(barrier: Any, directory: str, names: Sequence[str], size: int,
                 seed: int) -> Result:
    data = random.Random(seed).randbytes(size)
    barrier.wait()
    start = time.monotonic()
    for name in names:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    return Result(start, time.monotonic(), size * len(names), zlib.crc32(data),
                  {"files": len(names)})


def _put_small(barrier: Any, endpoint: str, bucket: str, keys: Sequence[str], size: int,
               seed: int, threads: int) -> Result:
    import boto3
    data = random.Random(seed).randbytes(size)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=s3_config(threads + 2))
    client.head_bucket(Bucket=bucket)
    barrier.wait()
    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=data), keys))
    return Result(start, time.monotonic(), size * len(keys), zlib.crc32(data),
                  {"files": len(keys)})


def small_object(pool: bytes, index: int, size: int) -> bytes:
    """Body of object `index` of the small-file read set: its index, then a slice of the
    random pool at an index-dependent offset (distinct, incompressible, deterministic)."""
    head = index.to_bytes(8, "little")[:size]
    n = size - len(head)
    off = (index * 7919) % (len(pool) - n + 1)
    return head + pool[off:off + n]


def _read_small(barrier: Any, root: str, names: Sequence[str], chunk: int) -> Result:
    """Open, read whole (`chunk`-sized reads until EOF) and close every file of `names`
    (paths relative to `root`), in order; CRC-32 and size of each in `extra`."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    crcs: list[int] = []
    sizes: list[int] = []
    barrier.wait()
    start = time.monotonic()
    for name in names:
        crc, total = _read_crc(os.path.join(root, name), view)
        crcs.append(crc)
        sizes.append(total)
    return Result(start, time.monotonic(), sum(sizes), 0,
                  {"files": len(names), "crcs": crcs, "sizes": sizes})


def _get_small(barrier: Any, endpoint: str, bucket: str, keys: Sequence[str],
               threads: int) -> Result:
    """GetObject of every key (whole body) with `threads` threads; CRC-32 and size of each
    in `extra`, in the order of `keys`."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=s3_config(threads + 2))

    def fetch(key: str) -> tuple[int, int]:
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return zlib.crc32(data), len(data)

    client.head_bucket(Bucket=bucket)  # connection set up outside the timed section
    barrier.wait()
    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(fetch, keys))
    end = time.monotonic()
    return Result(start, end, sum(n for _, n in got), 0,
                  {"files": len(keys), "crcs": [c for c, _ in got],
                   "sizes": [n for _, n in got]})


WORKERS: dict[str, Callable[..., Result]] = {
    "write": _write_one, "read": _read_one, "get": _get_one, "small": _small_files,
    "put_small": _put_small, "read_small": _read_small, "get_small": _get_small,
}


def _entry(kind: str, barrier: Any, queue: Any, index: int, args: tuple) -> None:
    try:
        queue.put((index, WORKERS[kind](barrier, *args), None))
    except BaseException as exc:  # reported to the driver, which raises it
        try:
            barrier.abort()
        except Exception:
            pass
        queue.put((index, None, f"{type(exc).__name__}: {exc}"))


class WorkerError(RuntimeError):
    pass


def run_parallel(kind: str, arg_list: Sequence[tuple], timeout: float = 3600) -> list[Result]:
    """Run one worker per entry of arg_list in parallel processes; results in order."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(arg_list))
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(kind, barrier, queue, i, args), daemon=True)
             for i, args in enumerate(arg_list)]
    for p in procs:
        p.start()
    results: list[Result | None] = [None] * len(procs)
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        reported: set[int] = set()
        while len(reported) < len(procs):
            try:
                index, result, error = queue.get(timeout=1)
            except Exception:  # queue.Empty: is everybody still alive?
                dead = [i for i, p in enumerate(procs)
                        if i not in reported and not p.is_alive() and p.exitcode != 0]
                if dead:
                    barrier.abort()
                    raise WorkerError(f"{kind} worker(s) {dead} died (exit codes "
                                      f"{[procs[i].exitcode for i in dead]})") from None
                if time.monotonic() > deadline:
                    raise WorkerError(f"{kind} workers timed out after {timeout} s") from None
                continue
            reported.add(index)
            if error:
                errors.append(f"worker {index} ({kind}): {error}")
            results[index] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise WorkerError("; ".join(errors))
    return [r for r in results if r is not None]


def span(results: Sequence[Result]) -> tuple[float, float, int]:
    """(first start, last end, total bytes) of a parallel run."""
    return (min(r.start for r in results), max(r.end for r in results),
            sum(r.nbytes for r in results))
