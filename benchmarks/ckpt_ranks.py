"""Rank processes of the checkpoint benchmark (`benchmarks/checkpoint.py`).

Each rank is a process that builds its state dict once (64 MiB float32 tensors, seeded by
its rank, so any rank can check what it reads back), then serves commands from the driver
over a pipe: save the state in a format to a place and return the save call's wall time;
load it back, return the load's wall time, and compare every tensor with its own state.

A place is a local path (local disk or a lakefs-mount) or an `s3://` URI that
s3torchconnector writes and reads directly.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MiB = 1 << 20
TENSOR_MIB = 64
REGION = "us-east-1"
DCP_THREADS = 4  # FileSystemWriter / S3StorageWriter thread_count


class DataError(RuntimeError):
    """A checkpoint read back differs from what was saved."""


def state_dict(rank: int, mib: int) -> dict[str, Any]:
    """`mib` MiB of float32 tensors of (at most) 64 MiB, as the layers of a model."""
    import torch

    tensor_mib = min(TENSOR_MIB, mib)
    gen = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.layer{i}.weight": torch.rand(tensor_mib * MiB // 4, generator=gen)
            for i in range(max(1, mib // tensor_mib))}


def state_bytes(sd: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


class S3Access:
    """s3torchconnector's clients for the benchmark's endpoint (path-style addressing)."""

    def __init__(self, endpoint: str) -> None:
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        self.endpoint = endpoint
        self.config = S3ClientConfig(force_path_style=True)
        self.checkpoint = S3Checkpoint(REGION, endpoint=endpoint, s3client_config=self.config)

    def file_system(self, reader_constructor: Any = None) -> Any:
        """DCP's writer and reader take no endpoint: their file system is replaced by one
        built on a client of the endpoint."""
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem

        client = S3Client(REGION, endpoint=self.endpoint, s3client_config=self.config)
        return S3FileSystem(REGION, s3_client=client, reader_constructor=reader_constructor)

    def dcp_writer(self, uri: str) -> Any:
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(REGION, uri, s3client_config=self.config,
                                 thread_count=DCP_THREADS)
        writer.fs = self.file_system()
        writer.path = writer.fs.init_path(uri)
        return writer

    def dcp_reader(self, uri: str) -> Any:
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(REGION, uri, s3client_config=self.config)
        reader.fs = self.file_system(reader._reader_constructor)
        reader.path = reader.fs.init_path(uri)
        return reader


def touch(sd: dict[str, Any]) -> dict[str, Any]:
    """Fault in every page of tensors that map a file: a lazy load has read nothing yet."""
    for t in sd.values():
        float(t.sum())
    return sd


def is_s3(place: str) -> bool:
    return place.startswith("s3://")


class Rank:
    def __init__(self, rank: int, mib: int, endpoint: str) -> None:
        self.rank = rank
        self.state = state_dict(rank, mib)
        self.endpoint = endpoint
        self.world = 1
        self.dcp_threads = DCP_THREADS
        self._s3: S3Access | None = None

    @property
    def s3(self) -> S3Access:
        if self._s3 is None:
            self._s3 = S3Access(self.endpoint)
        return self._s3

    def mark(self, step: int, dcp_threads: int | None = None) -> None:
        """Put `step` into the state (a soak saves one per step: a restore that read an
        older step's files back fails the comparison) and set DCP's writer threads."""
        import torch

        self.state["step"] = torch.tensor([step], dtype=torch.int64)
        if dcp_threads is not None:
            self.dcp_threads = dcp_threads

    # ------------------------------------------------------------------ saves

    def save(self, fmt: str, place: str, world: int = 1) -> float:
        """Save the state as `fmt` to `place`; the call's wall time in seconds."""
        if not is_s3(place):
            Path(place).parent.mkdir(parents=True, exist_ok=True)
        save = {"torch": self._save_torch, "safetensors": self._save_safetensors,
                "dcp": self._save_dcp}[fmt]
        start = time.perf_counter()
        save(place, world)
        return time.perf_counter() - start

    def _save_torch(self, place: str, _world: int) -> None:
        import torch

        if is_s3(place):
            with self.s3.checkpoint.writer(place) as writer:
                torch.save(self.state, writer)
        else:
            torch.save(self.state, place)

    def _save_safetensors(self, place: str, _world: int) -> None:
        from safetensors.torch import save, save_file

        if is_s3(place):  # no file API on S3: the user serializes to bytes, then writes
            with self.s3.checkpoint.writer(place) as writer:
                writer.write(save(self.state))
        else:
            save_file(self.state, place)

    def _save_dcp(self, place: str, world: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        writer = (self.s3.dcp_writer(place) if is_s3(place)
                  else FileSystemWriter(place, thread_count=self.dcp_threads))
        dcp.save(self.state, storage_writer=writer, no_dist=world == 1)

    # ------------------------------------------------------------------ loads

    def load(self, fmt: str, place: str, mode: str = "") -> float:
        """Load `fmt` from `place` (mode "mmap": torch.load(mmap=True), every page touched);
        the wall time of the load, then every tensor compared with the state saved."""
        load = {"torch": self._load_torch, "safetensors": self._load_safetensors,
                "dcp": self._load_dcp}[fmt]
        start = time.perf_counter()
        loaded = load(place, mode)
        elapsed = time.perf_counter() - start
        self.compare(loaded, f"{fmt} {mode} load of {place}")
        return elapsed

    def _load_torch(self, place: str, mode: str) -> dict[str, Any]:
        import torch

        if is_s3(place):
            with self.s3.checkpoint.reader(place) as reader:
                return torch.load(reader, weights_only=True)
        loaded = torch.load(place, weights_only=True, mmap=mode == "mmap")
        return touch(loaded) if mode == "mmap" else loaded

    def _load_safetensors(self, place: str, _mode: str) -> dict[str, Any]:
        from safetensors import safe_open
        from safetensors.torch import load

        if is_s3(place):
            with self.s3.checkpoint.reader(place) as reader:
                return load(reader.read())
        with safe_open(place, framework="pt") as f:  # tensors backed by its mmap
            return touch({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - not a dict

    def _load_dcp(self, place: str, _mode: str) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        target = {k: torch.empty_like(v) for k, v in self.state.items()}
        reader = self.s3.dcp_reader(place) if is_s3(place) else FileSystemReader(place)
        dcp.load(target, storage_reader=reader, no_dist=True)
        return target

    def compare(self, loaded: dict[str, Any], what: str) -> None:
        import torch

        if sorted(loaded) != sorted(self.state):
            raise DataError(f"{what}: keys {sorted(loaded)[:3]}... differ from the saved ones")
        for k, v in self.state.items():
            if not torch.equal(loaded[k], v):
                raise DataError(f"{what}: tensor {k} differs from the saved one")

    def init_group(self, world: int, port: int) -> int:
        """Join the gloo process group of the DCP saves at world size > 1."""
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=self.rank, world_size=world)
        self.world = world
        return world

    def warm_up(self, places: list[str]) -> None:
        """Save and load a small state once per format in each of `places` (a local
        directory, an s3:// prefix), untimed: the first call of each library in a process
        pays its imports and set-up, which a training job pays once, not per checkpoint.
        All ranks call this together (the DCP save at the group's world size)."""
        import torch

        full, self.state = self.state, {f"rank{self.rank}.warmup": torch.ones(256)}
        try:
            for base in places:
                for fmt in ("torch", "safetensors", "dcp"):
                    place = f"{base}/rank{self.rank}.{fmt}"
                    self.save(fmt, place)
                    self.load(fmt, place)
                if self.world > 1:
                    self.save("dcp", f"{base}/dcp-world", self.world)
        finally:
            self.state = full


def serve(conn: Connection, rank: int, mib: int, endpoint: str) -> None:
    """The rank process: build the state, say its size, then run commands until None."""
    try:
        worker = Rank(rank, mib, endpoint)
        conn.send(("ok", state_bytes(worker.state)))
    except Exception:  # noqa: BLE001 - the driver reports it
        conn.send(("error", traceback.format_exc()))
        return
    for noise in ("Detected an existing checkpoint", "torch.distributed is disabled"):
        warnings.filterwarnings("ignore", message=noise)
    ops: dict[str, Callable[..., Any]] = {"save": worker.save, "load": worker.load,
                                          "init_group": worker.init_group,
                                          "warm_up": worker.warm_up, "mark": worker.mark}
    while (msg := conn.recv()) is not None:
        op, kwargs = msg
        try:
            conn.send(("ok", ops[op](**kwargs)))
        except DataError as exc:
            conn.send(("data", str(exc)))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - the driver reports it. DCP's
            # CheckpointException is a BaseException: it killed the rank, and the driver
            # saw only "EOFError: " (issue 31's missing .metadata, reason lost)
            conn.send(("error", traceback.format_exc()))
