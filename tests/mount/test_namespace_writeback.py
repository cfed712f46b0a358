"""Namespace changes are written back like data (lakefs_mount/namespace/namelog.py, issue 30).

mkdir, rmdir, unlink and rename return once the journal has them, also while S3 is down;
the flusher applies them in order when S3 is back, a flush waits for them, and a kill -9
at any point loses none of them. End to end: a real mount, SeaweedFS, the fault proxy.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from lakefs_mount.s3.layout import encode_attrs
from lakefs_mount.s3.timeouts import BASE_SECONDS
from tests.faultproxy import listing

MiB = 1024 * 1024


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def bucket_tree(s3) -> dict[str, bytes]:
    """Every object of the bucket that is not a directory marker or lakefs-mount's own."""
    out = {}
    for info in s3.list_recursive(""):
        if info.key.endswith("/") or info.key.startswith(".lakefs-mount"):
            continue
        out[info.key] = s3.get_range(info.key, 0, info.size + 1) if info.size else b""
    return out


def markers(s3) -> set[str]:
    return {i.key for i in s3.list_recursive("") if i.key.endswith("/")}


def save_checkpoint(directory: Path, step: int) -> None:
    """Three files as a training job's checkpoint saver writes them (torch.save)."""
    import torch

    directory.mkdir(parents=True)
    torch.manual_seed(step)
    torch.save({"w": torch.randn(256, 256), "step": step}, directory / "model.pt")
    torch.save({"m": torch.randn(128, 128)}, directory / "optim.pt")
    (directory / "meta.json").write_text(f'{{"step": {step}}}')


def outage(proxy, kind: str, on: bool) -> None:
    """S3 refusing connections (a restart), or taking requests and never answering (a
    stuck load balancer: the black hole)."""
    if kind == "refused":
        proxy.fail = on
    else:
        proxy.hang = on


OUTAGE_SECONDS = 60  # the outage: long enough for every S3 bound to run out


