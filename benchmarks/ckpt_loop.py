"""A loop hunting a lost checkpoint: save through a mount, flush, check S3, cold remount,
load back, every daemon log kept (issue 31: DCP's `.metadata` was once missing after a
cold remount, and the daemon log was lost with the benchmark's scratch directory).

`python -m benchmarks.ckpt_loop [--iterations 20] [--mib 64] [--hogs 2] [--world 4]`

Each iteration, in a bucket of its own (deleted after it: SeaweedFS frees space per
bucket), as the checkpoint benchmark's round does:
mount (native session, a new empty cache dir), torch.save, safetensors save_file and a DCP
save (FileSystemWriter, world size 1; also world size 4 with `--world 4`) by rank
processes, `lakefs-mount flush`, then boto3 checks that every file is in S3 under its
final name right after the flush returned (`.metadata` above all), unmount; a fresh mount
over a new empty cache, the torch and safetensors loads (cold, they load S3 as in the
benchmark), then the DCP loads, each compared tensor by tensor. `--hogs N` runs N busy
Python processes meanwhile (the original run was on a heavily loaded machine), and
`--s3-load N` N threads writing to the same S3 (there, JuiceFS and rclone). The logs
and a summary (`summary.json`) stay in `--workdir`; the exit status is 1 if any
iteration lost or corrupted a file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import lakefs_mount
from benchmarks.checkpoint import RankPool
from benchmarks.ckpt_ranks import DataError
from benchmarks.s3config import s3_config
from benchmarks.targets import (
    LakefsTarget,
    clean_up_on_sigterm,
    create_warm_bucket,
    delete_bucket,
    start_embedded_s3,
    use_bench_credentials,
)


def hog() -> None:  # pragma: no cover - a busy loop until killed
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def s3_writer(endpoint: str, stop: threading.Event) -> None:
    """PUTs of 16 MiB objects until `stop`: S3 busy with another writer (in the benchmark,
    JuiceFS and rclone wrote back, and retried, during the mount's restores); a new
    bucket every 512 MiB, the last one deleted (the disk is not filled)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=s3_config(4))
    body = os.urandom(16 << 20)
    bucket = ""
    n = 0
    while not stop.is_set():
        if n % 32 == 0:
            if bucket:
                delete_bucket(client, bucket)
            bucket = create_warm_bucket(client, f"other-{uuid.uuid4().hex[:6]}")
        client.put_object(Bucket=bucket, Key=f"object-{n % 32}", Body=body)
        n += 1
    delete_bucket(client, bucket)


def s3_keys(client: Any, bucket: str, prefix: str) -> set[str]:
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
    return keys


def expected_keys(world: int) -> set[str]:
    want = {"torch/rank0.pt", "safetensors/rank0.safetensors", "dcp1/.metadata",
            "dcp1/__0_0.distcp"}
    if world > 1:
        want |= {"dcp4/.metadata", *(f"dcp4/__{k}_0.distcp" for k in range(world))}
    return want


