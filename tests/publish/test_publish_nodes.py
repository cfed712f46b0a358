"""Many nodes, one checkpoint (issue 24): two mounts of one bucket play two nodes, each with
its own cache. A torch.distributed.checkpoint save of 4 ranks writes ranks 0-1 through
mount A and ranks 2-3 through mount B into the same directory; each node flushes its own
writes, one commits (waiting for the other node's objects with --expect-files), `verify`
passes, and a third, fresh mount loads the checkpoint. The committing node shows the
manifest at once, the other once its listing is older than --metadata-ttl. Also what one
node sees of the other's objects, and two nodes writing the same key.

The ranks run as in tests/frameworks/test_frameworks.py (its script; gloo on CPU), given one
directory per node.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lakefs_mount.publish.manifest import MANIFEST_NAME
from tests.faults.test_s3_black_hole import wait_for
from tests.frameworks.test_frameworks import _dcp_load_and_compare, _dcp_save, _ok
from tests.mounting import cli
from tests.publish.test_publish import _manifest, _running

MIB_PER_RANK = 2
TTL = 0.5  # --metadata-ttl of the nodes that look at each other's objects


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_over_two_nodes_is_committed_by_one_and_loads_on_a_third(
        mount_factory, s3, tmp_path):
    # uploads wait for a flush (--commit-delay): node B's files reach S3 only by its own;
    # node A would list a directory again only after 10 minutes, node B after a second
    a = mount_factory("--commit-delay", "600", "--metadata-ttl", "600", name="node-a")
    b = mount_factory("--commit-delay", "600", "--metadata-ttl", "1", name="node-b")
    step = "dcp/step_1"
    _ok(_dcp_save(Path(f"{a.path / step},{b.path / step}"), tmp_path / "store",
                  mib_per_rank=MIB_PER_RANK), "DCP save over two mounts")
    mine = {"a": sorted(os.listdir(a.path / step)), "b": sorted(os.listdir(b.path / step))}
    assert mine == {"a": [".metadata", "__0_0.distcp", "__1_0.distcp"],
                    "b": ["__2_0.distcp", "__3_0.distcp"]}  # each node saw only its own

    # the recipe: every node flushes, then one commits; here node A commits first and
    # waits (--expect-files) until node B's flush has put its ranks' files in S3
    assert a.flush(step).returncode == 0, a.log_tail()
    assert not any((n.path / step / MANIFEST_NAME).exists() for n in (a, b))  # (cached so)
    with _running("commit", str(a.path), step, "--expect-files", "5", "--timeout",
                  "60") as commit:
        time.sleep(1.0)
        assert commit.poll() is None, commit.communicate()
        assert b.flush(step).returncode == 0, b.log_tail()
        _, err = commit.communicate(timeout=60)
    assert commit.returncode == 0, err + a.log_tail()
    doc = _manifest(s3, step + "/")
    sizes = {o.key.rsplit("/", 1)[1]: o.size for o in s3.list_recursive(step + "/")
             if not o.key.endswith(("/", MANIFEST_NAME))}
    assert {f["key"]: f["size"] for f in doc["files"]} == sizes and len(sizes) == 5
    # the committing node shows its manifest at once, the other after its --metadata-ttl
    assert (a.path / step / MANIFEST_NAME).read_bytes() == s3.get(f"{step}/{MANIFEST_NAME}")[1]
    assert wait_for(lambda: (b.path / step / MANIFEST_NAME).exists(), 10), b.log_tail()
    proc = cli("verify", str(b.path), step)  # on the other node: the same answer
    assert proc.returncode == 0 and proc.stdout.startswith("OK "), proc.stdout + proc.stderr

    c = mount_factory(name="node-c")  # fresh: empty cache, every byte from S3
    _dcp_load_and_compare(c.path / step, mib_per_rank=MIB_PER_RANK, seed=0)


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
