"""`lakefs-mount sweep-tables` (issue 51): the tables of part CRCs that older versions left
behind (objects deleted without their tables) are deleted; the tables an object names, and
young ones (an object may still be completing), stay; and nothing goes when S3 fails."""

from __future__ import annotations

import json
import os
import time

from lakefs_mount.s3.parttable import FOLDER
from tests.mount.test_part_tables import PART, MiB, named, tables
from tests.mounting import cli


def test_sweep_tables_deletes_only_old_tables_no_object_names(mount_factory, s3, s3_server):
    """Tables left by older versions (objects deleted without their tables) go; tables
    an object names, and young ones (an object may be completing), stay."""
    m = mount_factory(*PART, prefix="job/")
    files = {f"step_{s}.pt": os.urandom(18 * MiB + s) for s in range(4)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    (m.path / "small.json").write_bytes(b"{}")
    assert m.unmount().returncode == 0
    job_tables = {o.key for o in s3.list_recursive("job/" + FOLDER)}
    for name in ("step_0.pt", "step_1.pt"):  # as an older version left them
        s3.delete("job/" + name)
    left = named(s3, "job/step_2.pt", "job/step_3.pt")
    time.sleep(4.0)  # (S3 keeps LastModified to the second)
    young = f"job/{FOLDER}young"  # written a moment ago: its object may be completing
    s3.put(young, b"not yet named", {})
    source = ("sweep-tables", f"s3://{s3.bucket}/job", "--endpoint-url",
              s3_server.endpoint_url, "--grace", "3", "--json")

    dry = cli(*source, "--dry-run", check=True)
    report = json.loads(dry.stdout)
    assert (report["tables"], report["named"], report["young"], report["deleted"]) == \
        (5, 2, 1, 2), report
    assert {o.key for o in s3.list_recursive("job/" + FOLDER)} == job_tables | {young}

    report = json.loads(cli(*source, check=True).stdout)
    assert report["deleted"] == 2 and set(report["deleted_keys"]) == job_tables - left
    assert {o.key for o in s3.list_recursive("job/" + FOLDER)} == left | {young}
    reader = mount_factory(*PART, prefix="job/", name="reader")
    for name in ("step_2.pt", "step_3.pt"):
        assert (reader.path / name).read_bytes() == files[name]
    assert reader.counters().get("bytes_unverified", 0) == 0
    assert reader.unmount().returncode == 0


def test_sweep_tables_deletes_nothing_when_s3_fails(s3, fault_proxy, mount_factory):
    m = mount_factory(*PART)
    (m.path / "f.bin").write_bytes(os.urandom(18 * MiB))
    assert m.unmount().returncode == 0
    s3.delete("f.bin")
    s3.put("g.bin", os.urandom(9 * MiB), {})  # large enough to be HEADed
    orphan = tables(s3)
    assert len(orphan) == 1
    time.sleep(1.0)
    fault_proxy.parse_requests = True
    fault_proxy.answer_with(500, "InternalError", 100, methods=frozenset({"HEAD"}))
    proc = cli("sweep-tables", f"s3://{s3.bucket}/", "--endpoint-url",
               fault_proxy.endpoint_url, "--grace", "0.5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("lakefs-mount: S3 HeadObject"), proc.stderr
    assert tables(s3) == orphan
