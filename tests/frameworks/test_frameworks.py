"""Checkpoints written by real frameworks through a real mount (torch, DCP, safetensors).

Every test reads back from S3 or checks S3 directly: a remount with an empty cache (a
new `mount_factory` name) proves that bytes come from the bucket, not the local cache.

The distributed parts run in a subprocess: the script benchmarks/dcp_nodes.py spawns the
ranks (gloo on CPU, rendezvous through a FileStore) and exits non-zero on any error or
mismatch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch  # installed by packaging/setup.sh: the `frameworks` extra

from benchmarks import dcp_nodes
from lakefs_mount.namespace.dirindex import RESERVED_NAME

MiB = 1024 * 1024

pytestmark = pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)


def _dcp_save(directory: Path, store: Path, *, mib_per_rank: int, seed: int = 0,
              world: int = 4, async_dir: Path | None = None, reference: Path | None = None,
              wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run benchmarks/dcp_nodes.py's DCP save with `world` ranks (`directory`: or
    `A,B,...`, one per node)."""
    cmd = dcp_nodes.command("save", "--dir", str(directory), "--store", str(store),
                            "--world", str(world), "--mib-per-rank", str(mib_per_rank),
                            "--seed", str(seed))
    if async_dir is not None:
        cmd += ["--async-dir", str(async_dir)]
    if reference is not None:
        cmd += ["--reference", str(reference)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dcp_nodes.environment(),
                                text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL, env=dcp_nodes.environment())


def _dcp_load_and_compare(directory: Path, *, mib_per_rank: int, seed: int,
                          saved_world: int = 4) -> None:
    """Load a checkpoint of `saved_world` ranks into fresh full-size tensors here (DCP
    reshards), compare."""
    import torch.distributed.checkpoint as dcp

    loaded = dcp_nodes.full_state(saved_world, mib_per_rank, seed, zeros=True)
    dcp.load(loaded, checkpoint_id=str(directory), no_dist=True)
    assert dcp_nodes.compare_full(loaded, saved_world, mib_per_rank, seed) == []


def _ok(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout}\n" \
                                 f"{proc.stderr[-4000:]}"


def _keys(s3, prefix: str = "") -> dict[str, int]:
    """Objects under `prefix` and their sizes; directory markers (`dir/`) and the mount's
    attribute indexes left out."""
    return {o.key: o.size for o in s3.list_recursive(prefix)
            if not o.key.endswith("/") and not o.key.startswith(RESERVED_NAME + "/")}


def _flushed(m) -> None:
    proc = m.flush()
    assert proc.returncode == 0, f"flush failed: {proc.stdout}\n{proc.stderr}\n{m.log_tail()}"


