"""Many nodes, one checkpoint (issues 24, 51): mounts of one bucket play nodes, each with
its own cache. A torch.distributed.checkpoint save of 4 ranks writes ranks 0-1 through
mount A and ranks 2-3 through mount B into the same directory; each node flushes its own
writes, one commits (waiting for the other node's objects with --expect-files), and the
manifest lists every rank's file. Then the checkpoint loads elsewhere: on a third, fresh
mount in one process, and on two fresh mounts by 2 ranks (DCP reshards the 4 ranks'
shards). The committing node shows the manifest at once, the other once its listing is
older than --metadata-ttl. Also what one node sees of the other's objects, and two nodes
writing the same key.

The ranks run as benchmarks/dcp_nodes.py runs them (gloo on CPU), given one directory per
node; `python -m benchmarks multinode` is the same at 8 ranks on 4 nodes.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks import dcp_nodes
from lakefs_mount.publish.manifest import MANIFEST_NAME
from tests.faults.test_s3_black_hole import wait_for
from tests.frameworks.test_frameworks import _dcp_load_and_compare, _dcp_save, _ok
from tests.mounting import Mount, cli
from tests.publish.test_publish import _manifest, _running

MIB_PER_RANK = 2
WORLD = 4  # ranks of the save, half on each of two nodes
FILES = WORLD + 1  # DCP's file writer: one __RANK_0.distcp per rank, and rank 0's .metadata
TTL = 0.5  # --metadata-ttl of the nodes that look at each other's objects


def _save_over(nodes: tuple[Mount, ...], step: str, store: Path) -> None:
    """The 4-rank DCP save, the ranks split evenly over `nodes`; each node's mount shows
    only the files of its own ranks (rank 0's node: also .metadata)."""
    proc = _dcp_save(Path(",".join(str(n.path / step) for n in nodes)), store,
                     mib_per_rank=MIB_PER_RANK, world=WORLD)
    assert isinstance(proc, subprocess.CompletedProcess)
    _ok(proc, "DCP save over the nodes")
    per_node = WORLD // len(nodes)
    for i, node in enumerate(nodes):
        mine = [f"__{r}_0.distcp" for r in range(i * per_node, (i + 1) * per_node)]
        assert sorted(os.listdir(node.path / step)) == \
            sorted([".metadata"] * (i == 0) + mine), node.path  # each sees only its own


def _committed(s3, step: str) -> dict[str, int]:
    """The manifest of `step` lists exactly its objects in S3, sizes included, and those
    are every rank's file and .metadata: their sizes by name."""
    doc = _manifest(s3, step + "/")
    sizes = {o.key.rsplit("/", 1)[1]: o.size for o in s3.list_recursive(step + "/")
             if not o.key.endswith(("/", MANIFEST_NAME))}
    assert {f["key"]: f["size"] for f in doc["files"]} == sizes
    assert sorted(sizes) == sorted([".metadata", *(f"__{r}_0.distcp" for r in range(WORLD))])
    assert doc["file_count"] == FILES and doc["total_bytes"] == sum(sizes.values())
    return sizes


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_over_two_nodes_is_committed_by_one_and_loads_on_a_third(
        mount_factory, s3, tmp_path):
    # uploads wait for a flush (--commit-delay): node B's files reach S3 only by its own;
    # node A would list a directory again only after 10 minutes, node B after a second
    a = mount_factory("--commit-delay", "600", "--metadata-ttl", "600", name="node-a")
    b = mount_factory("--commit-delay", "600", "--metadata-ttl", "1", name="node-b")
    step = "dcp/step_1"
    _save_over((a, b), step, tmp_path / "store")

    # the recipe: every node flushes, then one commits; here node A commits first and
    # waits (--expect-files) until node B's flush has put its ranks' files in S3
    assert a.flush(step).returncode == 0, a.log_tail()
    assert not any((n.path / step / MANIFEST_NAME).exists() for n in (a, b))  # (cached so)
    with _running("commit", str(a.path), step, "--expect-files", str(FILES), "--timeout",
                  "60") as commit:
        time.sleep(1.0)
        assert commit.poll() is None, commit.communicate()
        assert b.flush(step).returncode == 0, b.log_tail()
        _, err = commit.communicate(timeout=60)
    assert commit.returncode == 0, err + a.log_tail()
    _committed(s3, step)
    # the committing node shows its manifest at once, the other after its --metadata-ttl
    assert (a.path / step / MANIFEST_NAME).read_bytes() == s3.get(f"{step}/{MANIFEST_NAME}")[1]
    assert wait_for(lambda: (b.path / step / MANIFEST_NAME).exists(), 10), b.log_tail()
    proc = cli("verify", str(b.path), step)  # on the other node: the same answer
    assert proc.returncode == 0 and proc.stdout.startswith("OK "), proc.stdout + proc.stderr

    c = mount_factory(name="node-c")  # fresh: empty cache, every byte from S3
    _dcp_load_and_compare(c.path / step, mib_per_rank=MIB_PER_RANK, seed=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_commit_covers_4_ranks_on_two_nodes_and_2_ranks_on_two_fresh_nodes_load_it(
        mount_factory, s3, tmp_path):
    """The recipe of docs/checkpoints.md as written: save, every node flushes its own
    ranks' files, one commit; the restore runs at another world size on other nodes."""
    # (uploads wait for a flush and listings stay: a node sees only its own ranks' files
    # however long the save takes, as _save_over checks)
    a, b = (mount_factory("--commit-delay", "600", "--metadata-ttl", "600", name=f"node-{n}")
            for n in "ab")
    step = "dcp/step_2"
    _save_over((a, b), step, tmp_path / "store-save")
    for node in (a, b):  # each node: its own ranks' files
        assert node.flush(step).returncode == 0, node.log_tail()
    # (the barrier) then node A alone commits: one manifest for every rank's file
    proc = cli("commit", str(a.path), step, "--expect-files", str(FILES), "--timeout", "60")
    assert proc.returncode == 0, proc.stderr + a.log_tail()
    sizes = _committed(s3, step)
    assert all(sizes[f"__{r}_0.distcp"] > MIB_PER_RANK * 2**20 // 2 for r in range(WORLD))

    # two fresh nodes (empty caches) restore it with 2 ranks, rank r on node r: each rank
    # holds the rows that 2 of the 4 savers wrote, and compares them (the script fails)
    c, d = (mount_factory(name=f"node-{n}") for n in "cd")
    load = subprocess.run(dcp_nodes.command(
        "load", "--dir", f"{c.path / step},{d.path / step}", "--store",
        str(tmp_path / "store-load"), "--world", "2", "--saved-world", str(WORLD),
        "--mib-per-rank", str(MIB_PER_RANK)), capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL, env=dcp_nodes.environment())
    _ok(load, "DCP load at world size 2 over two fresh nodes")
    assert sorted(r["rank"] for r in dcp_nodes.reports(load.stdout)) == [0, 1], load.stdout
    # each fresh node read from S3 at least the files of its rows: ranks 0-1's, 2-3's
    for node, savers in ((c, (0, 1)), (d, (2, 3))):
        got = node.counters().get("bytes_downloaded", 0)
        assert got >= sum(sizes[f"__{r}_0.distcp"] for r in savers), (node.path, got, sizes)


def test_a_node_sees_the_others_objects_after_the_ttl_and_the_last_commit_of_a_key_wins(
        mount_factory, s3):
    # uploads wait for a flush (--commit-delay): which node commits last is the test's
    a, b = (mount_factory("--metadata-ttl", str(TTL), "--commit-delay", "600",
                          name=f"node-{n}") for n in "ab")
    (a.path / "d").mkdir()
    (a.path / "d" / "shared.bin").write_bytes(b"from a, first")
    assert a.flush().returncode == 0
    assert wait_for(lambda: (b.path / "d" / "shared.bin").exists(), 5)
    assert (b.path / "d" / "shared.bin").read_bytes() == b"from a, first"

    # a new object of node A: node B lists it once its listing is older than the TTL
    assert os.listdir(b.path / "d") == ["shared.bin"]  # (listed now)
    (a.path / "d" / "new.bin").write_bytes(b"new on a")
    assert a.flush().returncode == 0
    assert wait_for(lambda: "new.bin" in os.listdir(b.path / "d"), 5), os.listdir(b.path / "d")
    assert (b.path / "d" / "new.bin").read_bytes() == b"new on a"

    # both nodes write the same key; B commits last, and its bytes win everywhere
    for node, body in ((a, b"A" * 3000), (b, b"B" * 5000)):
        (node.path / "d" / "shared.bin").write_bytes(body)
    assert a.flush().returncode == 0
    assert b.flush().returncode == 0
    assert s3.get("d/shared.bin")[1] == b"B" * 5000
    assert wait_for(lambda: (a.path / "d" / "shared.bin").read_bytes() == b"B" * 5000, 5), \
        a.log_tail()  # A's cache held its own version: the ETag changed, A reads S3's
    for node in (a, b):
        status = node.status()
        assert status["files_pending"] == 0 and status["errors"] == 0, status
        assert node.unmount().returncode == 0, node.log_tail()

    # neither node's cache nor journal was damaged: each mounts again on its own cache
    # and reads S3's last version, uploads nothing, finds nothing to recover
    for node in (a, b):
        node.start()
        assert (node.path / "d" / "shared.bin").read_bytes() == b"B" * 5000
        assert (node.path / "d" / "new.bin").read_bytes() == b"new on a"
        counters = node.counters()
        assert counters.get("bytes_uploaded", 0) == 0 and counters.get("errors", 0) == 0
        assert " ERROR " not in node.log_file.read_text(), node.log_tail(400)
