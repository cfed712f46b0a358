"""Cold restore through the native session with 1 MiB against 4 MiB FUSE requests.

`python -m benchmarks.request_size [--files 2] [--mib 512] [--rounds 3]` (root): an
embedded SeaweedFS on 127.0.0.1 holds the files; each round mounts fresh (empty cache dir,
page cache dropped) once with fs.fuse.max_pages_limit at 256 (1 MiB requests, the kernel's
default) and once at 1024 (4 MiB), in alternating order, and reads every file once in
4 MiB read() calls, as torch.load reads a checkpoint. It prints per round the wall time,
the read rate and the daemon's CPU seconds, and the medians of the per-round ratios. The
sysctl is set back to what it was at the end.

The native session asks for at most `MAX_PAGES` (lakefs_mount/kernel/session.py): 256
today, since 4 MiB did not pay (benchmarks/README.md); set it to 1024 to measure again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lakefs_mount.s3.embedded import EmbeddedS3

LIMIT = Path("/proc/sys/fs/fuse/max_pages_limit")
CLI = str(Path(sys.executable).parent / "lakefs-mount")
READ_SIZE = 4 * 1024 * 1024
MiB = 1024 * 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _restore(server: EmbeddedS3, bucket: str, work: Path, names: list[str],
             digests: dict[str, str], pages: int) -> dict[str, float]:
    LIMIT.write_text(f"{pages}\n")
    mnt, cache = work / "mnt", work / f"cache-{pages}"
    mnt.mkdir(exist_ok=True)
    subprocess.run([CLI, "mount", f"s3://{bucket}", str(mnt), "--endpoint-url",
                    server.endpoint_url, "--cache-dir", str(cache), "--fuse-session", "native",
                    "--log-file", str(work / f"daemon-{pages}.log")], check=True)
    try:
        status = json.loads(subprocess.run([CLI, "status", str(mnt), "--json"], check=True,
                                           capture_output=True, text=True).stdout)
        pid = int(status["pid"])
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
        total = 0
        for name in names:
            h = hashlib.sha256()
            with open(mnt / name, "rb", buffering=0) as f:
                while chunk := f.read(READ_SIZE):
                    h.update(chunk)
                    total += len(chunk)
            assert h.hexdigest() == digests[name], f"{name}: bytes differ"
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds(pid) - cpu0
    finally:
        subprocess.run([CLI, "unmount", str(mnt)], check=False)
        shutil.rmtree(cache, ignore_errors=True)
    negotiated = [line for line in (work / f"daemon-{pages}.log").read_text().splitlines()
                  if "KiB requests" in line]
    assert negotiated and f"{pages * 4} KiB requests" in negotiated[-1], negotiated
    return {"wall_s": wall, "gib_s": total / wall / 1024**3, "daemon_cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/var/tmp/lakefs-mount-request-size")
    args = parser.parse_args(argv)
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # the server checks none
        os.environ.setdefault(name, value)
    before = LIMIT.read_text()
    work = Path(tempfile.mkdtemp(dir=Path(args.workdir).parent, prefix="request-size-"))
    server = EmbeddedS3(work / "s3").start(timeout=60)
    try:
        bucket = "request-size"
        server.create_bucket(bucket)
        store = server.store(bucket)
        names, digests = [f"ckpt{i}.bin" for i in range(args.files)], {}
        for name in names:
            body = os.urandom(args.mib * MiB)
            digests[name] = hashlib.sha256(body).hexdigest()
            store.put(name, body, {})
        rows: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = (256, 1024) if r % 2 == 0 else (1024, 256)
            row = {str(p): _restore(server, bucket, work, names, digests, p) for p in order}
            rows.append(row)
            print(f"round {r + 1}: " + "; ".join(
                f"{int(p) * 4 // 1024} MiB requests {v['wall_s']:.2f} s "
                f"({v['gib_s']:.2f} GiB/s, daemon {v['daemon_cpu_s']:.2f} s CPU)"
                for p, v in row.items()), flush=True)
        wall = statistics.median(x["1024"]["wall_s"] / x["256"]["wall_s"] for x in rows)
        cpu = statistics.median(x["1024"]["daemon_cpu_s"] / x["256"]["daemon_cpu_s"]
                                for x in rows)
        print(f"median of per-round ratios, 4 MiB / 1 MiB: wall {wall:.3f}, "
              f"daemon CPU {cpu:.3f}")
    finally:
        LIMIT.write_text(before)
        server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