def _state_dict(total_mib: int, seed: int = 0) -> dict:
    """A model-like state dict of about `total_mib` MiB of float32 (plus small extras)."""
    gen = torch.Generator().manual_seed(seed)
    per = 32 * MiB // 4
    tensors = {f"layers.{i}.weight": torch.randn(per // 1024, 1024, generator=gen)
               for i in range(total_mib // 32)}
    tensors["embed.bias"] = torch.randn(12345, generator=gen)  # odd size: unaligned tail
    tensors["step"] = torch.tensor(1000)
    return tensors


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"tensor {k} differs"


# -- torch.save / torch.load ------------------------------------------------------------

def test_torch_save_256mib_reads_back_from_s3_after_remount_with_empty_cache(
        mount_factory, s3):
    m = mount_factory(name="writer")
    state = _state_dict(256)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert nbytes >= 256 * MiB
    path = m.path / "run1" / "step_1000" / "model.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    size = path.stat().st_size
    _flushed(m)
    assert m.unmount().returncode == 0
    assert _keys(s3, "run1/") == {"run1/step_1000/model.pt": size}

    cold = mount_factory(name="cold-reader")  # another cache dir: empty
    before = cold.counters().get("bytes_downloaded", 0)
    loaded = torch.load(cold.path / "run1" / "step_1000" / "model.pt", weights_only=True)
    _assert_same(state, loaded)
    assert cold.counters().get("bytes_downloaded", 0) - before >= size  # it came from S3
    # mmap'd load (page faults through FUSE) on the cold mount gives the same tensors
    mapped = torch.load(cold.path / "run1" / "step_1000" / "model.pt", mmap=True,
                        weights_only=True)
    _assert_same(state, mapped)


# -- torch.distributed.checkpoint ------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_and_async_save_4_ranks_then_load_from_a_cold_mount(
        mount_factory, s3, tmp_path):
    import torch.distributed.checkpoint as dcp

    m = mount_factory(name="writer")
    ckpt, async_ckpt = m.path / "dcp" / "step_100", m.path / "dcp" / "step_200"
    has_async = hasattr(dcp, "async_save")  # one 4-rank run does both saves
    _ok(_dcp_save(ckpt, tmp_path / "store", mib_per_rank=24,
                  async_dir=async_ckpt if has_async else None), "DCP save")
    files = sorted(p.name for p in ckpt.iterdir())
    assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == 4
    sizes = {f"dcp/step_100/{p.name}": p.stat().st_size for p in ckpt.iterdir()}
    assert all(sizes[k] > 20 * MiB for k in sizes if k.endswith(".distcp")), sizes  # sharded
    if has_async:
        sizes.update({f"dcp/step_200/{p.name}": p.stat().st_size for p in async_ckpt.iterdir()})
    _flushed(m)
    assert _keys(s3, "dcp/") == sizes
    assert m.unmount().returncode == 0

    cold = mount_factory(name="cold-reader")  # empty cache: every byte is read from S3
    _dcp_load_and_compare(cold.path / "dcp" / "step_100", mib_per_rank=24, seed=0)
    if has_async:
        _dcp_load_and_compare(cold.path / "dcp" / "step_200", mib_per_rank=24, seed=0)
    assert cold.counters().get("bytes_downloaded", 0) >= sum(sizes.values())
    assert has_async, f"torch {torch.__version__} lost dcp.async_save"


# -- safetensors ------------------------------------------------------------------------

def test_safetensors_save_load_and_mmap_safe_open(mount_factory, s3):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    m = mount_factory(name="writer")
    state = {k: v for k, v in _state_dict(64, seed=3).items() if v.dim() > 0}
    state["half"] = torch.randn(3000, 77).to(torch.bfloat16)
    path = m.path / "hf" / "model.safetensors"
    path.parent.mkdir()
    save_file(state, path, metadata={"format": "pt", "step": "42"})
    _assert_same(state, load_file(path))  # hot: through the write-back cache
    _flushed(m)
    size = path.stat().st_size
    assert _keys(s3, "hf/") == {"hf/model.safetensors": size}
    assert m.unmount().returncode == 0

    cold = mount_factory(name="cold-reader")
    cpath = cold.path / "hf" / "model.safetensors"
    with safe_open(cpath, framework="pt") as f:  # memory-mapped over FUSE, cold cache
        assert f.metadata() == {"format": "pt", "step": "42"}
        assert set(f.keys()) == set(state)
        # a slice of one tensor first: only part of the file is faulted in
        part = f.get_slice("layers.1.weight")[100:200]
        assert torch.equal(part, state["layers.1.weight"][100:200])
        for k in state:
            assert torch.equal(f.get_tensor(k), state[k]), k
    _assert_same(state, load_file(cpath))


# -- the temporary-directory pattern (Hugging Face Trainer, Megatron) -------------------

def _write_checkpoint(directory: Path, seed: int) -> dict[str, bytes]:
    """Files like a HF Trainer checkpoint: big weights, optimizer, small JSON and RNG."""
    directory.mkdir(parents=True)
    payload = {
        "model.safetensors": os.urandom(40 * MiB + 17),  # multipart (parts of 16 MiB)
        "optimizer.pt": os.urandom(20 * MiB + 5),
        "scheduler.pt": os.urandom(1500),
        "rng_state.pth": os.urandom(14000),
        "trainer_state.json": b'{"global_step": %d}\n' % seed,
        "config.json": b'{"model_type": "toy"}\n',
    }
    for name, data in payload.items():
        with open(directory / name, "wb") as f:
            f.write(data)
    return payload


def test_tmp_dir_rename_of_dirty_checkpoint_needs_no_server_side_copy(mount_factory, s3):
    """Hugging Face / Megatron: write tmp-checkpoint-N/, rename it, flush. Data still dirty
    at the rename (closed within the commit delay, or parts of an open upload) goes to the
    new keys from the cache: no server-side copy. The commit delay is long here so that a
    slow machine cannot commit a file before the rename (which then is copied, rightly)."""
    m = mount_factory("--commit-delay", "60")
    before = m.counters()
    payload = _write_checkpoint(m.path / "tmp-checkpoint-100", seed=100)
    os.rename(m.path / "tmp-checkpoint-100", m.path / "checkpoint-100")  # before any flush
    _flushed(m)
    after = m.counters()
    keys = _keys(s3)
    assert keys == {f"checkpoint-100/{n}": len(d) for n, d in payload.items()}
    assert not any(o.key.startswith("tmp-") for o in s3.list_recursive(""))
    for name, data in payload.items():
        assert s3.get_range(f"checkpoint-100/{name}", 0, len(data) + 1) == data, name
    copies = after.get("server_side_copies", 0) - before.get("server_side_copies", 0)
    assert copies == 0, f"{copies} server-side copies for data that was dirty at rename time"


def test_tmp_dir_rename_small_files_right_after_writing(mount, s3):
    """Commits in flight during the rename must land under the new name, not the old one.

    Regression: FileSystem._rename_dir listed the old prefix before taking the commit
    locks, so a commit landing in between stayed under tmp-*/ only (data lost from the
    renamed directory, yet flush reported success)."""
    m = mount
    tmp = m.path / "tmp-checkpoint-7"
    tmp.mkdir()
    payload = {f"shard-{i:03d}.bin": os.urandom(100_000 + i) for i in range(30)}
    for name, data in payload.items():
        (tmp / name).write_bytes(data)
    os.rename(tmp, m.path / "checkpoint-7")
    _flushed(m)
    keys = _keys(s3)
    assert keys == {f"checkpoint-7/{n}": len(d) for n, d in payload.items()}
    for name, data in payload.items():
        assert s3.get_range(f"checkpoint-7/{name}", 0, len(data) + 1) == data, name
    assert not any(o.key.startswith("tmp-") for o in s3.list_recursive(""))


def test_rename_of_committed_checkpoint_copies_server_side_without_reupload(mount, s3):
    """Files already in S3 legitimately move with CopyObject, but are never re-uploaded."""
    m = mount
    payload = _write_checkpoint(m.path / "tmp-checkpoint-200", seed=200)
    _flushed(m)
    before = m.counters()
    os.rename(m.path / "tmp-checkpoint-200", m.path / "checkpoint-200")
    _flushed(m)
    after = m.counters()
    assert after.get("bytes_uploaded", 0) == before.get("bytes_uploaded", 0)
    assert after.get("server_side_copies", 0) - before.get("server_side_copies", 0) \
        == len(payload)  # one CopyObject per committed file, no download/upload
    assert after.get("gets", 0) == before.get("gets", 0)
    keys = _keys(s3)
    assert keys == {f"checkpoint-200/{n}": len(d) for n, d in payload.items()}
    for name, data in payload.items():
        assert s3.get_range(f"checkpoint-200/{name}", 0, len(data) + 1) == data, name


# -- retention --------------------------------------------------------------------------

def test_rmtree_of_old_checkpoint_removes_its_objects(mount, s3):
    m = mount
    for step in (100, 200, 300):
        _write_checkpoint(m.path / "run" / f"checkpoint-{step}", seed=step)
    _flushed(m)
    assert len(_keys(s3, "run/checkpoint-100/")) == 6
    shutil.rmtree(m.path / "run" / "checkpoint-100")  # keep the last two
    assert not (m.path / "run" / "checkpoint-100").exists()
    _flushed(m)
    assert list(s3.list_recursive("run/checkpoint-100")) == []  # markers too
    assert len(_keys(s3, "run/checkpoint-200/")) == 6
    assert sorted(os.listdir(m.path / "run")) == ["checkpoint-200", "checkpoint-300"]
    # a retention pass that runs before the data reached S3 leaves nothing behind either
    _write_checkpoint(m.path / "run" / "checkpoint-400", seed=400)
    shutil.rmtree(m.path / "run" / "checkpoint-400")
    _flushed(m)
    time.sleep(0.5)
    assert list(s3.list_recursive("run/checkpoint-400")) == []


# -- crash in the middle of a DCP save ----------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_kill9_during_dcp_save_never_leaves_a_silently_truncated_checkpoint(
        mount_factory, s3, tmp_path):
    mib = 48  # per rank: a save long enough to be interrupted
    reference = tmp_path / "reference"  # the same state saved to local disk first
    m = mount_factory(name="crash")
    ckpt = m.path / "ckpt" / "step_500"
    saver = _dcp_save(ckpt, tmp_path / "store", mib_per_rank=mib, seed=5,
                      reference=reference, wait=False)
    deadline = time.monotonic() + 180
    killed = False
    try:
        while time.monotonic() < deadline and saver.poll() is None:
            written = 0
            if (reference / "DONE").exists():
                try:
                    written = sum(p.stat().st_size for p in ckpt.iterdir())
                except OSError:
                    pass
            if written >= 8 * MiB:  # files appeared and are being written
                m.kill9()
                killed = True
                break
            time.sleep(0.02)
        out, _ = saver.communicate(timeout=120)
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    assert killed, f"the save finished before the daemon could be killed:\n{out}"
    ref_bytes = {p.name: p.read_bytes() for p in reference.iterdir() if p.name != "DONE"}
    m.start()  # same cache dir: recovery uploads what the journal holds
    _flushed(m)

    objects = {k.rsplit("/", 1)[1]: size for k, size in _keys(s3, "ckpt/step_500/").items()}
    print(f"saver exit status {saver.returncode}; in S3 after recovery: {objects}")
    for name, size in objects.items():
        assert name in ref_bytes, f"unexpected object {name}"
        if name == ".metadata":
            continue  # a pickle: checked by loading below
        body = s3.get_range(f"ckpt/step_500/{name}", 0, size) if size else b""
        # what reached S3 is what the saver wrote: the reference's bytes or, for a write
        # that the crash interrupted (and the saver saw fail), a prefix of them
        assert body == ref_bytes[name][:size], f"{name}: bytes differ from what was written"
        if size < len(ref_bytes[name]):
            assert saver.returncode != 0, (
                f"{name} is truncated in S3 ({size} of {len(ref_bytes[name])} bytes) "
                f"but the saver exited 0")
    if saver.returncode == 0 or ".metadata" in objects:
        # the framework believes the checkpoint complete: so is every file, and it loads
        assert {n: s for n, s in objects.items() if n != ".metadata"} == \
            {n: len(b) for n, b in ref_bytes.items() if n != ".metadata"}, out
        assert m.unmount().returncode == 0
        cold = mount_factory(name="cold-reader")
        _dcp_load_and_compare(cold.path / "ckpt" / "step_500", mib_per_rank=mib, seed=5)
    else:
        assert "rror" in out, f"the saver failed without saying why:\n{out}"
