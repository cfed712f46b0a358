"""Daemon CPU per GiB written, with upload checksums (x-amz-checksum-crc32c) on and off.

`python -m benchmarks.checksums [--files 4] [--mib 512] [--rounds 3] [--embedded]` (root):
an embedded SeaweedFS on 127.0.0.1; each round mounts fresh twice, once with checksums on
(the default) and once with `LAKEFS_MOUNT_UPLOAD_CHECKSUMS=off`, in alternating order,
writes every file in 4 MiB write() calls, as torch.save writes a checkpoint, and runs
`flush`. It prints per round the daemon's CPU seconds per GiB from the first write to the
end of the flush and the wall time of write + flush, and the medians of the per-round
on/off ratios. By default the mounts name a bucket of a server this script starts with a
key; `--embedded` mounts without a SOURCE instead (`lakefs-mount mount MOUNTPOINT`: the
daemon starts and keys its own server), as the quick start does.
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
from pathlib import Path

from benchmarks.cold_restore import _cpu_seconds
from lakefs_mount.s3.checksums import OFF_VARIABLE
from lakefs_mount.s3.embedded import EmbeddedS3

CLI = str(Path(sys.executable).parent / "lakefs-mount")
WRITE_SIZE = 4 * 1024 * 1024
MiB = 1024 * 1024


def _write_and_flush(server: EmbeddedS3 | None, bucket: str, work: Path, files: int,
                     body: bytes, on: bool) -> dict[str, float]:
    """One mount, write, flush; without `server`, a mount of the daemon's own server."""
    name = "on" if on else "off"
    mnt, cache = work / "mnt", work / f"cache-{name}"
    mnt.mkdir(exist_ok=True)
    env = dict(os.environ)
    env[OFF_VARIABLE] = "" if on else "off"
    source, where = ([], ["--embedded-dir", str(work / "embedded")]) if server is None else \
        ([f"s3://{bucket}"], ["--endpoint-url", server.endpoint_url])
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
    assert (checksums != "off") == on, checksums
    gib = files * len(body) / 1024**3
    return {"wall_s": wall, "cpu_s_per_gib": cpu / gib, "checksums": checksums}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/var/tmp/lakefs-mount-checksums")
    parser.add_argument("--embedded", action="store_true",
                        help="mount without a SOURCE: the daemon's own embedded server")
    args = parser.parse_args(argv)
    # A server that checks keys: SeaweedFS takes aws-chunked trailers only from a known one
    keys = {"AWS_ACCESS_KEY_ID": "benchaccesskey", "AWS_SECRET_ACCESS_KEY": "benchsecretkey0123",
            "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(keys)
    work = Path(tempfile.mkdtemp(dir=Path(args.workdir).parent, prefix="checksums-"))
    server = None if args.embedded else EmbeddedS3(
        work / "s3", access_key=keys["AWS_ACCESS_KEY_ID"],
        secret_key=keys["AWS_SECRET_ACCESS_KEY"]).start(timeout=60)
    try:
        bucket = "checksums"
        if server is not None:
            server.create_bucket(bucket)
        body = os.urandom(args.mib * MiB)
        rows: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            row = {("on" if on else "off"): _write_and_flush(server, bucket, work, args.files,
                                                             body, on) for on in order}
            rows.append(row)
            print(f"round {r + 1}: " + "; ".join(
                f"checksums {k}: {v['cpu_s_per_gib']:.3f} CPU s/GiB, write+flush "
                f"{v['wall_s']:.2f} s" for k, v in row.items()), flush=True)
        cpu = statistics.median(x["on"]["cpu_s_per_gib"] / x["off"]["cpu_s_per_gib"]
                                for x in rows)
        wall = statistics.median(x["on"]["wall_s"] / x["off"]["wall_s"] for x in rows)
        print(f"median of per-round ratios, on / off: daemon CPU per GiB {cpu:.3f}, "
              f"write+flush wall {wall:.3f} ({rows[0]['on']['checksums']})")
    finally:
        if server is not None:
            server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
