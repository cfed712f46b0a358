"""`python -m benchmarks soak --hours H`: days of checkpointing compressed into hours
(issue 51). Not in CI; a fast variant (`--quick`) is a smoke test.

A training job checkpoints every `--every` seconds into one bucket through the mount, keeps
the last `--keep` checkpoints and restarts from the newest when a node fails. Each step:
a `step_N` directory with a torch.save file, DCP shards (world size 1,
`FileSystemWriter(thread_count=2)`) and a safetensors file of `--mib` MiB each (one state
dict, saved three ways; it holds the step number, so an older step read back fails),
then `lakefs_mount.commit` of the directory, then `shutil.rmtree` of all but the last
`--keep` steps. A step that fails (the daemon killed under it, a full cache disk past the
daemon's patience) is retried from the start, up to 5 times. Every `--restore-every` steps
the newest committed step is loaded on a fresh mount over an empty cache dir (straight
to SeaweedFS, as another node would) and every tensor compared with what was saved.
After each step the committed steps kept are checked in S3 against their manifests.

At fractions of the run: S3 outages of `--outage-seconds` through a fault proxy between
the mount and SeaweedFS (tests/faultproxy.py; the first a black hole, the next refused
connections, alternating); kill -9 of the daemon during a save, restarted with the same
cache dir by a watcher that does what the systemd unit's `Restart=on-failure` does; a
full cache disk: the cache dir is on a small ext4 file system the benchmark loop-mounts
(`mount -o loop`, removed at the end; nothing on the machine is set), filled by a ballast
file to a quarter of a step's bytes for one step. SeaweedFS keeps deleted data until its
volumes are vacuumed: `weed shell` `volume.vacuum` every `--vacuum-every` seconds.

Per step (`steps.csv`): the stall (the three saves), time to durable (saves + commit),
restore time; the daemon's VmRSS, threads, open fds; journal and WAL bytes; `cache_used`;
S3 objects and incomplete multipart uploads; SeaweedFS's data dir on disk (du). At the end:
flush, 0 incomplete multipart uploads, every step kept verified (`lakefs_mount.verify`,
every CRC-32C), the bucket holding exactly the steps kept; `results.md` with the checks,
`soak.png`. The exit status is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.checkpoint import RankPool
from benchmarks.ckpt_loop import s3_keys
from benchmarks.ckpt_ranks import DataError
from benchmarks.s3config import s3_config
from benchmarks.targets import (
    LakefsTarget,
    _alive,
    clean_up_on_sigterm,
    create_warm_bucket,
    start_embedded_s3,
    use_bench_credentials,
)
from lakefs_mount import api
from lakefs_mount.ops.mountpoint import is_mounted
from lakefs_mount.s3.embedded import find_weed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from faultproxy import FaultProxy  # noqa: E402  (a test tool, shared with the tests)

RESULTS = Path(__file__).resolve().parent / "results" / "soak"
MiB = 1 << 20
MANIFEST = ".lakefs-commit.json"
ATTEMPTS = 5  # tries of one step before it counts as lost
GROWTH_GOAL = 10.0  # % per hour, after the warm-up
WARMUP = 0.1  # share of the run before the trends are fitted
# per-step series judged for growth; the timings without the steps an event hit
SERIES = {"rss_mib": "daemon RSS, MiB", "threads": "daemon threads", "fds": "daemon open fds",
          "journal_mib": "journal + WAL, MiB", "wal_mib": "WAL, MiB",
          "cache_used_mib": "cache used, MiB", "s3_objects": "S3 objects (the job's)",
          "s3_records": "S3 objects under .lakefs-mount/",
          "seaweed_floor_mib": "SeaweedFS data dir after each vacuum, MiB",
          "stall_s": "stall (saves), s",
          "durable_s": "time to durable, s", "restore_s": "cold restore, s"}
TIMINGS = ("stall_s", "durable_s", "restore_s")
# the daemon's own: a restart starts them afresh, so slopes are taken within one daemon
DAEMON = ("rss_mib", "threads", "fds", "journal_mib", "wal_mib", "cache_used_mib")
COLUMNS = ("step", "t_s", "attempts", "events", "stall_s", "torch_s", "dcp_s",
           "safetensors_s", "commit_s", "durable_s",
           "retention_s", "restore_s", "restore_mount_s", "rss_mib", "threads", "fds",
           "journal_mib", "wal_mib", "cache_used_mib", "s3_objects", "s3_records",
           "mpu_incomplete",
           "seaweed_mib", "weed_rss_mib", "lost", "error")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def proc_status(pid: int | None) -> dict[str, float | None]:
    """VmRSS (MiB), threads and open fds of `pid`; None for each while it is gone."""
    out: dict[str, float | None] = {"rss_mib": None, "threads": None, "fds": None}
    if pid is None:
        return out
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "VmRSS":
                out["rss_mib"] = round(int(value.split()[0]) / 1024, 1)
            elif key == "Threads":
                out["threads"] = int(value)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def du_bytes(path: Path) -> int:
    """Bytes allocated under `path` (sparse volume files count what they hold)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def theil_sen(xs: list[float], ys: list[float], groups: list[int] | None = None) -> float:
    """The median of the slopes between all pairs (of one group, where given: one
    daemon's life): a few outliers (an outage's step, a vacuum's drop) do not tilt it,
    where a least-squares fit follows them; nor does a restart's step up or down."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs))
              for j in range(i + 1, len(xs))
              if xs[j] != xs[i] and (groups is None or groups[i] == groups[j])]
    return statistics.median(slopes) if slopes else 0.0


def trend(rows: list[dict[str, Any]], key: str, start_s: float,
          restarts: Sequence[float] = ()) -> dict[str, Any]:
    """Growth of `key` after `start_s`, in % of its median per hour (Theil-Sen slope;
    the daemon's series within each daemon's life, split at the `restarts`' times)."""
    points = [(r["t_s"] / 3600, float(r[key]), sum(t <= r["t_s"] for t in restarts))
              for r in rows if r["t_s"] >= start_s and r.get(key) not in (None, "")
              and not (key in TIMINGS and r["events"])]
    if len(points) < 5:
        return {"n": len(points), "verdict": "n/a (fewer than 5 points)"}
    xs, ys, lives = zip(*points, strict=True)
    slope = theil_sen(list(xs), list(ys), list(lives) if key in DAEMON else None)
    level = statistics.median(ys)
    pct = 100 * slope / level if level else (0.0 if slope == 0 else math.inf)
    return {"n": len(points), "median": round(level, 3), "slope_per_h": round(slope, 4),
            "pct_per_h": round(pct, 2), "first": ys[0], "last": ys[-1],
            "verdict": "PASS" if pct <= GROWTH_GOAL else "FAIL"}


class CacheDisk:
    """A small ext4 file system for the cache dir (`mount -o loop` of a sparse image: the
    loop device goes with the unmount), and a ballast file that fills it."""

    def __init__(self, root: Path, size: int) -> None:
        self.image = root / "cache-disk.img"
        self.path = root / "cache-disk"
        self.ballast = self.path / "ballast"
        self.path.mkdir(parents=True)
        with open(self.image, "wb") as f:
            f.truncate(size)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)], check=True,
                       capture_output=True, timeout=120)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.path)], check=True,
                       capture_output=True, timeout=60)

    def fill(self, leave: int) -> int:
        """Take all but `leave` bytes of the free space; the ballast's size."""
        st = os.statvfs(self.path)
        size = max(0, st.f_bavail * st.f_frsize - leave)
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        return size

    def drain(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()

    def remove(self) -> None:
        self.drain()
        if is_mounted(self.path):
            proc = subprocess.run(["umount", str(self.path)], capture_output=True, timeout=60)
            if proc.returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True,
                               timeout=60)


