"""torch.distributed.checkpoint save of a model-sized state: mount vs local disk vs S3.

For each target it measures
  blocked  - how long the training loop waits: the `dcp.save` call itself;
  durable  - until the checkpoint survives the machine: for the mount, save + `lakefs-mount
             flush` (the data is in S3); for local disk, the save (DCP fsyncs its files);
             for s3torchconnector, the save (it returns once the objects are in S3).
Targets: `mount` (lakefs-mount over an embedded SeaweedFS), `local` (raw local disk, no
S3 copy at all: the lower bound), `s3torchconnector` (straight to the same SeaweedFS via
s3torchconnector's DCP writer; skipped with the reason when the package is missing).

Sets up its own SeaweedFS and mount in a temporary directory and removes them at the end.
Reports the median of --runs runs (3; --quick: 1 run of a small state).

    python benchmarks/dcp_save.py [--quick] [--size-gib 2] [--runs 3] [--threads 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from lakefs_mount.s3.embedded import EmbeddedS3

MiB = 1 << 20
GiB = 1 << 30
CLI = str(Path(sys.executable).parent / "lakefs-mount")
REGION = "us-east-1"


def make_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """float32 tensors of 64 MiB (the last one smaller), like the layers of a model."""
    state: dict[str, torch.Tensor] = {}
    left, i = total_bytes, 0
    gen = torch.Generator().manual_seed(0)
    while left > 0:
        n = min(left, 64 * MiB) // 4
        state[f"layers.{i}.weight"] = torch.randn(n, generator=gen)
        left -= n * 4
        i += 1
    state["step"] = torch.tensor(1000)
    return state


def cli(*args: str, timeout: float = 600) -> None:
    proc = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"lakefs-mount {' '.join(args)} failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def environment(root: Path) -> Iterator[tuple[EmbeddedS3, str, Path]]:
    """An embedded SeaweedFS, a bucket on it and a lakefs-mount of the bucket."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "benchaccesskey")  # weed runs without auth
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "benchsecretkey")
    os.environ.setdefault("AWS_REGION", REGION)
    server = EmbeddedS3(root / "seaweedfs")
    server.start(timeout=90)
    mnt = root / "mnt"
    mnt.mkdir()
    mounted = False
    try:
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        server.create_bucket(bucket)
        cli("mount", f"s3://{bucket}", str(mnt), "--endpoint-url", server.endpoint_url,
            "--cache-dir", str(root / "cache"), "--log-file", str(root / "daemon.log"),
            "--region", REGION)
        mounted = True
        yield server, bucket, mnt
    finally:
        if mounted:
            try:
                cli("unmount", str(mnt), "--no-flush", timeout=120)
            except Exception as exc:  # noqa: BLE001 - report and still stop the server
                print(f"unmount failed: {exc}", file=sys.stderr)
                subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
        server.stop(timeout=5)


def time_local(state: dict, root: Path, threads: int, run: int) -> tuple[float, float]:
    path = root / "local" / f"run{run}"
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=threads), no_dist=True)
    blocked = time.perf_counter() - t0
    shutil.rmtree(path)
    return blocked, blocked


def time_mount(state: dict, mnt: Path, threads: int, run: int) -> tuple[float, float]:
    path = mnt / "mount" / f"run{run}"
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=threads), no_dist=True)
    blocked = time.perf_counter() - t0
    cli("flush", str(mnt))
    durable = time.perf_counter() - t0
    shutil.rmtree(path)  # retention; deletes its objects
    return blocked, durable


def s3torchconnector_target(server: EmbeddedS3, bucket: str,
                            threads: int) -> tuple[Callable | None, str]:
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageWriter
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip, say why
        return None, (f"s3torchconnector not usable ({type(exc).__name__}: {exc}); install "
                      "it with `pip install s3torchconnector tenacity` (it needs torch>=2.0.1"
                      " and must not replace the installed torch)")

    config = S3ClientConfig(force_path_style=True)

    def run_once(state: dict, run: int) -> tuple[float, float]:
        uri = f"s3://{bucket}/s3torchconnector/run{run}"
        writer = S3StorageWriter(REGION, uri, s3client_config=config, thread_count=threads)
        # its constructor takes no endpoint: point its file system at the embedded server
        writer.fs = S3FileSystem(REGION, s3_client=S3Client(
            REGION, endpoint=server.endpoint_url, s3client_config=config))
        writer.path = writer.fs.init_path(uri)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        blocked = time.perf_counter() - t0
        store = server.store(bucket)
        for obj in store.list_recursive(f"s3torchconnector/run{run}/"):
            store.delete(obj.key)
        return blocked, blocked

    return run_once, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="DCP save: lakefs-mount vs local disk vs S3")
    ap.add_argument("--size-gib", type=float, default=2.0, help="state size (GiB)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="DCP writer threads")
    ap.add_argument("--quick", action="store_true", help="128 MiB, 1 run")
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    args = ap.parse_args(argv)
    size = 128 * MiB if args.quick else int(args.size_gib * GiB)
    runs = 1 if args.quick else args.runs

    root = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir))
    print(f"DCP save of {size / GiB:.2f} GiB, {args.threads} writer threads, median of "
          f"{runs} run(s); torch {torch.__version__}; work dir {root}", flush=True)
    state = make_state(size)
    results: dict[str, list[tuple[float, float]]] = {}
    notes: list[str] = []
    try:
        with environment(root) as (server, bucket, mnt):
            s3tc, why = s3torchconnector_target(server, bucket, args.threads)
            if s3tc is None:
                notes.append(f"s3torchconnector: skipped - {why}")
            for run in range(runs):
                results.setdefault("local disk", []).append(
                    time_local(state, root, args.threads, run))
                results.setdefault("lakefs-mount", []).append(
                    time_mount(state, mnt, args.threads, run))
                if s3tc is not None:
                    try:
                        results.setdefault("s3torchconnector", []).append(s3tc(state, run))
                    except Exception as exc:  # noqa: BLE001 - report, keep the others
                        notes.append(f"s3torchconnector: failed - {type(exc).__name__}: "
                                     f"{str(exc)[:300]}")
                        s3tc = None
                        results.pop("s3torchconnector", None)
                print(f"run {run + 1}/{runs} done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'target':<18} {'blocked s':>10} {'durable s':>10} {'GiB/s (blocked)':>16}")
    for name, rows in results.items():
        blocked = statistics.median(r[0] for r in rows)
        durable = statistics.median(r[1] for r in rows)
        print(f"{name:<18} {blocked:>10.2f} {durable:>10.2f} {size / GiB / blocked:>16.2f}")
    print("durable: local disk = fsynced on this machine only; lakefs-mount = in S3 "
          "after `lakefs-mount flush`; s3torchconnector = in S3 when the save returns")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
