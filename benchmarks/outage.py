"""`python -m benchmarks outage`: a training loop's stall per checkpoint with S3 healthy
and with S3 in a black hole (issue 30's goal: at most 1.1 x).

Each step does what a checkpointing training loop does: makedirs a step directory,
torch.save three files into a tmp directory, rename it to `checkpoint-N`, delete
checkpoint N-2; the step's wall time is the stall. A fault proxy (tests/faultproxy.py)
sits between the mount and the embedded SeaweedFS: in the black-hole phase it accepts
requests and never answers, like a stuck load balancer. Rounds alternate which phase comes
first; after each round the proxy lets go, `flush` must succeed and the bucket must hold
exactly what the mount shows. `--metadata-ttl 1`, so every step asks S3 again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3

from benchmarks.targets import (
    LakefsTarget,
    create_warm_bucket,
    delete_bucket,
    start_embedded_s3,
    use_bench_credentials,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from faultproxy import FaultProxy  # noqa: E402  (a test tool, shared with the tests)

RESULTS = Path(__file__).resolve().parent / "results" / "namespace-outage"


def save_checkpoint(directory: Path, step: int, mib: int) -> None:
    import torch

    directory.mkdir(parents=True)
    n = max(1, mib * 1024 * 1024 // 4 // 2)  # float32: two tensors of mib/2 each
    torch.save({"w": torch.randn(n), "step": step}, directory / "model.pt")
    torch.save({"m": torch.randn(n)}, directory / "optim.pt")
    (directory / "meta.json").write_text(f'{{"step": {step}}}')


def run_steps(run: Path, first: int, count: int, mib: int) -> list[float]:
    """`count` loop steps from step `first`; the seconds each took."""
    seconds = []
    for step in range(first, first + count):
        started = time.monotonic()
        (run / f"logs/step_{step}").mkdir(parents=True)
        save_checkpoint(run / f"tmp-{step}", step, mib)
        (run / f"tmp-{step}").rename(run / f"checkpoint-{step}")
        old = run / f"checkpoint-{step - 2}"
        if old.exists():
            shutil.rmtree(old)
        seconds.append(time.monotonic() - started)
        time.sleep(1.1)  # past the metadata TTL
    return seconds


def bucket_matches(client: Any, bucket: str, mount: Path) -> bool:
    keys = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys.update(o["Key"] for o in page.get("Contents", [])
                    if not o["Key"].endswith("/") and not o["Key"].startswith(".lakefs"))
    files = {str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file()}
    return keys == files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks outage")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="loop steps per phase")
    parser.add_argument("--mib", type=int, default=32, help="checkpoint size per step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    use_bench_credentials()
    work = Path(tempfile.mkdtemp(prefix="lm-outage-"))
    server = start_embedded_s3(work / "s3")
    client = boto3.client("s3", endpoint_url=server.endpoint_url)
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            bucket = create_warm_bucket(client, f"outage-{r}")
            with FaultProxy("127.0.0.1", server.server.port) as proxy:
                target = LakefsTarget(work / f"m{r}", proxy.endpoint_url, bucket, "auto",
                                      options=("--metadata-ttl", "1"), session="auto")
                target.start()
                try:
                    run = target.path / "run"
                    phases = ["healthy", "black-hole"][::1 if r % 2 == 0 else -1]
                    got: dict[str, list[float]] = {}
                    step = 0
                    for phase in phases:
                        proxy.hang = phase == "black-hole"
                        got[phase] = run_steps(run, step, args.steps, args.mib)
                        step += args.steps
                        proxy.hang = False
                    target.durable()
                    ok = bucket_matches(client, bucket, target.path)
                    target.stop()
                finally:
                    target.kill()
            delete_bucket(client, bucket)
            medians = {p: statistics.median(s) for p, s in got.items()}
            rounds.append({"order": phases, "seconds": got, "median_s": medians,
                           "ratio": medians["black-hole"] / medians["healthy"],
                           "bucket_matches_mount": ok})
            print(f"round {r + 1}: healthy {medians['healthy']:.3f} s, black hole "
                  f"{medians['black-hole']:.3f} s per step (x {rounds[-1]['ratio']:.2f}); "
                  f"bucket matches the mount: {ok}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    worst = max(max(r["seconds"]["black-hole"]) for r in rounds)
    summary = {"rounds": rounds, "median_ratio": ratio, "worst_black_hole_step_s": worst,
               "steps": args.steps, "mib": args.mib}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"median stall ratio black hole / healthy: {ratio:.2f} (goal <= 1.1); "
          f"worst black-hole step {worst:.2f} s")
    return 0 if all(r["bucket_matches_mount"] for r in rounds) else 1
