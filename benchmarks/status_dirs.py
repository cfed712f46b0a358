"""What the per-checkpoint progress of `status` (lakefs_mount/ops/dirprogress.py) costs the
trio loop, next to the walks `status` did before it, on many pending files.

`status` already walks every cached file once (the pending files) and every chunk of
every cached file once (the age of the oldest dirty chunk); the per-directory progress
adds one pass over the pending files and their chunks. This times the three on the same
synthetic cache (N files in D top-level directories, C chunks each, all dirty), medians
of R rounds, and prints the ratio of the new pass to the old walks.

    python -m benchmarks.status_dirs [--files 10000] [--dirs 8] [--chunks 1] [--rounds 21]

With `--mount` (root) it also times the whole `status` call on a real mount (an embedded
SeaweedFS on 127.0.0.1, `--commit-delay` long enough that the files stay pending): with
no pending file, then with N pending 1 KiB files in D directories, medians of R calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from lakefs_mount.cache.cachefile import CachedFile, Chunk, ChunkState
from lakefs_mount.ops.dirprogress import DirProgress

CLI = str(Path(sys.executable).parent / "lakefs-mount")


def _cache(files: int, dirs: int, chunks: int) -> list[CachedFile]:
    out = []
    for i in range(files):
        cf = CachedFile(key=f"step_{i % dirs}/rank{i}.pt", size=chunks * 8 << 20, mode=0o100644,
                        uid=0, gid=0, mtime_ns=0, in_journal=True)
        cf.chunks = {c: Chunk(ChunkState.DIRTY, held=8 << 20, dirty_since=0.0)
                     for c in range(chunks)}
        out.append(cf)
    return out


def _median_ms(work, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _on_a_mount(files: int, dirs: int, rounds: int) -> None:
    """The whole `status` control call, before and after `files` pending files."""
    import boto3

    from benchmarks.targets import (
        create_warm_bucket,
        start_embedded_s3,
        use_bench_credentials,
    )
    from lakefs_mount.ops import control

    use_bench_credentials()
    with tempfile.TemporaryDirectory(prefix="status-dirs-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        s3 = start_embedded_s3(root / "s3")
        mnt = root / "mnt"
        mnt.mkdir()
        try:
            create_warm_bucket(boto3.client("s3", endpoint_url=s3.endpoint_url), "bench")
            subprocess.run([CLI, "mount", "s3://bench", str(mnt), "--endpoint-url",
                            s3.endpoint_url, "--cache-dir", str(root / "cache"),
                            "--commit-delay", "3600", "--log-file", str(root / "log")],
                           check=True, timeout=120)
            try:
                def call() -> dict:
                    return control.call(mnt, {"op": "status"}, timeout=60)

                empty = _median_ms(call, rounds)
                for i in range(files):
                    directory = mnt / f"step_{i % dirs}"
                    directory.mkdir(exist_ok=True)
                    (directory / f"f{i}").write_bytes(os.urandom(1024))
                got = call()
                assert got["files_pending"] == files, got["files_pending"]
                full = _median_ms(call, rounds)
                print(f"status call on a mount, medians of {rounds}: no pending file "
                      f"{empty:.1f} ms, {files} pending files {full:.1f} ms "
                      f"({len(got['checkpoints'])} directories shown)")
            finally:
                subprocess.run([CLI, "unmount", "--no-flush", str(mnt)], timeout=120)
        finally:
            s3.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--dirs", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--mount", action="store_true", help="also on a real mount (root)")
    args = parser.parse_args()
    files = _cache(args.files, args.dirs, args.chunks)
    progress = DirProgress("")
    for cf in files[: args.dirs]:
        progress.uploaded(cf, 8 << 20)

    def pending_walk() -> None:  # FileSystem.pending_files(None)
        [cf for cf in files if cf.pending and not cf.unlinked]

    def oldest_walk() -> None:  # ChunkBook.oldest_dirty_age
        min(ch.dirty_since for cf in files for ch in cf.chunks.values()
            if ch.dirty_since is not None)

    def dirs_pass() -> None:
        progress.status(files)

    async def run() -> dict[str, float]:  # (DirProgress needs no loop; the walks as in it)
        return {name: _median_ms(work, args.rounds) for name, work in
                (("pending files walk", pending_walk), ("oldest dirty walk", oldest_walk),
                 ("per-directory pass (new)", dirs_pass))}

    result = trio.run(run)
    print(f"{args.files} pending files in {args.dirs} directories, {args.chunks} chunk(s) "
          f"each; medians of {args.rounds} rounds")
    for name, ms in result.items():
        print(f"  {name:<26} {ms:8.2f} ms")
    old = result["pending files walk"] + result["oldest dirty walk"]
    print(f"  new pass / old walks       {result['per-directory pass (new)'] / old:8.2f}")
    if args.mount:
        _on_a_mount(args.files, args.dirs, args.rounds)


if __name__ == "__main__":
    main()
