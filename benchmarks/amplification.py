"""`python -m benchmarks.amplification`: bytes uploaded per byte of the final objects
(issue 53: goal 1.0 for checkpoints, at most 2 for files rewritten in place).

Two workloads through one mount (`--part-size 8M`), each flushed, its objects checked
byte for byte against what was written:

- `checkpoint`: `--files` files of `--mib` MiB written front to back in 1 MiB writes and
  closed, as torch.save does.
- `rewrites`: the same files written, then `--ops` writes of up to 1 MiB at random
  offsets (seeded), each file closed and opened again every 10 of its writes, as fsx's
  reopen mode does; then flushed.

The ratio is the daemon's `bytes_uploaded` counter over the bytes of the final objects.
Medians over `--rounds`, each round in a new bucket and mount.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.targets import LakefsTarget, create_warm_bucket, delete_bucket, embedded_session

MiB = 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results" / "amplification"
GOALS = {"checkpoint": 1.0, "rewrites": 2.0}
REOPEN_EVERY = 10  # writes of a file between its close and next open


def write_checkpoint(root: Path, files: int, mib: int, rng: random.Random) -> dict[str, bytes]:
    out = {}
    for i in range(files):
        data = rng.randbytes(mib * MiB)
        with open(root / f"ckpt-{i}.bin", "wb") as f:
            for off in range(0, len(data), MiB):
                f.write(data[off:off + MiB])
        out[f"ckpt-{i}.bin"] = data
    return out


def rewrite(root: Path, files: int, mib: int, ops: int, rng: random.Random
            ) -> dict[str, bytes]:
    contents = {f"rw-{i}.bin": bytearray(rng.randbytes(mib * MiB)) for i in range(files)}
    for name, data in contents.items():
        (root / name).write_bytes(data)
    counts = dict.fromkeys(contents, 0)
    handles: dict[str, int] = {}
    try:
        for _ in range(ops):
            name = rng.choice(list(contents))
            data = contents[name]
            length = rng.randrange(1, MiB + 1)
            offset = rng.randrange(0, len(data) - length + 1)
            piece = rng.randbytes(length)
            if name not in handles:
                handles[name] = os.open(root / name, os.O_WRONLY)
            os.pwrite(handles[name], piece, offset)
            data[offset:offset + length] = piece
            counts[name] += 1
            if counts[name] % REOPEN_EVERY == 0:
                os.close(handles.pop(name))
    finally:
        for fd in handles.values():
            os.close(fd)
    return {name: bytes(data) for name, data in contents.items()}


def measure(target: LakefsTarget, client: Any, bucket: str, workload: str,
            args: argparse.Namespace, seed: int) -> float:
    """The workload's bytes uploaded over its objects' bytes; every object checked."""
    rng = random.Random(seed)
    before = target.status()["counters"].get("bytes_uploaded", 0)
    if workload == "checkpoint":
        written = write_checkpoint(target.path, args.files, args.mib, rng)
    else:
        written = rewrite(target.path, args.files, args.mib, args.ops, rng)
    target.durable()
    uploaded = target.status()["counters"].get("bytes_uploaded", 0) - before
    for name, data in written.items():
        body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        if body != data:
            at = next((i for i, (a, b) in enumerate(zip(body, data, strict=False))
                       if a != b),
                      min(len(body), len(data)))
            shown = (target.path / name).read_bytes() == data
            raise SystemExit(f"{workload}: s3://{bucket}/{name} differs from what was written "
                             f"from byte {at} ({len(body)} bytes in S3, {len(data)} written; "
                             f"the mount {'shows' if shown else 'does not show'} them right)")
    return uploaded / sum(len(d) for d in written.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.amplification")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=32, help="size of each file")
    parser.add_argument("--ops", type=int, default=400, help="random writes (rewrites)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    ratios: dict[str, list[float]] = {w: [] for w in GOALS}
    with embedded_session("lm-amplification-") as (work, server, client):
        for r in range(args.rounds):
            bucket = create_warm_bucket(client, f"amplification-{r}")
            target = LakefsTarget(work / f"m{r}", server.endpoint_url, bucket, "auto",
                                  options=("--part-size", "8M"), session="auto")
            target.start()
            try:
                for workload in GOALS:
                    ratios[workload].append(measure(target, client, bucket, workload, args,
                                                    seed=r))
                target.stop()
            finally:
                target.kill()
            delete_bucket(client, bucket)
            print(f"round {r + 1}: " + ", ".join(
                f"{w} {v[-1]:.2f} x" for w, v in ratios.items()), flush=True)
    summary: dict[str, Any] = {"files": args.files, "mib": args.mib, "ops": args.ops,
                               "ratios": ratios}
    ok = True
    for workload, goal in GOALS.items():
        median = statistics.median(ratios[workload])
        summary[f"{workload}_median"] = median
        met = median <= goal * 1.02
        ok &= met
        print(f"{workload}: bytes uploaded / bytes of the objects, median {median:.2f} "
              f"(goal <= {goal:g}): {'PASS' if met else 'FAIL'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
