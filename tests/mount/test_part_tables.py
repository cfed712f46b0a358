"""The tables of part CRCs (docs/s3-layout.md, "Part tables") live as long as an object
names them (issue 51): a commit over a multipart object, an unlink, a rename over one
delete the table the replaced object named once the replacement or the removal is in S3;
a rename keeps the table (the moved object still names it). A training job that saves and
deletes checkpoints for days leaves a bounded number of them. A table that is missing
never fails a read: the object's parts are read unchecked."""

from __future__ import annotations

import os
import shutil
import time

from lakefs_mount.s3.layout import META_PARTS
from lakefs_mount.s3.parttable import FOLDER
from tests.faultproxy import key_of

MiB = 1024 * 1024
PART = ("--part-size", "8M", "--commit-delay", "0")


def tables(s3) -> set[str]:
    return {o.key for o in s3.list_recursive(FOLDER)}


def named(s3, *keys: str) -> set[str]:
    """The tables the objects at `keys` name."""
    found = set()
    for key in keys:
        info = s3.head(key)
        assert info is not None, key
        found.add(info.metadata[META_PARTS])
    return found


def objects(s3) -> set[str]:
    return {o.key for o in s3.list_recursive("") if not o.key.startswith(".lakefs-mount/")}


def read_verified(mount_factory, files: dict[str, bytes]) -> None:
    """A fresh mount reads every file right, and checks every byte it fetches."""
    reader = mount_factory(*PART, name="reader")
    for name, data in files.items():
        assert (reader.path / name).read_bytes() == data, name
    counters = reader.counters()
    assert counters.get("bytes_unverified", 0) == 0, counters
    assert counters.get("bytes_verified", 0) >= sum(len(d) for d in files.values())
    assert reader.unmount().returncode == 0


def test_overwriting_a_multipart_file_again_and_again_leaves_one_table(mount_factory, s3):
    m = mount_factory(*PART)
    path = m.path / "ckpt" / "latest.pt"
    path.parent.mkdir()
    for step in range(5):  # a checkpoint saved over the last one, as torch.save does
        data = os.urandom(20 * MiB + step)
        path.write_bytes(data)
        assert m.flush().returncode == 0, m.log_tail()
        assert tables(s3) == named(s3, "ckpt/latest.pt"), step
    with path.open("r+b") as f:  # an edit in place: the unchanged parts are copied
        f.seek(9 * MiB)
        f.write(b"edited")
    data = data[:9 * MiB] + b"edited" + data[9 * MiB + 6:]
    assert m.unmount().returncode == 0
    assert tables(s3) == named(s3, "ckpt/latest.pt")
    read_verified(mount_factory, {"ckpt/latest.pt": data})


def test_removing_multipart_files_removes_their_tables_also_on_a_later_mount(
        mount_factory, s3):
    m = mount_factory(*PART)
    steps = {f"run/step_{s}/{f}": os.urandom(17 * MiB) for s in range(3)
             for f in ("model.pt", "optim.pt")}
    for name, data in steps.items():
        (m.path / name).parent.mkdir(parents=True, exist_ok=True)
        (m.path / name).write_bytes(data)
    (m.path / "run/step_0/meta.json").write_bytes(b"{}")  # small: no table
    assert m.flush().returncode == 0
    assert len(tables(s3)) == 6
    shutil.rmtree(m.path / "run/step_0")  # the job keeps the last checkpoints
    assert m.unmount().returncode == 0
    assert tables(s3) == named(s3, *(k for k in steps if "step_0" not in k))

    again = mount_factory(*PART, name="again")  # a restarted job: the mount learns the
    shutil.rmtree(again.path / "run/step_1")  # objects' metadata as it lists them
    assert again.flush().returncode == 0, again.log_tail()
    assert tables(s3) == named(s3, "run/step_2/model.pt", "run/step_2/optim.pt")
    assert again.unmount().returncode == 0
    read_verified(mount_factory, {k: v for k, v in steps.items() if "step_2" in k})


def test_a_rename_keeps_the_table_and_a_rename_over_a_file_removes_the_replaced_ones(
        mount_factory, s3):
    m = mount_factory(*PART)
    first, second, third = (os.urandom(18 * MiB + i) for i in range(3))
    (m.path / "a.bin").write_bytes(first)
    (m.path / "b.bin").write_bytes(second)
    assert m.flush().returncode == 0
    os.rename(m.path / "a.bin", m.path / "moved.bin")  # the moved object keeps its table
    assert m.flush().returncode == 0
    assert tables(s3) == named(s3, "moved.bin", "b.bin")

    os.rename(m.path / "moved.bin", m.path / "b.bin")  # a committed file over another
    assert m.flush().returncode == 0
    assert objects(s3) == {"b.bin"}
    assert tables(s3) == named(s3, "b.bin")

    (m.path / "tmp.bin").write_bytes(third)  # not yet in S3: its commit replaces b.bin
    os.rename(m.path / "tmp.bin", m.path / "b.bin")
    assert m.unmount().returncode == 0
    assert objects(s3) == {"b.bin"}
    assert tables(s3) == named(s3, "b.bin")
    read_verified(mount_factory, {"b.bin": third})


def test_the_removal_of_a_table_survives_kill9(mount_factory, s3, fault_proxy):
    """D29: the unlink is journaled with the removal of its object's table: S3 never
    answers the table's DELETE, the daemon is killed, and the next mount removes it."""
    fault_proxy.parse_requests = True  # (before the mount connects)
    m = mount_factory(*PART, endpoint_url=fault_proxy.endpoint_url)
    (m.path / "big.bin").write_bytes(os.urandom(20 * MiB))
    assert m.flush().returncode == 0
    (table,) = tables(s3)
    fault_proxy.hold_requests(
        lambda method, target: method == "DELETE" and key_of(target).startswith(FOLDER))
    os.unlink(m.path / "big.bin")
    deadline = time.monotonic() + 30
    while s3.head("big.bin") is not None or m.status()["name_changes_pending"] == 0:
        assert time.monotonic() < deadline, m.log_tail()
        time.sleep(0.1)
    m.kill9()
    fault_proxy.hold_requests(None)
    assert tables(s3) == {table}
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    assert tables(s3) == set()
    assert objects(s3) == set()


def test_a_missing_table_leaves_the_parts_read_unchecked(mount_factory, s3):
    data = os.urandom(20 * MiB)
    writer = mount_factory(*PART, name="writer")
    (writer.path / "f.bin").write_bytes(data)
    assert writer.unmount().returncode == 0
    (table,) = named(s3, "f.bin")
    s3.delete(table)  # (another tool, or a bucket written before tables were kept)
    reader = mount_factory(*PART, name="reader")
    with (reader.path / "f.bin").open("rb") as f:  # a part alone: only the table checks it
        f.seek(9 * MiB)
        assert f.read(MiB) == data[9 * MiB:10 * MiB]
    assert (reader.path / "f.bin").read_bytes() == data
    assert reader.counters().get("bytes_unverified", 0) >= MiB
    assert "missing" in reader.log_tail(200)
    assert reader.unmount().returncode == 0


