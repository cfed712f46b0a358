"""DCP ranks on nodes: torch.distributed.checkpoint saves and loads of a sharded state by
N gloo ranks on CPU, the ranks split evenly over one directory per node (each node's
mount of one bucket), for the multi-node tests and `python -m benchmarks multinode`.

Run as a script (by its path: it imports nothing of the repository), it spawns the ranks
(rendezvous through a FileStore) and exits non-zero on any error or mismatch:

    python benchmarks/dcp_nodes.py save --dir A[,B,...] --store PATH --world 4 ...
    python benchmarks/dcp_nodes.py load --dir A[,B,...] --store PATH --world 2 \
        --saved-world 4 ...   # resharding: a checkpoint of 4 ranks loaded by 2
    python benchmarks/dcp_nodes.py load-full --dir A --saved-world 4 ...  # 1 process

The state (`state`): two row-sharded DTensors (Shard(0) over a 1-D mesh of every rank),
a replicated tensor, a float and an int. A save rank's shard is a function of
(seed, which, rank) only, so a loader of any world size (or one process loading full
tensors) knows what it must read back without sharing memory with the saver. `save` and
`load` print one JSON line per rank, `load-full` one line: what each call took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
COLS = 1024  # float32 columns of the sharded tensors: a row is 4 KiB
SHARDED = {("model", "layers.0.weight"): 1, ("optim", "exp_avg"): 2}  # (part, key): which


def rows(mib_per_rank: int) -> int:
    """Rows of each of the two sharded tensors that one save rank holds."""
    return max(1, mib_per_rank * MiB // 4 // COLS // 2)


def shard(seed: int, which: int, rank: int, n_rows: int) -> Any:
    """Save rank `rank`'s rows of sharded tensor `which`."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + which * 100 + rank)
    return torch.randn(n_rows, COLS, generator=gen)


def rows_of(seed: int, which: int, saved_world: int, mib_per_rank: int, lo: int,
            hi: int) -> Any:
    """Rows [lo, hi) of the full tensor `which` that `saved_world` ranks saved: what a
    loader whose shard covers them must read back, built from the savers' shards alone."""
    import torch

    n = rows(mib_per_rank)
    parts = []
    for s in range(lo // n, (hi - 1) // n + 1):
        part = shard(seed, which, s, n)
        parts.append(part[max(lo - s * n, 0):min(hi - s * n, n)])
    return torch.cat(parts)


def _replicated(seed: int) -> Any:
    import torch

    return torch.randn(4096, generator=torch.Generator().manual_seed(seed))


def state(rank: int, world: int, mib_per_rank: int, seed: int, mesh: Any, *,
          saved_world: int | None = None, zeros: bool = False) -> dict[str, Any]:
    """Rank `rank`'s part of the state of a checkpoint that `saved_world` ranks save (by
    default `world`: this is the saver), as `world` ranks hold it: each sharded tensor's
    rows split evenly. `zeros`: the same shapes to load into."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    saved_world = saved_world or world
    total = rows(mib_per_rank) * saved_world
    if total % world:
        raise ValueError(f"{total} rows do not split over {world} ranks")
    n = total // world

    def sharded(which: int) -> Any:
        local = torch.zeros(n, COLS) if zeros else \
            rows_of(seed, which, saved_world, mib_per_rank, rank * n, (rank + 1) * n)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([total, COLS]), stride=(COLS, 1))

    return {
        "model": {"layers.0.weight": sharded(1),
                  "layers.0.bias": torch.zeros(4096) if zeros else _replicated(seed)},
        "optim": {"exp_avg": sharded(2), "lr": 0.0 if zeros else 0.125},
        "step": 0 if zeros else 100 + seed,
    }


def full_state(saved_world: int, mib_per_rank: int, seed: int, *,
               zeros: bool = False) -> dict[str, Any]:
    """The same state as plain full tensors, what one process loads (DCP reshards)."""
    import torch

    total = rows(mib_per_rank) * saved_world

    def full(which: int) -> Any:
        return torch.zeros(total, COLS) if zeros else \
            rows_of(seed, which, saved_world, mib_per_rank, 0, total)

    return {
        "model": {"layers.0.weight": full(1),
                  "layers.0.bias": torch.zeros(4096) if zeros else _replicated(seed)},
        "optim": {"exp_avg": full(2), "lr": 0.0 if zeros else 0.125},
        "step": 0 if zeros else 100 + seed,
    }


def differences(loaded: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between two states (DTensors by their local shards); [] if nothing."""
    import torch

    def local(v: Any) -> Any:
        return v.to_local() if hasattr(v, "to_local") else v

    bad = []
    for part in ("model", "optim"):
        for k, want in expected[part].items():
            got = local(loaded[part][k])
            want = local(want)
            same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
            if not same:
                bad.append(f"{part}.{k}")
    if loaded["step"] != expected["step"]:
        bad.append("step")
    return bad


def compare_full(loaded: dict[str, Any], saved_world: int, mib_per_rank: int,
                 seed: int) -> list[str]:
    """`differences` of a loaded full state, one expected tensor in memory at a time."""
    import torch

    total = rows(mib_per_rank) * saved_world
    bad = [f"{p}.{k}" for (p, k), which in SHARDED.items()
           if not torch.equal(loaded[p][k],
                              rows_of(seed, which, saved_world, mib_per_rank, 0, total))]
    if not torch.equal(loaded["model"]["layers.0.bias"], _replicated(seed)):
        bad.append("model.layers.0.bias")
    if loaded["optim"]["lr"] != 0.125 or loaded["step"] != 100 + seed:
        bad.append("scalars")
    return bad


def _report(doc: dict[str, Any]) -> None:
    """One JSON line on stdout in one write(): the ranks' lines do not interleave."""
    os.write(sys.stdout.fileno(), (json.dumps(doc) + "\n").encode())


def reports(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines of a run's stdout."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"')]


