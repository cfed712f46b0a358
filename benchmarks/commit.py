"""Time from the last close to the manifest in S3 (`commit`) against the time to `flush`.

`python -m benchmarks.commit [--files 8] [--mib 512] [--rounds 3]` (root): an embedded
SeaweedFS on 127.0.0.1, one mount. Each round writes the same checkpoint (`--files` files
of `--mib` MiB, random bytes) into two fresh directories and, in alternating order, times
`lakefs-mount flush MNT A` from the last close, and `lakefs-mount commit MNT B` from the
last close (its flush, the listing, a HEAD per file, the CRC32C of every file from the
cache, the manifest's PUT). It also times `commit MNT A` after A's flush (the manifest
alone) and `verify MNT B` (every byte read back from S3 and hashed). It prints each round
and the medians of the per-round ratios commit / flush (the issue's goal: at most 1.05).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lakefs_mount.s3.embedded import EmbeddedS3

CLI = str(Path(sys.executable).parent / "lakefs-mount")
MiB = 1024 * 1024


def _timed(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([CLI, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lakefs-mount {' '.join(args)} failed: {proc.stderr}")
    return time.perf_counter() - t0


def _write(directory: Path, bodies: list[bytes]) -> None:
    directory.mkdir()
    for i, body in enumerate(bodies):
        with open(directory / f"shard-{i}.bin", "wb") as f:
            f.write(body)


def _round(mnt: Path, r: int, bodies: list[bytes], flush_first: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    a, b = mnt / f"r{r}-flushed", mnt / f"r{r}-committed"
    for what in (("flush", "commit") if flush_first else ("commit", "flush")):
        target = a if what == "flush" else b
        _write(target, bodies)
        out[what] = _timed(what, str(mnt), target.name)
    out["manifest_only"] = _timed("commit", str(mnt), a.name)
    out["verify"] = _timed("verify", str(mnt), b.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/var/tmp/lakefs-mount-commit-bench")
    args = parser.parse_args(argv)
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # the server checks none
        os.environ.setdefault(name, value)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.workdir, prefix="commit-"))
    server = EmbeddedS3(work / "s3").start(timeout=60)
    mnt = work / "mnt"
    mnt.mkdir()
    try:
        server.create_bucket("commit-bench")
        subprocess.run([CLI, "mount", "s3://commit-bench", str(mnt), "--endpoint-url",
                        server.endpoint_url, "--cache-dir", str(work / "cache"),
                        "--log-file", str(work / "daemon.log")], check=True)
        bodies = [os.urandom(args.mib * MiB) for _ in range(args.files)]
        rows = []
        for r in range(args.rounds):
            row = _round(mnt, r, bodies, flush_first=r % 2 == 0)
            rows.append(row)
            print(f"round {r + 1}: flush {row['flush']:.2f} s, commit {row['commit']:.2f} s "
                  f"(ratio {row['commit'] / row['flush']:.3f}); manifest alone "
                  f"{row['manifest_only']:.2f} s; verify {row['verify']:.2f} s", flush=True)
        ratio = statistics.median(x["commit"] / x["flush"] for x in rows)
        alone = statistics.median(x["manifest_only"] for x in rows)
        verify = statistics.median(x["verify"] for x in rows)
        print(f"{args.files} x {args.mib} MiB, median of {args.rounds} rounds: commit / flush "
              f"{ratio:.3f}; manifest alone {alone:.2f} s; verify {verify:.2f} s "
              f"({args.files * args.mib / verify:.0f} MiB/s)")
    finally:
        if subprocess.run([CLI, "unmount", str(mnt)], check=False).returncode != 0:
            # a failed round (S3 refused its uploads): its scratch data is not to keep
            subprocess.run([CLI, "unmount", "--no-flush", str(mnt)], check=False)
        server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
