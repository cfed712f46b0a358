"""safetensors' save_file to durable, under a network profile: mounts that differ in their
options (by default the default hold of temporaries against `--hold-temporaries 0`)
against the raw boto3 upload of the same file, one SeaweedFS, ratios per round.

`python -m benchmarks.temporaries [--mib 256 --rounds 3 --profile region]`

A round: the file saved on the local disk and uploaded raw (16 MiB parts, 16 in flight),
then `save_file` into each mount followed by `flush`, the mounts' order rotated every
round (on this VM a write right after a large upload is slower, whatever writes); memory
touched and the page cache dropped before each timed point. Prints each round, when the
mount's uploaded bytes reached the first byte, half and all of the file, the medians of
the per-round ratios durable / raw upload, and the S3 requests each mount made.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

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

TENSOR = 64 * MiB


class Timeline:
    """The mount's uploaded bytes over a save and its flush (its `status`, every 50 ms):
    when the first byte went, when half and all of the file had gone."""

    def __init__(self, mountpoint: Path) -> None:
        import threading

        self.mountpoint = mountpoint
        self.points: list[tuple[float, int]] = []
        self.began = time.perf_counter()
        self.base = self._uploaded()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _uploaded(self) -> int:
        from lakefs_mount import api

        return int(api.status(self.mountpoint).get("bytes_uploaded", 0))

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.points.append((time.perf_counter() - self.began, self._uploaded() - self.base))

    def summary(self, nbytes: int) -> str:
        self._stop.set()
        self._thread.join()
        marks = []
        for label, frac in (("first", 1e-9), ("half", 0.5), ("all", 1.0)):
            t = next((t for t, b in self.points if b >= frac * nbytes), None)
            marks.append(f"{label} {t:.2f}" if t is not None else f"{label} -")
        return "up at " + ", ".join(marks) + " s"


def state_dict(mib: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(49)
    return {f"t{i}": torch.rand(TENSOR // 4, generator=gen)
            for i in range(max(1, mib * MiB // TENSOR))}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.temporaries", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", metavar="NAME=OPTIONS",
                    help="a mount named NAME with these extra mount options (repeatable; "
                         "default: hold='' and nohold='--hold-temporaries 0')")
    ap.add_argument("--workdir", default="/var/tmp/lakefs-mount-temporaries")
    add_profile_argument(ap)
    guestmem.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    variants = dict(v.split("=", 1) for v in (a.variant or
                                              ["hold=", "nohold=--hold-temporaries 0"]))
    clean_up_on_sigterm()
    use_bench_credentials()
    from safetensors.torch import load_file, save_file

    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
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
        bucket = create_warm_bucket(client, f"tmp-{uuid.uuid4().hex[:8]}")
        sd = state_dict(a.mib)
        nbytes = sum(t.numel() * 4 for t in sd.values())
        for name, opts in variants.items():
            target = LakefsTarget(work / name, server.endpoint_url, bucket, "auto",
                                  ("--part-size", "16M", *shlex.split(opts)))
            target.prefix = f"{name}/"
            target.start()
            mounts[name] = target
        config = TransferConfig(multipart_threshold=RAW_PART, multipart_chunksize=RAW_PART,
                                max_concurrency=RAW_CONCURRENCY)
        ratios: dict[str, list[float]] = {n: [] for n in mounts}
        print(f"{server.profile}; {nbytes / MiB:.0f} MiB; mounts {variants}", flush=True)
        with backing.held():
            for r in range(a.rounds):
                names = list(mounts)
                order = ["raw", *names[r % len(names):], *names[:r % len(names)]]
                row: dict[str, tuple[float, float]] = {}
                for system in order:
                    if system == "raw":
                        local = work / "local.safetensors"
                        save_file(sd, str(local))
                        drop_caches()
                        backing.before_point(nbytes)
                        began = time.perf_counter()
                        client.upload_file(str(local), bucket, f"raw/r{r}", Config=config)
                        row["raw"] = (0.0, time.perf_counter() - began)
                        local.unlink()
                        continue
                    target = mounts[system]
                    path = target.path / f"r{r}" / "model.safetensors"
                    path.parent.mkdir(exist_ok=True)
                    drop_caches()
                    backing.before_point(nbytes)
                    timeline = Timeline(target.path)
                    began = time.perf_counter()
                    save_file(sd, str(path))
                    stall = time.perf_counter() - began
                    target.durable()
                    row[system] = (stall, time.perf_counter() - began)
                    print(f"  {system}: {timeline.summary(nbytes)}", flush=True)
                    got = load_file(str(path))
                    wrong = any(not got[k].equal(v) for k, v in sd.items())
                    del got  # (its tensors map the file: the mount would stay busy)
                    if wrong:
                        raise SystemExit(f"{system}: wrong data read back")
                raw = row["raw"][1]
                for name in mounts:
                    ratios[name].append(row[name][1] / raw)
                print(f"round {r}: raw {raw:.2f} s; " + "; ".join(
                    f"{n} stall {row[n][0]:.2f} s durable {row[n][1]:.2f} s "
                    f"({row[n][1] / raw:.2f} x)" for n in mounts), flush=True)
        for name, target in mounts.items():
            reqs = {op: v["count"] for op, v in target.status().get("s3_requests", {}).items()}
            print(f"{name}: durable x raw upload, median {statistics.median(ratios[name]):.2f}"
                  f" [{min(ratios[name]):.2f}-{max(ratios[name]):.2f}]; "
                  f"s3 requests {reqs}", flush=True)
        wind_down(mounts, client, bucket, notes)
    finally:
        tear_down(mounts, server, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
