"""How long `torch.save` of one rank's state dict blocks training, and how long until it is
durable in S3: a local directory on the cache disk vs lakefs-mount's native session
(FUSE passthrough) vs its pyfuse3 session, each in every round, order alternated.

One process, one `torch.save` of 64 MiB float32 tensors (torch writes each tensor with
one large write), as every rank of a training job does. Block time is the call itself;
durable adds `lakefs-mount flush`. The ideal for durable is the larger of the local block
time and a raw boto3 upload of the same file in the same round. Ratios are medians of the
per-round ratios (this VM's disk and S3 rates drift within minutes).

Usage: python -m benchmarks.torch_save [--gib 1] [--runs 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.targets import LakefsTarget, use_bench_credentials
from lakefs_mount.s3.embedded import EmbeddedS3

MiB = 1 << 20
TENSOR_MIB = 64
HERE = Path(__file__).resolve().parent


def state_dict(gib: float) -> dict[str, Any]:
    import torch

    count = max(1, int(gib * 1024 / TENSOR_MIB))
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(TENSOR_MIB * MiB // 4, generator=gen)
            for i in range(count)}


def drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def timed_save(sd: dict[str, Any], path: Path) -> float:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    drop_caches()
    start = time.perf_counter()
    torch.save(sd, path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.torch_save", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state dict size (default 1)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default="/var/tmp/lakefs-mount-torch-save")
    ap.add_argument("--out", default=str(HERE / "results" / "torch-save"))
    a = ap.parse_args(argv)
    use_bench_credentials()
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sd = state_dict(a.gib)
    size = sum(t.numel() * 4 for t in sd.values())
    server = EmbeddedS3(work / "seaweedfs").start(timeout=120)
    bucket = f"ts-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    store = server.store(bucket)
    systems = {"native": LakefsTarget(work / "native", server.endpoint_url, bucket, "uring",
                                      ("--part-size", "16M"), session="native"),
               "pyfuse3": LakefsTarget(work / "pyfuse3", server.endpoint_url, bucket, "uring",
                                       ("--part-size", "16M"), session="pyfuse3")}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in ("local", *systems)}
    try:
        for target in systems.values():
            target.start()
        local = work / "local"
        for r in range(a.runs):
            order = ["local", *systems]
            if r % 2:
                order.reverse()
            for name in order:
                if name == "local":
                    block = timed_save(sd, local / f"step{r}" / "model.pt")
                    start = time.perf_counter()
                    with open(local / f"step{r}" / "model.pt", "rb") as f:
                        store.put(f"raw/step{r}.pt", f.read(), {})
                    rows[name].append({"block_s": block,
                                       "upload_s": time.perf_counter() - start})
                    continue
                target = systems[name]
                start = time.perf_counter()
                block = timed_save(sd, target.path / name / f"step{r}" / "model.pt")
                target.durable()
                rows[name].append({"block_s": block,
                                   "durable_s": time.perf_counter() - start})
                print(f"run {r} {name}: block {block:.2f} s, durable "
                      f"{rows[name][-1]['durable_s']:.2f} s", file=sys.stderr)
            print(f"run {r} local: block {rows['local'][-1]['block_s']:.2f} s, raw upload "
                  f"{rows['local'][-1]['upload_s']:.2f} s", file=sys.stderr)
        for target in systems.values():
            target.stop()
    finally:
        for target in systems.values():
            target.kill()
        server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    results = summarize(rows, size, a.runs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0


def summarize(rows: dict[str, list[dict[str, float]]], size: int, runs: int) -> dict[str, Any]:
    local = rows["local"]
    summary: dict[str, Any] = {"bytes": size, "runs": runs,
                               "local_block_s": statistics.median(x["block_s"] for x in local),
                               "raw_upload_s": statistics.median(x["upload_s"] for x in local)}
    for name in rows:
        if name == "local":
            continue
        summary[name] = {
            "block_s": statistics.median(x["block_s"] for x in rows[name]),
            "block_x_local": statistics.median(
                x["block_s"] / lo["block_s"] for x, lo in zip(rows[name], local, strict=True)),
            "durable_s": statistics.median(x["durable_s"] for x in rows[name]),
            "durable_x_ideal": statistics.median(
                x["durable_s"] / max(lo["block_s"], lo["upload_s"])
                for x, lo in zip(rows[name], local, strict=True)),
        }
    return {"summary": summary, "rounds": rows}


if __name__ == "__main__":
    sys.exit(main())