@pytest.mark.parametrize("kind", ["refused", "black-hole"])
def test_a_training_loop_runs_through_a_60_s_outage_and_the_bucket_converges(
        mount_factory, s3, fault_proxy, kind):
    """makedirs, torch.save into a tmp dir, rename it to checkpoint-N, delete checkpoint
    N-2, a step a second for 60 s while S3 is down: every step returns at local speed
    (the first one after S3 went quiet waits a lookup's patience), then S3 holds exactly
    what the mount shows."""
    m = mount_factory("--metadata-ttl", "1", endpoint_url=fault_proxy.endpoint_url)
    run = m.path / "run"
    for step in (0, 1):
        save_checkpoint(run / f"tmp-{step}", step)
        os.rename(run / f"tmp-{step}", run / f"checkpoint-{step}")
    assert m.flush().returncode == 0
    outage(fault_proxy, kind, True)
    seconds = []
    began = time.monotonic()
    step = 1
    while time.monotonic() - began < OUTAGE_SECONDS:
        step += 1
        started = time.monotonic()
        os.makedirs(run / f"logs/step_{step}")
        save_checkpoint(run / f"tmp-{step}", step)
        os.rename(run / f"tmp-{step}", run / f"checkpoint-{step}")
        shutil.rmtree(run / f"checkpoint-{step - 2}")
        seconds.append(time.monotonic() - started)
        time.sleep(1.1)  # past the TTL: every step looks the names up in S3 again
    print("seconds per step while S3 was down:", [round(s, 2) for s in seconds])
    assert sorted(os.listdir(run)) == [f"checkpoint-{step - 1}", f"checkpoint-{step}", "logs"]
    assert m.status()["name_changes_pending"] > 0  # nothing of it reached S3 yet
    assert bucket_tree(s3).keys() == {f"run/checkpoint-{s}/{f}" for s in (0, 1)
                                      for f in ("model.pt", "optim.pt", "meta.json")}
    # (S3 held for minutes before: a lookup waited 3 x 60 s per directory; then 30 s)
    assert max(seconds) < 3.0 and sorted(seconds)[len(seconds) // 2] < 1.0, seconds
    outage(fault_proxy, kind, False)
    assert m.flush().returncode == 0, m.log_tail()
    assert m.status()["name_changes_pending"] == 0
    assert bucket_tree(s3) == {"run/" + k: v for k, v in tree(run).items()}
    assert {f"run/logs/step_{s}/" for s in range(2, step + 1)} <= markers(s3)
    assert not any("tmp-" in k or "checkpoint-2/" in k for k in markers(s3))


@pytest.mark.parametrize("kind", ["refused", "black-hole"])
def test_kill9_during_an_outage_then_remount_applies_every_change(mount_factory, s3,
                                                                    fault_proxy, kind):
    """The journal keeps namespace changes made while S3 was down; the next mount
    applies them in order, and the bucket ends as the mount showed it."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    (m.path / "keep").write_bytes(b"keep")
    (m.path / "gone").write_bytes(b"gone")
    (m.path / "moved").write_bytes(b"moved")
    (m.path / "old-dir").mkdir()
    (m.path / "ckpt" / "shards").mkdir(parents=True)
    for i in range(3):
        (m.path / "ckpt" / "shards" / f"{i}.bin").write_bytes(random.randbytes(100_000))
    assert m.flush().returncode == 0
    outage(fault_proxy, kind, True)
    started = time.monotonic()
    os.rename(m.path / "ckpt", m.path / "ckpt-final")  # committed objects, moved later
    os.unlink(m.path / "gone")
    os.rename(m.path / "moved", m.path / "arrived")
    with open(m.path / "arrived", "r+b") as f:  # a change on top of the object it moves
        f.write(b"MOV")
    os.rmdir(m.path / "old-dir")
    (m.path / "new-dir" / "sub").mkdir(parents=True)
    (m.path / "gone").write_bytes(b"a new file of an unlinked name")
    os.chmod(m.path / "ckpt-final", 0o700)
    expected = tree(m.path)
    assert expected["arrived"] == b"MOVed"
    # (in a black hole the open of "arrived" waited 30 s to revalidate it)
    assert time.monotonic() - started < 5, m.log_tail()
    m.kill9()
    outage(fault_proxy, kind, False)
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    assert tree(m.path) == expected
    assert bucket_tree(s3) == expected
    assert stat.S_IMODE(os.stat(m.path / "ckpt-final").st_mode) == 0o700
    assert {"new-dir/", "new-dir/sub/", "ckpt-final/"} <= markers(s3)
    assert not {"old-dir/", "ckpt/", "ckpt/shards/"} & markers(s3)


def test_unlink_then_a_new_file_of_that_name_keeps_the_new_object(mount_factory, s3,
                                                                  fault_proxy):
    """The DELETE of the old object goes before the commit of the new one, never after."""
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    (m.path / "f").write_bytes(b"old")
    assert m.flush().returncode == 0
    fault_proxy.fail = True
    os.unlink(m.path / "f")
    (m.path / "f").write_bytes(b"new")
    fault_proxy.fail = False
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"f": b"new"}


def test_a_rename_stopped_between_copy_and_delete_finishes_after_kill9(
        mount_factory, s3):
    """A move whose copy is done and whose delete is not: the next mount deletes the old
    key and keeps the copy; the file's later changes commit on top of it."""
    m = mount_factory("--test-hook", "hold_move_after_copy=1")
    data = random.randbytes(3 * MiB)
    (m.path / "a").write_bytes(data)
    assert m.flush().returncode == 0
    os.rename(m.path / "a", m.path / "b")
    deadline = time.monotonic() + 30
    while s3.head("b") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s3.head("a") is not None and s3.head("b") is not None  # held after the copy
    with open(m.path / "b", "r+b") as f:  # a change on top of the moved object
        f.seek(MiB)
        f.write(b"changed")
    m.kill9()
    hook = m.options.index("--test-hook")  # the next mount applies the rest of the move
    m.options = m.options[:hook] + m.options[hook + 2:]
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    want = data[:MiB] + b"changed" + data[MiB + 7:]
    assert bucket_tree(s3) == {"b": want}
    assert (m.path / "b").read_bytes() == want


def test_flush_reports_namespace_changes_that_keep_failing(mount_factory, fault_proxy):
    """A flush does not return 0 while a change is not in S3: it fails with the reason
    once S3 keeps refusing, and the daemon keeps the change and applies it later."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.fail = True
    (m.path / "d").mkdir()
    proc = m.flush(timeout=240)
    assert proc.returncode != 0
    assert "dir" in proc.stderr and "d/" in proc.stderr
    fault_proxy.fail = False
    assert m.flush().returncode == 0


def test_status_shows_pending_namespace_changes_and_why_they_wait(mount_factory,
                                                                  fault_proxy):
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.fail = True
    (m.path / "x").mkdir()
    (m.path / "y").mkdir()
    deadline = time.monotonic() + 30
    while m.status()["name_changes_error"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    st = m.status()
    assert st["name_changes_pending"] == 2
    assert st["name_changes_error"] and st["last_error"]
    fault_proxy.fail = False
    assert m.flush().returncode == 0
    st = m.status()
    assert (st["name_changes_pending"], st["name_changes_error"]) == (0, None)


def test_an_unlink_does_not_wait_for_a_commit_stuck_in_a_black_hole(mount_factory, s3,
                                                                   fault_proxy):
    """The file's DELETE waits for the commit instead, so what that commit lands is
    deleted, and a new file of the name commits after both."""
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    (m.path / "warm").write_bytes(b"x")
    assert m.flush().returncode == 0
    fault_proxy.hang = True
    (m.path / "f").write_bytes(b"old")
    deadline = time.monotonic() + 10
    while m.status()["files_committing"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.status()["files_committing"] == 1  # its PutObject is in the black hole
    started = time.monotonic()
    os.unlink(m.path / "f")
    assert time.monotonic() - started < 5
    (m.path / "f").write_bytes(b"new")
    fault_proxy.hang = False
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"warm": b"x", "f": b"new"}



@pytest.mark.parametrize("size", [100_000, 40 * MiB],
                         ids=["PutObject", "CompleteMultipartUpload"])
def test_a_commit_a_killed_daemon_had_under_way_never_brings_an_unlinked_file_back(
        mount_factory, s3, fault_proxy, size):
    """kill -9 while the commit of a file unlinked during it still sits at the proxy: the
    next mount replays the file's DELETE, and the dead daemon's request reaches S3
    afterwards. A PutObject lands, and the mount deletes that object again (its metadata
    names the file); a CompleteMultipartUpload fails, as the recovery aborted its upload.
    An object of that name that another writer puts afterwards stays. Proves D26."""
    fault_proxy.parse_requests = True
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    (m.path / "keep").write_bytes(b"k")
    assert m.flush().returncode == 0
    multipart = size > 16 * MiB

    def the_commit(method: str, target: str) -> bool:
        if "/victim" not in target:
            return False
        return ("uploadId=" in target and method == "POST") if multipart else (
            method == "PUT" and "partNumber=" not in target)

    # held with its whole body: the request S3 gets later is complete (a sender killed
    # before its body left would leave the proxy nothing to send)
    released = fault_proxy.delay_requests(the_commit, whole=True)
    (m.path / "victim").write_bytes(os.urandom(size))
    _wait_until(lambda: fault_proxy.requests_held >= 1, "the commit's request held")
    os.unlink(m.path / "victim")
    m.kill9()
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"keep": b"k"}
    released.set()  # the dead daemon's request reaches S3 now
    if multipart:
        time.sleep(3)
    else:
        _wait_until(lambda: m.counters().get("late_commits_undone") == 1,
                    "the late commit deleted again")
    assert bucket_tree(s3) == {"keep": b"k"}
    assert "victim" not in os.listdir(m.path)
    s3.put("victim", b"another writer's", {})
    time.sleep(3)  # (the mount looks at the key every few seconds)
    assert bucket_tree(s3) == {"keep": b"k", "victim": b"another writer's"}
    assert m.counters().get("late_commits_undone", 0) == (0 if multipart else 1)


@pytest.mark.parametrize("change", ["unlink", "rename"])
def test_a_file_whose_commit_landed_unrecorded_before_kill9_leaves_no_object_behind(
        mount_factory, s3, fault_proxy, change):
    """A file's PutObject reaches S3, but the daemon is killed before the journal records
    the commit: the next mount recovers the file as never committed. Unlinked or renamed
    there (its recovered commit failing meanwhile), no object stays at its old name (the
    crash loop's defect)."""
    fault_proxy.parse_requests = True
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    released = fault_proxy.delay_requests(
        lambda method, target: method == "PUT" and "/victim" in target, whole=True)
    body = os.urandom(100_000)
    (m.path / "victim").write_bytes(body)
    _wait_until(lambda: fault_proxy.requests_held >= 1, "the commit's request held")
    m.kill9()
    released.set()
    _wait_until(lambda: "victim" in bucket_tree(s3), "the dead daemon's PutObject landed")
    fault_proxy.answer_share(503, "SlowDown", 1.0, frozenset({"PUT"}))
    m.start()
    _wait_until(lambda: fault_proxy.answered >= 3 and m.status()["files_committing"] == 0,
                "the recovered file's commit failed")
    if change == "unlink":
        os.unlink(m.path / "victim")
    else:
        os.rename(m.path / "victim", m.path / "renamed")
    fault_proxy.answer_share(503, "SlowDown", 0.0)
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == ({} if change == "unlink" else {"renamed": body})


def test_a_commit_request_that_timed_out_and_lands_after_the_unlink_is_deleted_again(
        mount_factory, s3, fault_proxy):
    """A file's PutObject is held at the proxy past its time bound, and the file unlinked
    meanwhile: its DELETE follows the end of that commit, and then the request the mount
    gave up on reaches S3 and brings the file back; the mount deletes it again (D26)."""
    fault_proxy.parse_requests = True
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    held: list[str] = []

    def first_put(method: str, target: str) -> bool:
        if method == "PUT" and "/victim" in target and not held:
            held.append(target)
            return True
        return False

    fault_proxy.delay_requests(first_put, BASE_SECONDS + 8)  # (the bound of a small PUT: 10 s)
    (m.path / "victim").write_bytes(os.urandom(100_000))
    _wait_until(lambda: fault_proxy.requests_held >= 1, "the commit's request held")
    os.unlink(m.path / "victim")
    _wait_until(lambda: m.counters().get("late_commits_undone") == 1,
                "the late PutObject deleted again", timeout=60)
    assert bucket_tree(s3) == {}
    assert m.flush().returncode == 0
    assert "victim" not in os.listdir(m.path)


def finish_like_dcp(directory: Path, body: bytes) -> None:
    """What torch 2.13's FileSystemWriter.finish does with a checkpoint's `.metadata`:
    written as `.metadata.tmp` and fsynced, the last save's `.metadata` removed, then the
    rename."""
    tmp = directory / ".metadata.tmp"
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    if (directory / ".metadata").exists():
        (directory / ".metadata").unlink()
    os.rename(tmp, directory / ".metadata")


@pytest.mark.parametrize("held", [0.0, 1.0])
def test_flush_returns_once_a_file_renamed_after_its_write_is_in_s3_under_its_final_name(
        mount_factory, s3, fault_proxy, held):
    """`flush` means "in S3 under its final name" (issue 31: DCP's `.metadata` missing
    after a cold remount). With no commit delay the temporary file's PutObject may be
    under way at the rename (held `held` s at the proxy, with its DELETE): the rename then
    waits for it and moves the object in S3 (CopyObject, DELETE), after the unlink of the
    last save's `.metadata`. Right after each flush S3 has that save's `.metadata` and no
    `.metadata.tmp`."""
    fault_proxy.parse_requests = True
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    ckpt = m.path / "ckpt"
    ckpt.mkdir()
    for save in range(3):
        body = os.urandom(3000 + save)
        if held:
            fault_proxy.delay_keys("ckpt/.metadata.tmp", held)
        finish_like_dcp(ckpt, body)
        assert m.flush().returncode == 0, m.log_tail()
        fault_proxy.release_keys()
        keys = {i.key for i in s3.list_recursive("ckpt/")} - {"ckpt/"}
        assert keys == {"ckpt/.metadata"}, (save, keys, m.log_tail())
        assert s3.get_range("ckpt/.metadata", 0, len(body) + 1) == body, save
    if held:  # the rename met the commit under way: the object moved in S3
        methods = [(method, target) for method, target in fault_proxy.requests_log
                   if ".metadata" in target]
        assert any(method == "DELETE" and target.endswith("/ckpt/.metadata.tmp")
                   for method, target in methods), methods


def _wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _move_a_never_listed_tree(s3, m, fault_proxy) -> tuple[dict[str, bytes], object]:
    """S3 holds ckpt/shards/{a.bin,deep/b.bin}; ckpt is renamed to ckpt-final with the move's
    own listing of ckpt/ held at the proxy (the move has not started; returns its event)."""
    bodies = {"ckpt/shards/a.bin": os.urandom(300_000), "ckpt/shards/deep/b.bin": b"b"}
    for key, body in bodies.items():
        s3.put(key, body, {})
    assert "ckpt" in os.listdir(m.path)
    move = fault_proxy.delay_requests(listing("ckpt/", recursive=True))
    os.rename(m.path / "ckpt", m.path / "ckpt-final")
    _wait_until(lambda: any(listing("ckpt/", recursive=True)(*r)
                            for r in fault_proxy.requests_log), "the move's listing is held")
    return bodies, move


def _let_the_move_finish(s3, fault_proxy, move) -> None:
    move.set()
    _wait_until(lambda: s3.head("ckpt/shards/a.bin") is None
                and s3.head("ckpt/shards/deep/b.bin") is None
                and s3.head("ckpt-final/shards/a.bin") is not None, "the move lands in S3")


def test_a_listing_that_a_written_back_move_overtakes_lists_the_objects_at_their_new_place(
        mount_factory, s3, fault_proxy):
    """A directory renamed here is listed where S3 still has its objects. If the move's
    copies land and the old keys go while that listing is under way (CI: EIO reading a
    file of it), the listing is taken again where the objects are now."""
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    held_listing = fault_proxy.delay_requests(listing("ckpt/shards/", recursive=False))
    bodies, move = _move_a_never_listed_tree(s3, m, fault_proxy)
    listed: list[object] = []
    lister = threading.Thread(target=lambda: listed.append(
        sorted(os.listdir(m.path / "ckpt-final" / "shards"))))
    lister.start()
    try:
        _wait_until(lambda: fault_proxy.requests_held >= 2, "the mount's listing is held")
        _let_the_move_finish(s3, fault_proxy, move)
    finally:
        held_listing.set()
        lister.join(60)
    print("LOG", fault_proxy.requests_log)
    assert listed == [["a.bin", "deep"]], m.log_tail()
    shards = m.path / "ckpt-final" / "shards"
    assert (shards / "a.bin").read_bytes() == bodies["ckpt/shards/a.bin"]
    assert (shards / "deep" / "b.bin").read_bytes() == b"b"


def test_a_read_whose_object_a_written_back_move_takes_away_reads_it_at_its_new_place(
        mount_factory, s3, fault_proxy):
    """A file listed at the old place of its renamed directory reads from there. If the
    move deletes that object while the GET is on its way, the GET goes again to where
    the object is now, instead of failing the read with EIO."""
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    bodies, move = _move_a_never_listed_tree(s3, m, fault_proxy)
    shards = m.path / "ckpt-final" / "shards"
    assert sorted(os.listdir(shards)) == ["a.bin", "deep"]  # listed at ckpt/shards/
    get = fault_proxy.delay_requests(
        lambda method, target: method == "GET" and target.split("?")[0].endswith(
            "/ckpt/shards/a.bin"))
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append((shards / "a.bin").read_bytes()))
    reader.start()
    try:
        _wait_until(lambda: fault_proxy.requests_held == 2, "the read's GET is held")
        _let_the_move_finish(s3, fault_proxy, move)
    finally:
        get.set()
        reader.join(60)
    assert read == [bodies["ckpt/shards/a.bin"]], m.log_tail()
    assert " ERROR " not in m.log_tail(1000), m.log_tail()  # (the kernel tries a read again)
    gets = [target for method, target in fault_proxy.requests_log
            if method == "GET" and target.split("?")[0].endswith("shards/a.bin")]
    assert gets[-1].split("?")[0].endswith("/ckpt-final/shards/a.bin"), gets
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {k.replace("ckpt/", "ckpt-final/", 1): v
                               for k, v in bodies.items()}


def test_a_file_of_a_moved_directory_shows_its_stored_attributes_before_the_move_lands(
        mount_factory, s3, fault_proxy):
    """Its metadata (mode, owner, mtime) is read where the object is while the move of
    its directory is pending: the HEAD went to the new key, which S3 does not have yet,
    and the file showed the defaults (0644, the mount's owner) from then on."""
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    mtime = 1_600_000_000 * 10**9
    s3.put("ckpt/shards/deep/c.bin", b"c" * 300_000,
           encode_attrs(stat.S_IFREG | 0o600, 1234, 5678, mtime))
    _, move = _move_a_never_listed_tree(s3, m, fault_proxy)
    try:
        st = os.stat(m.path / "ckpt-final" / "shards" / "deep" / "c.bin")
    finally:
        move.set()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (
        0o600, 1234, 5678, mtime), m.log_tail()


def _parts_sent(fault_proxy, key: str) -> int:
    """UploadParts the mount sent for `key` so far."""
    return sum(1 for method, target in fault_proxy.requests_log
               if method == "PUT" and "partNumber=" in target
               and unquote(target.split("?")[0]).endswith("/" + key))


def _save_streamed(m, fault_proxy, key: str, body: bytes, streamed: int) -> None:
    """Write `body` to `key` in the mount and close it once `streamed` of its parts are
    in S3 (the flusher sends full parts while a file is written)."""
    with open(m.path / key, "wb") as f:
        f.write(body)
        f.flush()
        _wait_until(lambda: _parts_sent(fault_proxy, key) >= streamed,
                    f"{streamed} parts of {key} streamed")


def test_a_file_renamed_after_its_parts_streamed_sends_no_part_twice(
        mount_factory, s3, fault_proxy):
    """A file written to a temporary name, then renamed once most of its parts are up:
    those parts went again under the new name. Now the upload completes at the old key
    and the object moves in S3 (a server-side copy, cheaper than sending them again)."""
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    (m.path / "ckpt").mkdir()
    body = os.urandom(40 * MiB)  # 16 MiB parts: two streamed, the last one at the commit
    _save_streamed(m, fault_proxy, "ckpt/model.safetensors.tmp1234", body, 2)
    os.rename(m.path / "ckpt" / "model.safetensors.tmp1234",
              m.path / "ckpt" / "model.safetensors")
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"ckpt/model.safetensors": body}
    sent = [t for method, t in fault_proxy.requests_log if method == "PUT" and "partNumber=" in t]
    assert len(sent) == 3, sent
    assert " ERROR " not in m.log_tail(1000), m.log_tail()
    cold = mount_factory(name="cold")
    assert (cold.path / "ckpt" / "model.safetensors").read_bytes() == body


