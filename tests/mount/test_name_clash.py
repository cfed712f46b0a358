"""A name S3 holds both as an object and as a prefix (`a` beside `a/x`, written by other
tools): POSIX shows one of them. The other is said to be hidden, in the log (once, with
what to do) and in status (issue 50, item 5), never silently unreachable."""

from __future__ import annotations

import json
import time

from tests.mounting import cli

TTL = 0.5  # --metadata-ttl: the daemon lists a directory again after this


def test_an_object_hidden_by_a_directory_of_its_name_is_reported(mount_factory, s3):
    s3.put("a", b"an object", {})
    s3.put("a/x", b"below it", {})
    s3.put("plain", b"shown", {})
    m = mount_factory("--metadata-ttl", str(TTL))
    assert sorted(p.name for p in m.path.iterdir()) == ["a", "plain"]
    assert (m.path / "a").is_dir() and (m.path / "a" / "x").read_bytes() == b"below it"
    status = m.status()
    assert status["hidden_objects"] == 1 and status["hidden_examples"] == ["a"]
    log = m.log_tail(400)
    assert f"s3://{m.bucket}/a is not shown: objects below it make a a directory" in log
    assert "Move the object to another key" in log
    human = cli("status", str(m.path), check=True).stdout
    assert "names not shown" in human and "see the log" in human

    # a file shown before objects below its name came: those are the hidden ones
    assert (m.path / "plain").read_bytes() == b"shown"
    s3.put("plain/y", b"later", {})
    time.sleep(TTL + 0.1)
    assert not (m.path / "probe").exists()  # a lookup at the root: lists it again
    assert (m.path / "plain").is_file()
    status = m.status()
    assert status["hidden_objects"] == 2 and "plain/" in status["hidden_examples"]
    log = m.log_tail(400)
    assert f"the objects below s3://{m.bucket}/plain/ are not shown: plain is a file" in log
    assert log.count("is not shown") == 1  # once each, however often it is listed
    assert json.loads(cli("status", str(m.path), "--json", check=True).stdout)[
        "hidden_objects"] == 2
