"""A checkpoint larger than the cache (issue 51, D30): written through a mount whose
--cache-size is a third of it, against the local disk (the stall) and the raw boto3 upload
(durable), one SeaweedFS, ratios per round.

`python -m benchmarks.oversize [--mib 1536 --cache-mib 512 --shape one|many --rounds 3]`

`one`: a single file written in 4 MiB writes; `many`: --files files of equal size written
at once, one thread each (all open together: none can commit before the others end). A
round: the bytes written to the local disk and uploaded raw (16 MiB parts, 16 in flight),
then into each mount (pyfuse3, whose parts spill; native, whose first writer takes FUSE
passthrough and cannot spill) followed by `flush`; the order rotated every round; memory
touched and the page cache dropped before each timed point. Prints per round the stall
and durable times, the peak of the mount's `cache_used` (its status every 0.1 s), the
parts spilled and copied; checks every object's bytes in S3 against what was written.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import threading
import time
import uuid
from pathlib import Path

from benchmarks import guestmem
from benchmarks.checkpoint import RAW_CONCURRENCY, RAW_PART, MiB, drop_caches
from benchmarks.profiles import add_profile_argument
from benchmarks.s3config import s3_config
from benchmarks.targets import (
    LakefsTarget,
    clean_up_on_sigterm,
    create_warm_bucket,
    start_embedded_s3,
    tear_down,
    use_bench_credentials,
    wind_down,
)

WRITE = 4 * MiB


class Peak:
    """The largest `cache_used` the mount's status shows while a point runs."""

    def __init__(self, mountpoint: Path) -> None:
        from lakefs_mount import api

        self.status = lambda: api.status(mountpoint)
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            self.most = max(self.most, int(self.status().get("cache_used") or 0))

    def end(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def write_files(paths: list[Path], size: int, block: bytes) -> None:
    """`size` bytes into each of `paths` at once (a thread each), WRITE at a time: the
    block with the file's index and offset stamped in, so every chunk differs."""
    def one(i: int, path: Path) -> None:
        with open(path, "wb") as f:
            for at in range(0, size, WRITE):
                f.write(stamped(block, i, at))

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def stamped(block: bytes, i: int, at: int) -> bytes:
    return f"{i}:{at}:".encode().ljust(64, b".") + block[64:]


def expected_md5(i: int, size: int, block: bytes) -> str:
    h = hashlib.md5()
    for at in range(0, size, WRITE):
        h.update(stamped(block, i, at))
    return h.hexdigest()


def s3_md5(client, bucket: str, key: str) -> str:  # type: ignore[no-untyped-def]
    h = hashlib.md5()
    for piece in client.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(MiB):
        h.update(piece)
    return h.hexdigest()


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.oversize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1536, help="the checkpoint's size")
    ap.add_argument("--cache-mib", type=int, default=512)
    ap.add_argument("--shape", choices=("one", "many"), default="one")
    ap.add_argument("--files", type=int, default=6, help="with --shape many")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", default="pyfuse3,native")
    ap.add_argument("--workdir", default="/var/tmp/lakefs-mount-oversize")
    add_profile_argument(ap)
    guestmem.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    clean_up_on_sigterm()
    use_bench_credentials()
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    nfiles = a.files if a.shape == "many" else 1
    size = a.mib * MiB // nfiles // WRITE * WRITE
    nbytes = size * nfiles
    block = os.urandom(WRITE)
    sums = [expected_md5(i, size, block) for i in range(nfiles)]
    notes: list[str] = []
    backing = guestmem.Backing(notes, set_order=a.set_page_reporting_order,
                               touch_gib=a.touch_gib)
    server = start_embedded_s3(work / "s3", profile=a.profile)
    mounts: dict[str, LakefsTarget] = {}
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                              config=s3_config(64))
        bucket = create_warm_bucket(client, f"big-{uuid.uuid4().hex[:8]}")
        for session in a.sessions.split(","):
            target = LakefsTarget(work / session, server.endpoint_url, bucket, "auto",
                                  ("--part-size", "16M", "--cache-size", f"{a.cache_mib}M",
                                   "--max-dirty", f"{a.cache_mib // 4}M"), session=session)
            target.prefix = f"{session}/"
            target.start()
            mounts[session] = target
        config = TransferConfig(multipart_threshold=RAW_PART, multipart_chunksize=RAW_PART,
                                max_concurrency=max(1, RAW_CONCURRENCY // nfiles))
        stalls: dict[str, list[float]] = {n: [] for n in mounts}
        durables: dict[str, list[float]] = {n: [] for n in mounts}
        print(f"{server.profile}; {nfiles} file(s) of {size / MiB:.0f} MiB; cache "
              f"{a.cache_mib} MiB", flush=True)
        with backing.held():
            for r in range(a.rounds):
                names = list(mounts)
                order = ["local", *names[r % len(names):], *names[:r % len(names)]]
                row: dict[str, str] = {}
                local_stall = raw = 0.0
                for system in order:
                    if system == "local":
                        paths = [work / f"local{i}" for i in range(nfiles)]
                        drop_caches()
                        backing.before_point(nbytes)
                        began = time.perf_counter()
                        write_files(paths, size, block)
                        os.sync()  # (the mount's stall: writes acknowledged, not synced)
                        local_stall = time.perf_counter() - began
                        drop_caches()
                        began = time.perf_counter()
                        threads = [threading.Thread(
                            target=client.upload_file, args=(str(p), bucket, f"raw/{r}/{i}"),
                            kwargs={"Config": config}) for i, p in enumerate(paths)]
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join()
                        raw = time.perf_counter() - began
                        for p in paths:
                            p.unlink()
                        continue
                    target = mounts[system]
                    before = target.status().get("counters", {})
                    paths = [target.path / f"r{r}" / f"f{i}" for i in range(nfiles)]
                    paths[0].parent.mkdir()
                    drop_caches()
                    backing.before_point(nbytes)
                    peak = Peak(target.path)
                    began = time.perf_counter()
                    write_files(paths, size, block)
                    stall = time.perf_counter() - began
                    target.durable()
                    durable = time.perf_counter() - began
                    most = peak.end()
                    after = target.status().get("counters", {})
                    spilled = after.get("parts_spilled", 0) - before.get("parts_spilled", 0)
                    copied = after.get("parts_copied", 0) - before.get("parts_copied", 0)
                    wrong = [i for i in range(nfiles) if s3_md5(
                        client, bucket, f"{system}/r{r}/f{i}") != sums[i]]
                    if wrong:
                        raise SystemExit(f"{system}: wrong bytes in S3 for files {wrong}")
                    stalls[system].append(stall / local_stall)
                    durables[system].append(durable / raw)
                    row[system] = (f"stall {stall:.1f} s durable {durable:.1f} s, cache peak "
                                   f"{most / MiB:.0f} MiB, spilled {spilled} copied {copied}")
                print(f"round {r}: local {local_stall:.1f} s, raw upload {raw:.1f} s; " +
                      "; ".join(f"{n}: {v}" for n, v in row.items()), flush=True)
        for name in mounts:
            print(f"{name}: stall x local median {statistics.median(stalls[name]):.2f}, "
                  f"durable x raw upload median {statistics.median(durables[name]):.2f}",
                  flush=True)
        wind_down(mounts, client, bucket, notes)
    finally:
        tear_down(mounts, server, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
