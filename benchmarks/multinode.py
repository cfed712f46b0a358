"""Many nodes, one checkpoint (issue 51): `python -m benchmarks multinode [--mib 256]
[--world 8 --nodes 4] [--restore-world 4 --restore-nodes 2] [--rounds 3] [--out DIR]`.

Mounts of one bucket on this machine play nodes, each with its own daemon and cache dir,
over the benchmark's SeaweedFS on 127.0.0.1 (root, `fusermount3`, torch):

1. Save: torch.distributed.checkpoint at world size `--world` (gloo on 127.0.0.1), the
   ranks split evenly over `--nodes` mounts, `--mib` MiB per rank (benchmarks/dcp_nodes.py:
   two row-sharded DTensors plus replicated bits).
2. Every node flushes its own ranks' files (all at once); then node 0 alone commits with
   `--expect-files` = world + 1 (a `.distcp` per rank and `.metadata`). The manifest must
   list every rank's file and match the objects in S3.
3. Restore on `--restore-nodes` fresh mounts (new cache dirs) by `--restore-world` ranks:
   DCP reshards (each rank's rows come from several savers' files); every rank compares
   what it loaded. Reported: the slowest rank's load and each node's bytes from S3.
4. Cold restores of the whole checkpoint, one process per node loading full tensors
   (`dcp.load(no_dist=True)`), each node a fresh mount: one node alone, and all `--nodes`
   nodes at the same moment (a start file), in alternating order per round. Reported: the
   bytes read from S3 (the sum of the daemons' `bytes_downloaded`) against the checkpoint's
   size, and the time of the slowest node against the one node alone.

Everything runs on the same cores (ranks, daemons, SeaweedFS): the concurrent restore's
time says what sharing one S3 endpoint and one machine costs here, not what 4 real nodes
with their own cores and NICs would see. Writes results.json and results.md to `--out`
(default benchmarks/results/multinode/) after every round; exit 1 on wrong data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import dcp_nodes
from benchmarks.targets import (
    CLI,
    LakefsTarget,
    _run,
    clean_up_on_sigterm,
    create_warm_bucket,
    embedded_session,
)

HERE = Path(__file__).resolve().parent
STEP = "run/step_1000"
MANIFEST = ".lakefs-commit.json"


class Nodes:
    """The mounts (nodes) made so far, every one stopped or killed at the end."""

    def __init__(self, work: Path, endpoint: str, bucket: str) -> None:
        self.work, self.endpoint, self.bucket = work, endpoint, bucket
        self.made: list[LakefsTarget] = []
        self.count = 0

    def start(self, n: int, what: str) -> list[LakefsTarget]:
        """`n` fresh nodes: new mount points and empty cache dirs."""
        nodes = []
        for _ in range(n):
            self.count += 1
            node = LakefsTarget(self.work / f"{what}-{self.count}", self.endpoint,
                                self.bucket, engine="auto", session="auto")
            self.made.append(node)
            node.start()
            nodes.append(node)
        return nodes

    def stop(self, nodes: list[LakefsTarget]) -> None:
        """Unmount, and free the cache disk (the next fresh nodes get new ones)."""
        for node in nodes:
            node.stop()
            shutil.rmtree(node.root, ignore_errors=True)

    def kill_all(self) -> None:
        for node in self.made:
            with contextlib.suppress(Exception):
                node.kill()


def _downloaded(node: LakefsTarget) -> int:
    return int(node.status()["counters"].get("bytes_downloaded", 0))


def _ranks(*args: str, timeout: float) -> list[dict[str, Any]]:
    """Run benchmarks/dcp_nodes.py; its per-rank JSON lines (exit 1 on its failure)."""
    proc = subprocess.run(dcp_nodes.command(*args), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL,
                          env=dcp_nodes.environment())
    if proc.returncode != 0:
        raise SystemExit(f"dcp_nodes {args[0]} failed ({proc.returncode}):\n"
                         f"{proc.stdout}\n{proc.stderr[-4000:]}")
    return dcp_nodes.reports(proc.stdout)


def _parallel(jobs: list[Any]) -> float:
    """Run the callables at once in threads; their wall time (re-raises a failure)."""
    errors: list[BaseException] = []

    def run(job: Any) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def _cold_restore(nodes: list[LakefsTarget], args: argparse.Namespace,
                  scratch: Path) -> dict[str, Any]:
    """Each node loads the whole checkpoint in one process, all starting together."""
    go = scratch / "go"
    go.unlink(missing_ok=True)
    for old in scratch.glob("go.ready.*"):
        old.unlink()
    before = [_downloaded(n) for n in nodes]
    procs = [subprocess.Popen(dcp_nodes.command(
        "load-full", "--dir", str(n.path / STEP), "--saved-world", str(args.world),
        "--mib-per-rank", str(args.mib), "--go", str(go)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        env=dcp_nodes.environment()) for n in nodes]
    try:
        deadline = time.monotonic() + 300
        while len(list(scratch.glob("go.ready.*"))) < len(procs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("a loader failed before the start: " +
                                 "".join(p.communicate()[1][-2000:] for p in procs
                                         if p.poll() is not None))
            time.sleep(0.02)
        started = time.time()
        go.touch()
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"a cold restore loaded wrong data or failed:\n{out}\n{err}")
    ends = [dcp_nodes.reports(out)[-1]["end"] for out, _ in outs]
    seconds = [round(end - started, 3) for end in ends]
    downloaded = [_downloaded(n) - b for n, b in zip(nodes, before, strict=True)]
    return {"nodes": len(nodes), "seconds": seconds, "slowest_s": max(seconds),
            "bytes_from_s3": downloaded, "bytes_from_s3_total": sum(downloaded)}


def _save_and_commit(nodes: Nodes, args: argparse.Namespace, scratch: Path,
                     client: Any, bucket: str) -> dict[str, Any]:
    writers = nodes.start(args.nodes, "writer")
    dirs = ",".join(str(n.path / STEP) for n in writers)
    for n in writers:
        (n.path / STEP).mkdir(parents=True, exist_ok=True)
    saves = _ranks("save", "--dir", dirs, "--store", str(scratch / "store-save"),
                   "--world", str(args.world), "--mib-per-rank", str(args.mib),
                   timeout=3600)
    flush_s = _parallel([lambda n=n: _run([CLI, "flush", str(n.path), STEP], timeout=3600)
                         for n in writers])
    t0 = time.perf_counter()
    _run([CLI, "commit", str(writers[0].path), STEP, "--expect-files", str(args.world + 1),
          "--timeout", "600"], timeout=900)
    commit_s = time.perf_counter() - t0
    doc = json.loads(client.get_object(Bucket=bucket, Key=f"{STEP}/{MANIFEST}")["Body"].read())
    in_s3 = {o["Key"].rsplit("/", 1)[1]: o["Size"]
             for o in client.list_objects_v2(Bucket=bucket, Prefix=STEP + "/")["Contents"]
             if not o["Key"].endswith(("/", MANIFEST))}
    listed = {f["key"]: f["size"] for f in doc["files"]}
    want = {".metadata", *(f"__{r}_0.distcp" for r in range(args.world))}
    if listed != in_s3 or set(listed) != want:
        raise SystemExit(f"the manifest lists {sorted(listed)}, S3 holds {sorted(in_s3)}, "
                         f"the ranks wrote {sorted(want)}")
    nodes.stop(writers)
    return {"save_slowest_rank_s": max(s["seconds"] for s in saves), "flush_s": flush_s,
            "commit_s": commit_s, "checkpoint_bytes": sum(listed.values()),
            "files": len(listed)}


def _resharded_restore(nodes: Nodes, args: argparse.Namespace,
                       scratch: Path) -> dict[str, Any]:
    readers = nodes.start(args.restore_nodes, "restore")
    loads = _ranks("load", "--dir", ",".join(str(n.path / STEP) for n in readers),
                   "--store", str(scratch / "store-load"), "--world",
                   str(args.restore_world), "--saved-world", str(args.world),
                   "--mib-per-rank", str(args.mib), timeout=3600)
    if len(loads) != args.restore_world:
        raise SystemExit(f"{len(loads)} of {args.restore_world} ranks reported a load")
    out = {"slowest_rank_s": max(s["seconds"] for s in loads),
           "bytes_from_s3": [_downloaded(n) for n in readers]}
    nodes.stop(readers)
    return out


def _markdown(res: dict[str, Any]) -> str:
    a, w = res["args"], res["write"]
    size = w["checkpoint_bytes"]
    gib = size / 2**30
    lines = [
        "# Many nodes, one checkpoint", "",
        f"`python -m benchmarks multinode --mib {a['mib']} --world {a['world']} --nodes "
        f"{a['nodes']} --restore-world {a['restore_world']} --restore-nodes "
        f"{a['restore_nodes']} --rounds {a['rounds']}`; {res['date']}, {res['commit']}; "
        f"one 2-core VM: ranks, daemons and SeaweedFS share its cores.", "",
        f"Checkpoint: {w['files']} files, {size / 2**20:.0f} MiB ({a['world']} ranks x "
        f"{a['mib']} MiB and `.metadata`), ranks split over {a['nodes']} nodes (mounts).", "",
        "| Step | Result |", "|---|---|",
        f"| DCP save, slowest rank | {w['save_slowest_rank_s']:.2f} s |",
        f"| every node flushes its ranks' files (at once) | {w['flush_s']:.2f} s |",
        f"| one commit, `--expect-files {a['world'] + 1}` | {w['commit_s']:.2f} s; the "
        f"manifest lists every rank's file and `.metadata` |",
    ]
    r = res["resharded"]
    lines.append(
        f"| restore at world size {a['restore_world']} on {a['restore_nodes']} fresh nodes "
        f"(resharded), slowest rank | {r['slowest_rank_s']:.2f} s; every tensor equal; "
        f"from S3 per node {', '.join(f'{b / size:.2f}' for b in r['bytes_from_s3'])} x "
        f"the checkpoint |")
    rounds = res["rounds"]
    if rounds:
        solo = statistics.median(x["solo"]["slowest_s"] for x in rounds)
        many = statistics.median(x["all"]["slowest_s"] for x in rounds)
        ratio = statistics.median(x["all"]["slowest_s"] / x["solo"]["slowest_s"]
                                  for x in rounds)
        s3x = statistics.median(x["all"]["bytes_from_s3_total"] / size for x in rounds)
        lines += [
            f"| cold restore, 1 node alone (median of {len(rounds)}) | {solo:.2f} s "
            f"({gib / solo:.2f} GiB/s) |",
            f"| cold restore, {a['nodes']} nodes at once: slowest node | {many:.2f} s; "
            f"**{ratio:.2f} x** the node alone (median of per-round ratios) |",
            f"| bytes from S3, {a['nodes']} nodes at once | **{s3x:.2f} x** the checkpoint "
            f"(sum of the daemons' `bytes_downloaded`) |",
            f"| S3 read rate, all nodes together / the node alone | "
            f"{s3x / ratio:.2f} x (the bytes over the time, per-round medians) |",
            "", "Rounds (seconds per node; alone first in odd rounds):", "",
            "| Round | 1 node alone | all nodes at once | S3 bytes, all / checkpoint |",
            "|---:|---:|---|---:|",
        ]
        for i, x in enumerate(rounds, 1):
            lines.append(f"| {i} | {x['solo']['slowest_s']:.2f} | "
                         f"{', '.join(f'{s:.2f}' for s in x['all']['seconds'])} | "
                         f"{x['all']['bytes_from_s3_total'] / size:.2f} |")
    lines += ["", "Notes:", "",
              "- Nodes share no cache: each fresh node reads every byte it needs from S3, so "
              f"{a['nodes']} nodes restoring one checkpoint read it {a['nodes']} times.",
              "- The resharded restore: a node fetches the files of its ranks' rows, and "
              "the chunks (16 MiB) and read-ahead around the small replicated items (a "
              "tensor, two scalars) that DCP's dedup put in other savers' files.",
              "- A node is a mount with its own daemon and cache dir; gloo on 127.0.0.1. "
              "The restores start on fresh mounts (empty caches, a new page cache), while "
              "SeaweedFS's volume files stay in this machine's page cache.",
              "- The page cache is not dropped and no memory is touched first "
              "(README.md, \"Noise\"): read ratios of one run, not absolute rates."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks multinode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state per save rank, MiB")
    ap.add_argument("--world", type=int, default=8, help="ranks of the save")
    ap.add_argument("--nodes", type=int, default=4, help="nodes (mounts) of the save, and "
                    "of the concurrent cold restore")
    ap.add_argument("--restore-world", type=int, default=4)
    ap.add_argument("--restore-nodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="of the cold restores")
    ap.add_argument("--out", default=str(HERE / "results" / "multinode"))
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.world % args.nodes or args.restore_world % args.restore_nodes:
        ap.error("the ranks must split evenly over the nodes")

    clean_up_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    res: dict[str, Any] = {"args": vars(args) | {"out": None}, "commit": commit,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "rounds": []}
    with embedded_session("lakefs-mount-multinode-") as (work, server, client):
        bucket = create_warm_bucket(client, "multinode")
        nodes = Nodes(work, server.endpoint_url, bucket)
        try:
            res["write"] = _save_and_commit(nodes, args, work, client, bucket)
            print(f"save, flush, commit: {res['write']}", flush=True)
            res["resharded"] = _resharded_restore(nodes, args, work)
            print(f"resharded restore: {res['resharded']}", flush=True)
            for r in range(args.rounds):
                row = {}
                for what in (("solo", "all") if r % 2 == 0 else ("all", "solo")):
                    fresh = nodes.start(1 if what == "solo" else args.nodes, what)
                    try:
                        row[what] = _cold_restore(fresh, args, work)
                    finally:
                        nodes.stop(fresh)
                res["rounds"].append(row)
                print(f"round {r + 1}: {row}", flush=True)
                (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
                (out / "results.md").write_text(_markdown(res))
        finally:
            nodes.kill_all()
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(_markdown(res))
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