class Supervisor(threading.Thread):
    """What systemd's `Restart=on-failure` does for the unit: when the daemon dies, wait
    `delay` seconds and mount again with the same cache dir (`lakefs-mount mount` detaches
    the stale mount first). `up` is set while a daemon serves the mount."""

    def __init__(self, target: LakefsTarget, delay: float, events: list[dict[str, Any]],
                 clock: Any) -> None:
        super().__init__(name="soak-supervisor", daemon=True)
        self.target = target
        self.delay = delay
        self.events = events
        self.clock = clock
        self.killed: set[int] = set()  # pids the benchmark killed itself
        self.up = threading.Event()
        self.up.set()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            pid = self.target.pid
            if pid is None or _alive(pid):
                continue
            self.up.clear()
            expected = pid in self.killed
            self.events.append({"t_s": self.clock(), "kind": "daemon died",
                                "detail": f"pid {pid}" + ("" if expected else
                                                          " UNEXPECTEDLY (not killed by us)")})
            self.target.pid = None
            if self.stopping.wait(self.delay):
                return
            for attempt in range(1, 11):
                began = time.monotonic()
                try:
                    self.target.start()
                except Exception as exc:  # noqa: BLE001 - recorded, tried again
                    self.events.append({"t_s": self.clock(), "kind": "restart failed",
                                        "detail": f"attempt {attempt}: {str(exc)[-500:]}"})
                    if self.stopping.wait(5):
                        return
                    continue
                self.events.append({"t_s": self.clock(), "kind": "restarted",
                                    "detail": f"pid {self.target.pid} in "
                                              f"{time.monotonic() - began:.1f} s"})
                self.up.set()
                break

    def kill(self) -> None:
        pid = self.target.pid
        if pid is not None:
            self.killed.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