def _requests_for(fault_proxy, key: str) -> list[tuple[str, str]]:
    return [(method, target) for method, target in fault_proxy.requests_log
            if unquote(target.split("?")[0]).endswith("/" + key)]


def _mkstemp(path: Path) -> int:
    """Create `path` as tempfile.mkstemp and safetensors (Rust's tempfile) do."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


@pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)
def test_a_temporary_keeps_its_parts_back_until_it_has_its_final_name(
        mount_factory, s3, fault_proxy):
    """safetensors writes its file under a temporary name made by mkstemp and renames it
    right after the last write, before it even closes: the parts streamed under the
    temporary name went again under the final one, or the whole object was copied in S3.
    A temporary's full parts now wait for its final name, and go up at the rename, while
    the writer still writes."""
    fault_proxy.parse_requests = True
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    body = os.urandom(36 * MiB)  # 5 parts of 8 MiB, the last one short
    fd = _mkstemp(m.path / ".tmpAb12Cd")
    try:
        os.write(fd, body[:32 * MiB])
        time.sleep(1.5)  # (the passthrough watcher looks every 0.1 s)
        assert _requests_for(fault_proxy, ".tmpAb12Cd") == []
        os.rename(m.path / ".tmpAb12Cd", m.path / "model.safetensors")
        _wait_until(lambda: _parts_sent(fault_proxy, "model.safetensors") >= 3,
                    "the full parts streamed once the file has its final name")
        os.write(fd, body[32 * MiB:])
    finally:
        os.close(fd)
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"model.safetensors": body}
    assert _requests_for(fault_proxy, ".tmpAb12Cd") == []  # no upload there, no copy
    assert _parts_sent(fault_proxy, "model.safetensors") == 5
    assert m.counters()["temporaries_held"] == 1


def test_a_temporary_that_is_not_renamed_streams_once_its_hold_is_over(
        mount_factory, s3, fault_proxy):
    """The hold is bounded: a file made by mkstemp that keeps its name (a scratch file, a
    save into a kept temporary) is written like any other once `--hold-temporaries` is
    over, while its writer still writes."""
    fault_proxy.parse_requests = True
    m = mount_factory("--part-size", "8M", "--hold-temporaries", "1",
                      endpoint_url=fault_proxy.endpoint_url)
    body = os.urandom(28 * MiB)
    fd = _mkstemp(m.path / "tmpk3pt")
    try:
        os.write(fd, body[:16 * MiB])
        time.sleep(1.5)
        assert _parts_sent(fault_proxy, "tmpk3pt") == 0  # (held for 1 s)
        os.write(fd, body[16 * MiB:24 * MiB])  # the next full chunk: the hold is over
        _wait_until(lambda: _parts_sent(fault_proxy, "tmpk3pt") >= 2,
                    "a temporary past its hold streams while it is written")
        os.write(fd, body[24 * MiB:])
    finally:
        os.close(fd)
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"tmpk3pt": body}
    assert _parts_sent(fault_proxy, "tmpk3pt") == 4
    assert m.counters()["temporaries_held"] == 1


def test_saves_through_one_temporary_name_each_land_once_in_order(
        mount_factory, s3, fault_proxy):
    """Every save writes the same temporary name and renames it over the last save
    before that one is in S3: the first file is gone (its upload is aborted, the move
    waiting for it finds nothing), the second's commit at the temporary name waits for
    that move, and the bucket ends with the last save, no part sent twice."""
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    bodies = [os.urandom(40 * MiB), os.urandom(36 * MiB)]
    for body in bodies:
        _save_streamed(m, fault_proxy, "big.tmp", body, 2 * (bodies.index(body) + 1))
        os.rename(m.path / "big.tmp", m.path / "big")
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"big": bodies[-1]}
    assert (m.path / "big").read_bytes() == bodies[-1]
    assert _parts_sent(fault_proxy, "big") == 0  # none sent again under the new name


def test_a_kept_upload_survives_kill9_and_a_truncate_by_going_again_to_the_new_name(
        mount_factory, s3, fault_proxy):
    """After a crash the upload at the old key is aborted and the journal's bytes go to
    the new name; a file shrunk below a part after the rename gives its upload up and
    commits with one PUT behind the move (which then finds nothing to move). Proves D25
    (crash before the commit)."""
    fault_proxy.parse_requests = True
    m = mount_factory("--commit-delay", "60", endpoint_url=fault_proxy.endpoint_url)
    body = os.urandom(40 * MiB)
    _save_streamed(m, fault_proxy, "a.tmp", body, 2)
    os.rename(m.path / "a.tmp", m.path / "a")
    _save_streamed(m, fault_proxy, "b.tmp", body, 2)
    os.rename(m.path / "b.tmp", m.path / "b")
    os.truncate(m.path / "b", 1000)
    m.kill9()
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"a": body, "b": body[:1000]}
    assert (m.path / "a").read_bytes() == body
    assert " ERROR " not in m.log_tail(1000), m.log_tail()


def test_a_kept_upload_completed_at_the_old_key_moves_after_kill9(
        mount_factory, s3, fault_proxy):
    """The commit completed the upload at the old key and the move's CopyObject is held:
    after kill -9 the journal's move is replayed, and the object ends at the new name
    only. Proves D25 (crash after the commit)."""
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    body = os.urandom(40 * MiB)
    copy = fault_proxy.delay_requests(
        lambda method, target: method == "PUT" and target.split("?")[0].endswith("/a"))
    _save_streamed(m, fault_proxy, "a.tmp", body, 2)
    os.rename(m.path / "a.tmp", m.path / "a")
    _wait_until(lambda: s3.head("a.tmp") is not None, "the upload completed at the old key")
    _wait_until(lambda: fault_proxy.requests_held >= 1, "the move's copy is held")
    m.kill9()
    copy.set()
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"a": body}
    assert (m.path / "a").read_bytes() == body
    assert _parts_sent(fault_proxy, "a") == 0


def test_a_listing_answered_before_an_rmdir_landed_does_not_bring_the_directory_back(
        mount_factory, fault_proxy):
    """`mkdir a; mkdir a/b; rmdir a/b; rmdir a` failed now and then with ENOTEMPTY (issue
    53): a listing of `a` that S3 answered while `a/b/` was still there, and that arrived
    after the rmdir's DELETE had landed, added `b` back until the next listing. A listing
    now leaves out what a removal that landed after it was sent took away."""
    ttl = 2.0
    fault_proxy.parse_requests = fault_proxy.parse_responses = True
    m = mount_factory("--metadata-ttl", str(ttl), endpoint_url=fault_proxy.endpoint_url)
    (m.path / "a" / "b").mkdir(parents=True)
    assert m.flush().returncode == 0  # both markers in S3
    late = 3.0  # longer than a lookup waits for a listing before it answers without it
    fault_proxy.hold_responses(listing("a/", recursive=False), late)
    time.sleep(ttl + 0.1)
    lister = threading.Thread(target=lambda: os.listdir(m.path / "a"))
    sent = time.monotonic()
    lister.start()  # the listing of a/: S3 answers with a/b/ now, it arrives `late`
    time.sleep(0.5)
    (m.path / "a" / "b").rmdir()  # acknowledged; its DELETE lands well before that answer
    assert m.flush().returncode == 0
    assert time.monotonic() < sent + late, "the DELETE landed after the listing arrived"
    lister.join(30)
    time.sleep(max(0.0, sent + late + 0.3 - time.monotonic()))  # it has arrived, and is
    fault_proxy.hold_responses(None)  # the directory's listing for `ttl` seconds
    assert fault_proxy.answers_held >= 1
    assert "b" not in os.listdir(m.path / "a")
    (m.path / "a").rmdir()
    assert m.flush().returncode == 0


def test_a_rename_over_a_committed_file_serves_the_new_bytes_while_s3_moves_them(
        mount_factory, s3, fault_proxy):
    """`rename(tmp, ckpt)` over a committed `ckpt`, and an `ls -l` and a read of `ckpt`
    while S3's CopyObject is still under way: S3 lists the old `ckpt` then. The name must
    show and read what was renamed onto it (it served the old size, or ENOENT, under
    load), and S3 ends with the new bytes."""
    fault_proxy.parse_requests = True
    m = mount_factory("--metadata-ttl", "0.2", endpoint_url=fault_proxy.endpoint_url)
    (m.path / "ckpt.tmp").write_bytes(b"new")
    (m.path / "ckpt").write_bytes(b"old content")
    assert m.flush().returncode == 0
    copy = fault_proxy.delay_requests(
        lambda method, target: method == "PUT" and target.split("?")[0].endswith("/ckpt"))
    try:
        os.rename(m.path / "ckpt.tmp", m.path / "ckpt")
        _wait_until(lambda: fault_proxy.requests_held >= 1, "the move's CopyObject held")
        for _ in range(3):
            time.sleep(0.3)  # past the TTL: each look lists the directory again
            assert {p.name: p.stat().st_size for p in m.path.iterdir()} == {"ckpt": 3}
            assert (m.path / "ckpt").read_bytes() == b"new", m.log_tail()
    finally:
        copy.set()
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"ckpt": b"new"}
    assert (m.path / "ckpt").read_bytes() == b"new"
