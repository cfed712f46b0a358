"""Daemon CPU per GiB written: with upload checksums (x-amz-checksum-crc32c) on and off,
or (`--tls`) over http and over https.

`python -m benchmarks.checksums [--files 4] [--mib 512] [--rounds 3] [--embedded | --tls]`
(root): an embedded SeaweedFS on 127.0.0.1; each round mounts fresh twice, once with
checksums on (the default) and once with `LAKEFS_MOUNT_UPLOAD_CHECKSUMS=off` (with
`--tls`: once over http, once over https with a CA made for the run; checksums on), in
alternating order, writes every file in 4 MiB write() calls, as torch.save writes a
checkpoint, and runs `flush`. It prints per round the daemon's CPU seconds per GiB from
the first write to the end of the flush and the wall time of write + flush, and the
medians of the per-round ratios of the second variant to the first. By default the
mounts name a bucket of a server this script starts with a key; `--embedded` mounts
without a SOURCE instead (`lakefs-mount mount MOUNTPOINT`: the daemon starts and keys
its own server), as the quick start does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cold_restore import _cpu_seconds
from benchmarks.tlsca import make_ca
from lakefs_mount.s3.checksums import OFF_VARIABLE
from lakefs_mount.s3.embedded import EmbeddedS3

CLI = str(Path(sys.executable).parent / "lakefs-mount")
WRITE_SIZE = 4 * 1024 * 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class Variant:
    name: str
    endpoint: str | None  # None: the daemon's own embedded server
    env: dict[str, str]  # set for the mount
    checksums: bool


def _write_and_flush(variant: Variant, bucket: str, work: Path, files: int,
                     body: bytes) -> dict[str, Any]:
    """One mount, write, flush."""
    name = variant.name
    mnt, cache = work / "mnt", work / f"cache-{name}"
    mnt.mkdir(exist_ok=True)
    env = {**os.environ, **variant.env}
    source, where = ([], ["--embedded-dir", str(work / "embedded")]) \
        if variant.endpoint is None else \
        ([f"s3://{bucket}"], ["--endpoint-url", variant.endpoint])
    subprocess.run([CLI, "mount", *source, str(mnt), *where, "--cache-dir", str(cache),
                    "--log-file", str(work / f"daemon-{name}.log")], check=True, env=env)
    pid = 0
    try:
        status = json.loads(subprocess.run([CLI, "status", str(mnt), "--json"], check=True,
                                           capture_output=True, text=True).stdout)
        pid = int(status["pid"])
        cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
        for i in range(files):
            with open(mnt / f"{name}-{i}.bin", "wb", buffering=0) as f:
                for at in range(0, len(body), WRITE_SIZE):
                    f.write(body[at:at + WRITE_SIZE])
        subprocess.run([CLI, "flush", str(mnt)], check=True, capture_output=True)
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds(pid) - cpu0
        checksums = json.loads(subprocess.run([CLI, "status", str(mnt), "--json"], check=True,
                                              capture_output=True, text=True).stdout
                               )["checksums"]
    finally:
        if subprocess.run([CLI, "unmount", str(mnt)], check=False).returncode:
            os.kill(pid, 9)  # (a failed flush: nothing of it is worth keeping)
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
        shutil.rmtree(cache, ignore_errors=True)
    assert (checksums != "off") == variant.checksums, checksums
    gib = files * len(body) / 1024**3
    return {"wall_s": wall, "cpu_s_per_gib": cpu / gib, "checksums": checksums}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/var/tmp/lakefs-mount-checksums")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--embedded", action="store_true",
                     help="mount without a SOURCE: the daemon's own embedded server")
    how.add_argument("--tls", action="store_true", help="compare http with https")
    args = parser.parse_args(argv)
    # A server that checks keys: SeaweedFS takes aws-chunked trailers only from a known one
    keys = {"AWS_ACCESS_KEY_ID": "benchaccesskey", "AWS_SECRET_ACCESS_KEY": "benchsecretkey0123",
            "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(keys)
    work = Path(tempfile.mkdtemp(dir=Path(args.workdir).parent, prefix="checksums-"))
    tls = make_ca(work / "tls") if args.tls else None
    server = None if args.embedded else EmbeddedS3(
        work / "s3", access_key=keys["AWS_ACCESS_KEY_ID"],
        secret_key=keys["AWS_SECRET_ACCESS_KEY"],
        tls=None if tls is None else (tls.cert, tls.key)).start(timeout=60)
    endpoint = None if server is None else server.endpoint_url
    if tls is not None and server is not None:
        https = f"https://127.0.0.1:{server.https_port}"
        first, second = (Variant("http", endpoint, {}, True),
                         Variant("https", https, {"AWS_CA_BUNDLE": str(tls.ca)}, True))
    else:
        first, second = (Variant("off", endpoint, {OFF_VARIABLE: "off"}, False),
                         Variant("on", endpoint, {OFF_VARIABLE: ""}, True))
    try:
        bucket = "checksums"
        if server is not None:
            server.create_bucket(bucket)
        body = os.urandom(args.mib * MiB)
        rows: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = (second, first) if r % 2 == 0 else (first, second)
            row = {v.name: _write_and_flush(v, bucket, work, args.files, body) for v in order}
            rows.append(row)
            print(f"round {r + 1}: " + "; ".join(
                f"{k}: {v['cpu_s_per_gib']:.3f} CPU s/GiB, write+flush "
                f"{v['wall_s']:.2f} s" for k, v in row.items()), flush=True)
        for v in (first, second):
            print(f"median {v.name}: " + ", ".join(
                f"{key} {statistics.median(x[v.name][key] for x in rows):.3f}"
                for key in ("cpu_s_per_gib", "wall_s")))
        cpu = statistics.median(x[second.name]["cpu_s_per_gib"]
                                / x[first.name]["cpu_s_per_gib"] for x in rows)
        wall = statistics.median(x[second.name]["wall_s"] / x[first.name]["wall_s"]
                                 for x in rows)
        print(f"median of per-round ratios, {second.name} / {first.name}: daemon CPU per "
              f"GiB {cpu:.3f}, write+flush wall {wall:.3f} "
              f"(checksums {rows[0][second.name]['checksums']})")
    finally:
        if server is not None:
            server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