def vacuum(master_port: int, grpc_port: int) -> str:
    """`volume.vacuum` of every volume with garbage (SeaweedFS frees deleted objects'
    bytes only then); weed shell's output, shortened."""
    script = "lock\nvolume.vacuum -garbageThreshold 0.01\nunlock\nexit\n"
    master = f"127.0.0.1:{master_port}.{grpc_port}"  # weed's form for a gRPC port of its own
    proc = subprocess.run([find_weed(), "shell", f"-master={master}"],
                          input=script, capture_output=True, text=True, timeout=600)
    return (proc.stdout + proc.stderr).strip()[-300:]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir)
        self.out = Path(args.out)
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.committed: list[int] = []  # steps committed and not deleted, oldest first
        self.lost: list[str] = []
        self.corrupt: list[str] = []
        self.errors: list[str] = []
        self.started = time.monotonic()
        self.duration = args.hours * 3600 if args.minutes is None else args.minutes * 60
        self.step_bytes = 3 * args.mib * MiB
        self.vacuums: list[dict[str, Any]] = []
        self.header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                       f"`python -m benchmarks soak {' '.join(sys.argv[2:])}`")

    @classmethod
    def reread(cls, out: Path) -> Soak:
        """A run's results as it left them in `out`, to judge them again (`--report`)."""
        saved = json.loads((out / "results.json").read_text())
        soak = cls(argparse.Namespace(**{**saved["args"], "out": str(out)}))
        with open(out / "steps.csv", newline="") as f:
            soak.rows = [{**r, "t_s": float(r["t_s"]), "lost": int(r["lost"] or 0)}
                         for r in csv.DictReader(f)]
        soak.events, soak.vacuums = saved["events"], saved["vacuums"]
        soak.lost, soak.corrupt = saved["lost_detail"], saved["corrupt"]
        soak.errors, soak.final = saved["errors"], saved["final"]
        soak.header = saved.get("header") or (out / "results.md").read_text().splitlines()[2]
        return soak

    def clock(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def event(self, kind: str, detail: str = "") -> None:
        self.events.append({"t_s": self.clock(), "kind": kind, "detail": detail})
        log(f"{kind}: {detail}")

    def progress(self, step: int) -> float:
        by_time = self.clock() / self.duration
        by_steps = step / self.args.steps if self.args.steps else 0.0
        return max(by_time, by_steps)

    def done(self, step: int) -> bool:
        return (self.clock() >= self.duration
                or (self.args.steps is not None and step >= self.args.steps))

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        import boto3

        stack = contextlib.ExitStack()
        try:
            server = start_embedded_s3(self.work / "seaweedfs")
            stack.callback(server.stop)
            self.server = server
            self.client = boto3.client("s3", endpoint_url=server.endpoint_url,
                                       region_name="us-east-1", config=s3_config(8))
            self.bucket = create_warm_bucket(self.client, "soak")
            self.proxy = stack.enter_context(FaultProxy("127.0.0.1", server.server.port))
            cache_root = self.work
            # the cache holds the steps kept and the next; far below that, each create
            # waits for uploads (a part's room is kept free under both bounds)
            cache_size = max((self.args.keep + 1) * self.step_bytes, 256 * MiB)
            max_dirty = max(2 * self.step_bytes, 128 * MiB)
            size = cache_size + self.step_bytes + 512 * MiB
            self.disk: CacheDisk | None = None
            if self.args.full_disk_at and os.geteuid() == 0 and shutil.which("mkfs.ext4"):
                self.disk = CacheDisk(self.work, size)
                stack.callback(self.disk.remove)
                cache_root = self.disk.path
            elif self.args.full_disk_at:
                self.event("full cache disk skipped", "needs root and mkfs.ext4")
            self.target = LakefsTarget(
                self.work / "job", self.proxy.endpoint_url, self.bucket, "auto",
                ("--cache-size", str(cache_size), "--max-dirty", str(max_dirty)),
                session="native")
            self.target.cache_dir = cache_root / "cache"
            stack.callback(self.target.kill)
            self.restorer = LakefsTarget(self.work / "restore", server.endpoint_url,
                                         self.bucket, "auto", session="native")
            stack.callback(self.restorer.kill)
            self.pool = RankPool(1, self.args.mib, server.endpoint_url)
            stack.callback(lambda: self.pool.close(wait=5))
            # the libraries' first calls in a process, which a job pays once, not per step
            self.pool.call("warm_up", [{"places": [str(self.work / "warm-up")]}])
            self.target.start()
            self.supervisor = Supervisor(self.target, self.args.restart_delay, self.events,
                                         self.clock)
            self.supervisor.start()
            stack.callback(self.supervisor.stop)
            self.timers: list[threading.Timer] = []
            stack.callback(self.cancel_timers)
            self.started = time.monotonic()
            self.loop()
            self.finish()
        except KeyboardInterrupt as exc:
            self.errors.append(f"interrupted: {exc}")
            log(f"interrupted ({exc}): cleaning up")
        except Exception as exc:  # noqa: BLE001 - reported in the results
            self.errors.append(f"{type(exc).__name__}: {str(exc)[-1500:]}")
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                self.proxy.hang = False
                self.proxy.fail = False
            stack.close()
            shutil.rmtree(self.work, ignore_errors=True)
        return self.report()

    def cancel_timers(self) -> None:
        for timer in self.timers:
            timer.cancel()

    def later(self, seconds: float, fn: Any) -> None:
        timer = threading.Timer(seconds, fn)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)

    def due(self, fractions: list[float], step: int, fired: set[float]) -> float | None:
        for f in fractions:
            if f not in fired and self.progress(step) >= f:
                fired.add(f)
                return f
        return None

    def loop(self) -> None:
        args = self.args
        fired: dict[str, set[float]] = {"outage": set(), "kill": set(), "full": set()}
        outages = 0
        last_vacuum = self.clock()
        step = 0
        while not self.done(step):
            next_at = step * args.every
            if self.clock() < next_at:
                time.sleep(next_at - self.clock())
            events: list[str] = []
            if self.due(args.outage_at, step, fired["outage"]) is not None:
                mode = ("hang", "fail")[outages % 2]
                outages += 1
                self.start_outage(mode)
                events.append(f"outage ({mode})")
            kill = self.due(args.kill_at, step, fired["kill"]) is not None
            if kill:
                events.append("kill -9")
            full = self.disk is not None and \
                self.due(args.full_disk_at, step, fired["full"]) is not None
            if full:
                events.append("full cache disk")
            row = self.step(step, kill=kill, full=full)
            row["events"] = ";".join(events + row.pop("more_events", []))
            self.rows.append(row)
            self.write_rows()
            log(f"step {step}: stall {row['stall_s']} s, durable {row['durable_s']} s"
                + (f", restore {row['restore_s']} s" if row["restore_s"] != "" else "")
                + f", rss {row['rss_mib']} MiB, cache {row['cache_used_mib']} MiB"
                + (f" [{row['events']}]" if row["events"] else "")
                + (f" ERROR {row['error']}" if row["error"] else ""))
            if args.vacuum_every and self.clock() - last_vacuum >= args.vacuum_every:
                self.do_vacuum()
                last_vacuum = self.clock()
            step += 1

    def start_outage(self, mode: str) -> None:
        seconds = self.args.outage_seconds
        self.event("outage", f"{mode} for {seconds:g} s")
        setattr(self.proxy, mode, True)

        def end() -> None:
            setattr(self.proxy, mode, False)
            self.event("outage over", mode)

        self.later(seconds, end)

    def do_vacuum(self) -> None:
        began = time.monotonic()
        before = du_bytes(self.server.server.data_dir)
        try:
            ports = self.server.server.ports
            out = vacuum(ports["master"], ports["master_grpc"])
        except Exception as exc:  # noqa: BLE001 - recorded
            out = f"failed: {exc}"
        after = du_bytes(self.server.server.data_dir)
        self.vacuums.append({"t_s": self.clock(), "seconds": round(time.monotonic() - began, 1),
                             "before_mib": round(before / MiB), "after_mib": round(after / MiB),
                             "output": out[-160:]})
        log(f"vacuum: {before / MiB:.0f} -> {after / MiB:.0f} MiB in "
            f"{time.monotonic() - began:.1f} s")

    # ------------------------------------------------------------------ one step

    def step(self, step: int, *, kill: bool, full: bool) -> dict[str, Any]:
        args = self.args
        row: dict[str, Any] = {k: "" for k in COLUMNS}
        row.update(step=step, t_s=self.clock(), lost=0, more_events=[])
        directory = self.target.path / f"step_{step}"
        errors = []
        committed = False
        if full and self.disk is not None:
            took = self.disk.fill(self.step_bytes // 4)
            self.event("cache disk filled", f"ballast {took / MiB:.0f} MiB, "
                       f"{self.step_bytes // 4 / MiB:.0f} MiB left free")
        try:
            for attempt in range(1, ATTEMPTS + 1):
                row["attempts"] = attempt
                if not self.supervisor.up.wait(300):
                    errors.append("the mount did not come back within 300 s")
                    continue
                try:
                    if kill and attempt == 1:
                        delay = max(0.2, 0.5 * float(self.last("stall_s") or 1.0))
                        self.later(delay, self.supervisor.kill)
                        self.event("kill -9", f"daemon {self.target.pid}, {delay:.1f} s into "
                                   f"step {step}")
                    if directory.exists():
                        shutil.rmtree(directory)  # a retried step starts over
                    self.pool.call("mark", [{"step": step, "dcp_threads": 2}])
                    began = time.monotonic()
                    for fmt, place in self.places(directory):
                        (took,) = self.pool.call("save", [{"fmt": fmt, "place": str(place)}],
                                                 timeout=args.step_timeout)
                        row[f"{fmt}_s"] = round(took, 3)
                    saved = time.monotonic()
                    api.commit(directory, timeout=args.step_timeout)
                    row["stall_s"] = round(saved - began, 3)
                    row["commit_s"] = round(time.monotonic() - saved, 3)
                    row["durable_s"] = round(time.monotonic() - began, 3)
                    committed = True
                    break
                except DataError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the job retries its step
                    last = str(exc).strip().splitlines()[-1:] or [""]  # a rank's traceback
                    msg = f"attempt {attempt}: {type(exc).__name__}: {last[0][-300:]}"
                    errors.append(msg)
                    log(f"step {step} {msg}")
                    if "did not answer" in str(exc):  # a rank stuck in the kernel
                        self.pool.close(wait=5)
                        self.pool = RankPool(1, args.mib, self.server.endpoint_url)
                    if self.disk is not None and full:
                        self.disk.drain()
                        self.event("cache disk drained", "before the retry")
                    time.sleep(2)
        finally:
            if self.disk is not None and full:
                self.disk.drain()
        if not committed:
            row["lost"] = 1
            self.lost.append(f"step {step}: never committed ({'; '.join(errors)[-500:]})")
        else:
            self.committed.append(step)
        row["error"] = " | ".join(errors)[-600:]
        began = time.monotonic()
        while len(self.committed) > args.keep:
            old = self.committed.pop(0)
            shutil.rmtree(self.target.path / f"step_{old}")
        for old in range(step):  # steps never committed leave directories too
            stray = self.target.path / f"step_{old}"
            if old not in self.committed and stray.exists():
                shutil.rmtree(stray)
        row["retention_s"] = round(time.monotonic() - began, 3)
        if committed and (step + 1) % args.restore_every == 0:
            self.restore(step, row)
        row["lost"] += self.check_kept(step)
        row.update(self.sample())
        return row

    def places(self, directory: Path) -> list[tuple[str, Path]]:
        return [("torch", directory / "model.pt"), ("dcp", directory / "dcp"),
                ("safetensors", directory / "model.safetensors")]

    def last(self, key: str) -> Any:
        for row in reversed(self.rows):
            if row.get(key) not in (None, ""):
                return row[key]
        return None

    def restore(self, step: int, row: dict[str, Any]) -> None:
        """Load step `step` on a fresh mount over an empty cache dir, compared tensor by
        tensor by the rank that saved it."""
        shutil.rmtree(self.restorer.cache_dir, ignore_errors=True)
        began = time.monotonic()
        try:
            self.restorer.start()
            row["restore_mount_s"] = round(time.monotonic() - began, 3)
            began = time.monotonic()
            for fmt, place in self.places(self.restorer.path / f"step_{step}"):
                self.pool.call("load", [{"fmt": fmt, "place": str(place)}],
                               timeout=self.args.step_timeout)
            row["restore_s"] = round(time.monotonic() - began, 3)
            self.restorer.stop()
        except DataError as exc:
            self.corrupt.append(f"step {step}: {exc}")
            row["error"] += f" | CORRUPT: {exc}"
        except Exception as exc:  # noqa: BLE001 - recorded
            row["error"] += f" | restore: {type(exc).__name__}: {str(exc)[-300:]}"
            self.errors.append(f"restore of step {step}: {str(exc)[-300:]}")
        finally:
            if self.restorer.pid is not None:
                self.restorer.kill()
            shutil.rmtree(self.restorer.cache_dir, ignore_errors=True)

    def check_kept(self, step: int) -> int:
        """Each committed step still kept: its manifest in S3 and every file it lists at
        the size and ETag it lists (checkpoints.md, "Checking a checkpoint with boto3
        alone"). The number of steps that failed (each one is a lost checkpoint)."""
        bad = 0
        for kept in self.committed:
            prefix = f"step_{kept}/"
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=prefix + MANIFEST)["Body"]
                manifest = json.load(body)
                for f in manifest["files"]:
                    head = self.client.head_object(Bucket=self.bucket, Key=prefix + f["key"])
                    if head["ContentLength"] != f["size"] or \
                            head["ETag"].strip('"') != f["etag"]:
                        raise RuntimeError(f"{f['key']} differs from its manifest")
                if manifest["file_count"] < 4:
                    raise RuntimeError(f"only {manifest['file_count']} files committed")
            except Exception as exc:  # noqa: BLE001 - a lost checkpoint
                bad += 1
                self.lost.append(f"step {kept}, checked after step {step}: {exc}")
        return bad

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = proc_status(self.target.pid)
        journal = self.target.cache_dir / "journal.db"
        wal = Path(str(journal) + "-wal")
        sizes = [p.stat().st_size if p.exists() else 0 for p in (journal, wal)]
        out["journal_mib"] = round(sum(sizes) / MiB, 3)
        out["wal_mib"] = round(sizes[1] / MiB, 3)
        with contextlib.suppress(Exception):
            out["cache_used_mib"] = round(
                api.status(self.target.path)["cache_used"] / MiB, 1)
        keys = s3_keys(self.client, self.bucket, "")
        out["s3_records"] = sum(k.startswith(".lakefs-mount/") for k in keys)
        out["s3_objects"] = len(keys) - out["s3_records"]
        out["mpu_incomplete"] = self.incomplete_uploads()
        out["seaweed_mib"] = round(du_bytes(self.server.server.data_dir) / MiB, 1)
        out["weed_rss_mib"] = proc_status(self.server.server.pid)["rss_mib"]
        return out

    def incomplete_uploads(self) -> int:
        count = 0
        kwargs: dict[str, str] = {}
        while True:
            page = self.client.list_multipart_uploads(Bucket=self.bucket, **kwargs)
            count += len(page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return count
            kwargs = {"KeyMarker": page["NextKeyMarker"],
                      "UploadIdMarker": page["NextUploadIdMarker"]}

    # ------------------------------------------------------------------ the end

    def finish(self) -> None:
        """Flush, then what must hold once the job is gone: no multipart upload left,
        every step kept verified, nothing of a deleted step left in the bucket."""
        self.supervisor.stop()
        if not self.supervisor.up.is_set():
            self.supervisor.up.wait(5)
        began = time.monotonic()
        self.target.durable()
        self.final: dict[str, Any] = {"flush_s": round(time.monotonic() - began, 1)}
        self.final["mpu_incomplete"] = self.incomplete_uploads()
        verified = []
        for kept in self.committed:
            try:
                api.verify(self.target.path / f"step_{kept}")
                verified.append(kept)
            except Exception as exc:  # noqa: BLE001 - a corrupt checkpoint
                self.corrupt.append(f"step {kept}: verify: {str(exc)[-300:]}")
        self.final["verified"] = verified
        want = {f"step_{s}" for s in self.committed}
        tops = {k.split("/", 1)[0] for k in s3_keys(self.client, self.bucket, "")
                if not k.startswith(".lakefs")}  # the mounts' own records
        self.final["stray_prefixes"] = sorted(tops - want)
        self.final["missing_prefixes"] = sorted(want - tops)
        self.final.update(proc_status(self.target.pid))
        self.target.stop()
        self.do_vacuum()
        self.final["seaweed_mib_after_vacuum"] = self.vacuums[-1]["after_mib"]

    def write_rows(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "steps.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)

    def report(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.write_rows()
        final = getattr(self, "final", {})
        warm = WARMUP * (self.rows[-1]["t_s"] if self.rows else 0)
        restarts = [e["t_s"] for e in self.events if e["kind"] == "restarted"]
        floors = [{"t_s": v["t_s"], "seaweed_floor_mib": v["after_mib"], "events": ""}
                  for v in self.vacuums]
        trends = {k: trend(floors if k == "seaweed_floor_mib" else self.rows, k, warm,
                           restarts) for k in SERIES}
        lost = sum(int(r["lost"]) for r in self.rows)
        checks = {
            "no series grows > 10 %/h after the warm-up":
                all(t["verdict"] != "FAIL" for t in trends.values()),
            "0 lost checkpoints": lost == 0 and not self.lost,
            "0 corrupt checkpoints": not self.corrupt,
            "0 incomplete multipart uploads after the final flush":
                final.get("mpu_incomplete") == 0,
            "the bucket holds exactly the steps kept":
                final.get("stray_prefixes") == [] and final.get("missing_prefixes") == [],
            "restore times without drift": trends["restore_s"]["verdict"] != "FAIL",
            "ran to the end": not self.errors,
        }
        restores = [float(r["restore_s"]) for r in self.rows if r["restore_s"] != ""]
        summary = {"args": vars(self.args), "header": self.header,
                   "steps": len(self.rows), "lost": lost,
                   "lost_detail": self.lost, "corrupt": self.corrupt, "errors": self.errors,
                   "final": final, "trends": trends, "checks": checks,
                   "events": self.events, "vacuums": self.vacuums,
                   "restores": len(restores), "warmup_s": warm,
                   "ok": all(checks.values())}
        (self.out / "results.json").write_text(json.dumps(summary, indent=1, default=str)
                                               + "\n")
        self.markdown(summary)
        with contextlib.suppress(Exception):
            self.plot(warm)
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}: {name}")
        return 0 if summary["ok"] else 1

    def markdown(self, s: dict[str, Any]) -> None:
        a = self.args
        rows = self.rows
        lines = [f"# Soak: {len(rows)} checkpoint steps in "
                 f"{(rows[-1]['t_s'] if rows else 0) / 60:.0f} min",
                 "", self.header, "",
                 f"A step: torch.save, DCP (world size 1, 2 writer threads) and safetensors "
                 f"of one {a.mib} MiB state, every {a.every:g} s, then `commit`; the last "
                 f"{a.keep} steps kept; a cold restore of the newest every "
                 f"{a.restore_every} steps on a fresh mount, every tensor compared.", "",
                 "## Checks", "", "| Check | Result |", "|---|---|"]
        lines += [f"| {k} | {'PASS' if v else 'FAIL'} |" for k, v in s["checks"].items()]
        lines += ["", f"Lost: {s['lost']}; corrupt: {len(s['corrupt'])}; restores: "
                  f"{s['restores']}; final flush: {s['final'].get('flush_s')} s, incomplete "
                  f"multipart uploads after it: {s['final'].get('mpu_incomplete')}; verified "
                  f"(every CRC-32C): steps {s['final'].get('verified')}.", "",
                  "## Trends after the warm-up", "",
                  f"Fitted on the steps after the first {s['warmup_s'] / 60:.1f} min "
                  f"({WARMUP:.0%} of the run): the Theil-Sen slope (median of the slopes "
                  "between all pairs of steps, so an outage's step or a vacuum's drop does "
                  "not tilt it), as % of the series' median per hour; goal <= "
                  f"{GROWTH_GOAL:g} %/h. Timings leave out the steps an event hit; the "
                  "daemon's series pair only steps of one daemon (a restart starts them "
                  "afresh); SeaweedFS keeps deleted data until a vacuum, so its data dir "
                  "is judged by its size after each vacuum (the raw saw-tooth is in the "
                  "plot).", "",
                  "| Series | n | median | first -> last | slope per h | % per h | |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        split = any(r.get("s3_records") not in (None, "") for r in rows)
        for key, label in SERIES.items():
            t = s["trends"][key]
            if key == "s3_objects" and not split:  # (a run before the column)
                label = "S3 objects, .lakefs-mount/ included"
            if "median" not in t:
                lines.append(f"| {label} | {t['n']} | | | | | {t['verdict']} |")
                continue
            lines.append(f"| {label} | {t['n']} | {t['median']:g} | {t['first']:g} -> "
                         f"{t['last']:g} | {t['slope_per_h']:g} | {t['pct_per_h']:g} | "
                         f"{t['verdict']} |")
        lines += ["", "## Events", "", "| t, s | event | detail |", "|---:|---|---|"]
        lines += [f"| {e['t_s']:.0f} | {e['kind']} | {e['detail']} |" for e in s["events"]]
        hit = [r for r in rows if r["events"]]
        if hit:
            lines += ["", "Steps the events hit:", "", "| step | events | attempts | stall, s "
                      "| durable, s | error |", "|---:|---|---:|---:|---:|---|"]
            lines += [f"| {r['step']} | {r['events']} | {r['attempts']} | {r['stall_s']} | "
                      f"{r['durable_s']} | {str(r['error'])[:200]} |" for r in hit]
        if s["vacuums"]:
            lines += ["", "SeaweedFS vacuums (MiB before -> after): " + ", ".join(
                f"{v['before_mib']} -> {v['after_mib']}" for v in s["vacuums"])]
        problems = s["lost_detail"] + s["corrupt"] + s["errors"]
        if problems:
            lines += ["", "## Problems", ""] + [f"- {p}" for p in problems]
        lines += ["", "Per step: `steps.csv`; the series: `soak.png`; everything: "
                  "`results.json`."]
        (self.out / "results.md").write_text("\n".join(lines) + "\n")

    def plot(self, warm: float) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [(("stall_s", "durable_s", "restore_s"), "seconds"),
                  (("rss_mib", "weed_rss_mib"), "RSS, MiB"), (("threads", "fds"), "count"),
                  (("journal_mib", "wal_mib"), "journal, MiB"),
                  (("cache_used_mib",), "cache, MiB"),
                  (("s3_objects", "mpu_incomplete"), "S3"), (("seaweed_mib",), "SeaweedFS, MiB")]
        fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.0 * len(panels)), sharex=True)
        for ax, (keys, ylabel) in zip(axes, panels, strict=True):
            for key in keys:
                pts = [(r["t_s"] / 60, float(r[key])) for r in self.rows
                       if r.get(key) not in (None, "")]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, ".-", ms=3, lw=0.8, label=key)
            for e in self.events:
                if e["kind"] in ("outage", "kill -9", "cache disk filled"):
                    ax.axvline(e["t_s"] / 60, color="red", lw=0.6, alpha=0.5)
            ax.axvspan(0, warm / 60, color="grey", alpha=0.15)
            ax.set_ylabel(ylabel)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper left")
        axes[-1].set_xlabel("minutes (grey: warm-up; red: outage, kill -9, full cache disk)")
        fig.tight_layout()
        fig.savefig(self.out / "soak.png", dpi=80)
        plt.close(fig)


