"""Cold restore through the native session, one setting of the machine against another.

`python -m benchmarks.cold_restore [--vary request-size|spliced-replies] [--files 2]
[--mib 512] [--rounds 3]` (root): an embedded SeaweedFS on 127.0.0.1 holds the files;
each round mounts fresh (empty cache dir, page cache dropped) once with each setting, in
alternating order, and reads every file once in 4 MiB read() calls, as torch.load reads
a checkpoint. It prints per round the wall time, the read rate and the daemon's CPU
seconds, and the medians of the per-round ratios B / A. The sysctl is set back to what
it was at the end.

- `request-size`: fs.fuse.max_pages_limit at 256 (A: 1 MiB requests, the kernel's
  default) against 1024 (B: 4 MiB). The native session asks for at most `MAX_PAGES`
  (lakefs_mount/fuse/native/session.py): 256 today, since 4 MiB did not pay
  (benchmarks/README.md); set it to 1024 to measure again.
- `spliced-replies`: fs.pipe-max-size at 1 MiB (A: read replies copied, as a daemon
  without CAP_SYS_RESOURCE must then) against 2 MiB (B: spliced, lakefs_mount/fuse/native/
  splicereply.py). Meaningless where the daemon has CAP_SYS_RESOURCE (both splice).
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

CLI = str(Path(sys.executable).parent / "lakefs-mount")
READ_SIZE = 4 * 1024 * 1024
MiB = 1024 * 1024
# what varies: the sysctl and its values A and B
VARIANTS = {
    "request-size": (Path("/proc/sys/fs/fuse/max_pages_limit"), (256, 1024)),
    "spliced-replies": (Path("/proc/sys/fs/pipe-max-size"), (MiB, 2 * MiB)),
}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _check(vary: str, value: int, status: dict, log: str) -> None:
    """The mount did what the setting says, or the comparison means nothing."""
    if vary == "request-size":
        negotiated = [line for line in log.splitlines() if "KiB requests" in line]
        assert negotiated and f"{value * 4} KiB requests" in negotiated[-1], negotiated
    else:
        assert status["spliced_reads"] == (value >= 2 * MiB), status["spliced_reads"]


def _restore(server: EmbeddedS3, bucket: str, work: Path, names: list[str],
             digests: dict[str, str], vary: str, value: int) -> dict[str, float]:
    sysctl, _ = VARIANTS[vary]
    sysctl.write_text(f"{value}\n")
    mnt, cache, log = work / "mnt", work / f"cache-{value}", work / f"daemon-{value}.log"
    mnt.mkdir(exist_ok=True)
    subprocess.run([CLI, "mount", f"s3://{bucket}", str(mnt), "--endpoint-url",
                    server.endpoint_url, "--cache-dir", str(cache), "--fuse-session", "native",
                    "--log-file", str(log)], check=True)
    try:
        status = json.loads(subprocess.run([CLI, "status", str(mnt), "--json"], check=True,
                                           capture_output=True, text=True).stdout)
        _check(vary, value, status, log.read_text())
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
    return {"wall_s": wall, "gib_s": total / wall / 1024**3, "daemon_cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vary", choices=sorted(VARIANTS), default="request-size")
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/var/tmp/lakefs-mount-cold-restore")
    args = parser.parse_args(argv)
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # the server checks none
        os.environ.setdefault(name, value)
    sysctl, (a, b) = VARIANTS[args.vary]
    before = sysctl.read_text()
    work = Path(tempfile.mkdtemp(dir=Path(args.workdir).parent, prefix="cold-restore-"))
    server = EmbeddedS3(work / "s3").start(timeout=60)
    try:
        bucket = "cold-restore"
        server.create_bucket(bucket)
        store = server.store(bucket)
        names, digests = [f"ckpt{i}.bin" for i in range(args.files)], {}
        for name in names:
            body = os.urandom(args.mib * MiB)
            digests[name] = hashlib.sha256(body).hexdigest()
            store.put(name, body, {})
        rows: list[dict[int, dict[str, float]]] = []
        for r in range(args.rounds):
            order = (a, b) if r % 2 == 0 else (b, a)
            row = {v: _restore(server, bucket, work, names, digests, args.vary, v)
                   for v in order}
            rows.append(row)
            print(f"round {r + 1}: " + "; ".join(
                f"{sysctl.name}={v}: {x['wall_s']:.2f} s ({x['gib_s']:.2f} GiB/s, "
                f"daemon {x['daemon_cpu_s']:.2f} s CPU)" for v, x in row.items()), flush=True)
        wall = statistics.median(x[b]["wall_s"] / x[a]["wall_s"] for x in rows)
        cpu = statistics.median(x[b]["daemon_cpu_s"] / x[a]["daemon_cpu_s"] for x in rows)
        print(f"median of per-round ratios, {sysctl.name} {b} / {a}: wall {wall:.3f}, "
              f"daemon CPU {cpu:.3f}")
    finally:
        sysctl.write_text(before)
        server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