class Loop:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir)
        self.results: list[dict[str, Any]] = []

    def run(self) -> int:
        shutil.rmtree(self.work, ignore_errors=True)
        (self.work / "logs").mkdir(parents=True)
        server = start_embedded_s3(self.work / "seaweedfs")
        import boto3

        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                              config=s3_config(16))
        pool = self.new_pool(server.endpoint_url)
        target = LakefsTarget(self.work / "mount", server.endpoint_url, "", "auto",
                              ("--part-size", "16M"), session="native")
        ctx = mp.get_context("spawn")
        hogs = [ctx.Process(target=hog, daemon=True) for _ in range(self.args.hogs)]
        for p in hogs:
            p.start()
        stop = threading.Event()
        writers = [threading.Thread(target=s3_writer, args=(server.endpoint_url, stop),
                                    daemon=True) for _ in range(self.args.s3_load)]
        for t in writers:
            t.start()
        print(f"lakefs_mount from {Path(lakefs_mount.__file__).parent}", flush=True)
        try:
            for i in range(self.args.iterations):
                target.bucket = create_warm_bucket(client, f"loop-{i}-{uuid.uuid4().hex[:6]}")
                row = self.iteration(i, pool, target, client, target.bucket)
                delete_bucket(client, target.bucket)
                self.results.append(row)
                self.write_summary()
                if "error" in row:  # a failed load may leave a rank (or its group) broken
                    pool.close(wait=5)
                    pool = self.new_pool(server.endpoint_url)
        finally:
            stop.set()
            for p in hogs:
                p.kill()
            for t in writers:
                t.join(60)
            pool.close()
            target.kill()
            server.stop(timeout=5)
        bad = [r for r in self.results if not r["ok"]]
        print(f"{len(self.results)} iterations, {len(bad)} failed; logs in {self.work}/logs")
        return 1 if bad else 0

    def new_pool(self, endpoint: str) -> RankPool:
        pool = RankPool(self.args.world, self.args.mib, endpoint)
        if self.args.world > 1:
            pool.ensure_group(self.args.world)
        return pool

    def mount(self, target: LakefsTarget, i: int, phase: str) -> None:
        target.log_file = self.work / "logs" / f"iter{i:03d}-{phase}.log"
        shutil.rmtree(target.cache_dir, ignore_errors=True)
        target.start()

    def iteration(self, i: int, pool: RankPool, target: LakefsTarget, client: Any,
                  bucket: str) -> dict[str, Any]:
        world = self.args.world
        base = f"it{i:03d}"
        mnt = target.path / base
        row: dict[str, Any] = {"iteration": i, "ok": False}
        started = time.monotonic()
        try:
            self.mount(target, i, "save")
            saves = [("torch", str(mnt / "torch" / "rank0.pt")),
                     ("safetensors", str(mnt / "safetensors" / "rank0.safetensors")),
                     ("dcp", str(mnt / "dcp1"))]
            for fmt, place in saves:
                pool.call("save", [{"fmt": fmt, "place": place, "world": 1}])
            if world > 1:
                pool.call("save", [{"fmt": "dcp", "place": str(mnt / "dcp4"), "world": world}]
                          * world)
            target.durable()
            missing = expected_keys(world) - s3_keys(client, bucket, base + "/")
            row["missing_after_flush"] = sorted(missing)
            target.stop()
            self.mount(target, i, "load")
            for fmt, place in saves:
                pool.call("load", [{"fmt": fmt, "place": place}])
            if world > 1:
                pool.call("load", [{"fmt": "dcp", "place": str(mnt / "dcp4")}] * world)
            target.stop()
            row["ok"] = not missing
        except DataError as exc:
            row["error"] = f"DATA: {exc}"
        except Exception as exc:  # noqa: BLE001 - recorded, the loop goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
            traceback.print_exc()
        finally:
            if target.pid is not None:
                target.kill()
        row["seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps(row), flush=True)
        return row

    def write_summary(self) -> None:
        bad = [r for r in self.results if not r["ok"]]
        (self.work / "summary.json").write_text(json.dumps(
            {"args": vars(self.args), "iterations": len(self.results), "failed": len(bad),
             "results": self.results}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ckpt_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--mib", type=int, default=64, help="state dict per rank in MiB")
    ap.add_argument("--world", type=int, choices=(1, 4), default=1,
                    help="4 adds a DCP save and load at world size 4")
    ap.add_argument("--hogs", type=int, default=0, help="busy processes meanwhile")
    ap.add_argument("--s3-load", type=int, default=0,
                    help="threads PUTting 16 MiB objects to the same S3 meanwhile")
    ap.add_argument("--workdir", default="/var/tmp/lakefs-mount-ckpt-loop",
                    help="scratch dir (wiped at start, kept at the end: the logs)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    use_bench_credentials()

    clean_up_on_sigterm()
    return Loop(args).run()


if __name__ == "__main__":
    sys.exit(main())