def fractions(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--minutes", type=float, help="the run's length in minutes instead")
    ap.add_argument("--steps", type=int, help="stop after this many steps")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between step starts")
    ap.add_argument("--mib", type=int, default=256, help="MiB per format (3 per step)")
    ap.add_argument("--keep", type=int, default=3, help="steps kept")
    ap.add_argument("--restore-every", type=int, default=5)
    ap.add_argument("--outage-at", type=fractions, default=[0.3, 0.7],
                    help="fractions of the run (black hole, refused, alternating)")
    ap.add_argument("--outage-seconds", type=float, default=60.0)
    ap.add_argument("--kill-at", type=fractions, default=[0.5])
    ap.add_argument("--full-disk-at", type=fractions, default=[0.85],
                    help="'' for none (the cache then stays on the work dir's disk)")
    ap.add_argument("--restart-delay", type=float, default=5.0,
                    help="seconds before the restart (the unit's RestartSec)")
    ap.add_argument("--vacuum-every", type=float, default=300.0, help="seconds; 0: at the end")
    ap.add_argument("--step-timeout", type=float, default=1800.0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 4 steps of 4 MiB, a kill -9, a 4 s outage, a full disk")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--workdir", default="/var/tmp/lakefs-mount-soak",
                    help="scratch (wiped at start and end)")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: judge the results in --out again and rewrite them")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        return Soak.reread(Path(args.out)).report()
    if args.quick:
        args.minutes = args.minutes or 3.0
        args.steps = args.steps or 4
        args.every, args.mib, args.keep, args.restore_every = 0.5, 4, 2, 2
        args.outage_at, args.outage_seconds, args.kill_at, args.full_disk_at = \
            [0.5], 4.0, [0.25], [0.75]
        args.restart_delay, args.vacuum_every = 1.0, 0.0
    use_bench_credentials()

    clean_up_on_sigterm()
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