def _node_dir(dirs: list[str], rank: int, world: int) -> str:
    return dirs[rank * len(dirs) // world]  # rank r on node r * nodes // world


def _worker(rank: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank,
                            world_size=args.world)
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        directory = _node_dir(args.dir.split(","), rank, args.world)
        if args.command == "load":
            loaded = state(rank, args.world, args.mib_per_rank, args.seed, mesh,
                           saved_world=args.saved_world, zeros=True)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(loaded, checkpoint_id=directory)
            seconds = time.perf_counter() - t0
            bad = differences(loaded, state(rank, args.world, args.mib_per_rank, args.seed,
                                            mesh, saved_world=args.saved_world))
            if bad:
                raise AssertionError(f"rank {rank} loaded from {directory}: {bad} differ")
        else:
            mine = state(rank, args.world, args.mib_per_rank, args.seed, mesh)
            if args.reference:  # the same save to local disk, to compare the files with
                dcp.save(mine, checkpoint_id=args.reference)
                dist.barrier()
                if rank == 0:
                    Path(args.reference, "DONE").touch()
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(mine, checkpoint_id=directory)
            seconds = time.perf_counter() - t0
            if args.async_dir:
                fut: Any = dcp.async_save(mine, checkpoint_id=args.async_dir)
                # a training step could run here; the checkpoint is complete at result()
                getattr(fut, "upload_completion", fut).result()
        _report({"rank": rank, "op": args.command, "dir": directory,
                 "seconds": round(seconds, 4)})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _load_full(args: argparse.Namespace) -> int:
    """One process loads the whole checkpoint as full tensors, starting when `--go`
    exists (so that several such processes on several nodes start together)."""
    import torch.distributed.checkpoint as dcp

    loaded = full_state(args.saved_world, args.mib_per_rank, args.seed, zeros=True)
    if args.go:
        Path(args.go + f".ready.{os.getpid()}").touch()
        while not os.path.exists(args.go):
            time.sleep(0.005)
    start = time.time()
    dcp.load(loaded, checkpoint_id=args.dir, no_dist=True)
    end = time.time()
    bad = compare_full(loaded, args.saved_world, args.mib_per_rank, args.seed)
    if bad:
        print(f"loaded from {args.dir}: {bad} differ", file=sys.stderr)
        return 1
    _report({"op": "load-full", "dir": args.dir, "start": start, "end": end,
             "seconds": round(end - start, 4)})
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("save", "load", "load-full"))
    parser.add_argument("--dir", required=True, help="or DIR_A,DIR_B,...: the ranks split "
                        "evenly over them, in order (nodes, each with its own mount)")
    parser.add_argument("--store", help="FileStore path (must not exist); not load-full")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--saved-world", type=int, help="load: the world size that saved "
                        "the checkpoint (default --world)")
    parser.add_argument("--mib-per-rank", type=int, default=16, help="of the saver")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-dir", help="save: also dcp.async_save the state here")
    parser.add_argument("--reference", help="save: first save the same state to this dir")
    parser.add_argument("--go", help="load-full: start loading once this path exists")
    args = parser.parse_args(argv)
    args.saved_world = args.saved_world or args.world
    if args.command == "load-full":
        return _load_full(args)
    if not args.store:
        parser.error("--store is needed to spawn ranks")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.multiprocessing as tmp

    tmp.spawn(_worker, args=(args,), nprocs=args.world, join=True)
    return 0


SCRIPT = Path(__file__).resolve()


def command(*args: str) -> list[str]:
    """The command line that runs this file as the script above."""
    return [sys.executable, str(SCRIPT), *args]


def environment() -> dict[str, str]:
    """The ranks' environment: gloo on loopback, one thread each (the cores are shared)."""
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
