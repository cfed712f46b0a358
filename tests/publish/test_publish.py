"""Checkpoint publication (issue 24): `commit` writes PATH/.lakefs-commit.json last, from
S3's listing of PATH (other nodes' objects too), `verify` checks a checkpoint against it
with and without a mount, and the Python API drives a mount without a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import crc32c
import pytest

from lakefs_mount.publish.manifest import MANIFEST_NAME, SELF_CHECK, encode_crc
from tests.faults.test_s3_black_hole import wait_for
from tests.mounting import CLI, cli

MiB = 1024 * 1024


def _write(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _manifest(s3, prefix: str) -> dict:
    got = s3.get(prefix + MANIFEST_NAME)
    assert got is not None, f"no manifest at {prefix}{MANIFEST_NAME}"
    return json.loads(got[1])


def _crc(data: bytes) -> str:
    return encode_crc(crc32c.crc32c(data))


@contextlib.contextmanager
def _running(*args: str) -> Iterator[subprocess.Popen]:
    """`lakefs-mount ARGS` in the background, killed if the test leaves it running."""
    proc = subprocess.Popen([CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_commit_lists_exactly_the_files_with_their_crc32c_and_writes_the_manifest_last(
        mount_factory, fault_proxy, s3):
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    files = {"model.pt": os.urandom(3 * MiB + 17), "optim/shard-0.bin": os.urandom(20 * MiB),
             "empty.txt": b""}
    for rel, data in files.items():
        _write(m.path / "ckpt" / "step_1" / rel, data)
    _write(m.path / "ckpt" / "step_10" / "not-this.pt", b"x")  # a name with the same start
    other_node = os.urandom(5 * MiB + 3)  # put by "another node": not in this node's cache
    s3.put("ckpt/step_1/rank1.pt", other_node, {})
    files["rank1.pt"] = other_node

    proc = cli("commit", str(m.path), "ckpt/step_1", "--json")
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    result = json.loads(proc.stdout.splitlines()[-1])["result"]
    assert result["manifest"] == "ckpt/step_1/" + MANIFEST_NAME
    assert result["checksums"] == {"cache": 3, "read": 1}  # this node's from its cache

    doc = _manifest(s3, "ckpt/step_1/")
    assert doc["format"] == "lakefs-mount/commit" and doc["version"] == 1
    assert doc["checksum_algorithm"] == "CRC32C"
    assert doc["committed_by"]["host"] == os.uname().nodename
    assert {f["key"] for f in doc["files"]} == set(files)
    for f in doc["files"]:
        data = files[f["key"]]
        assert f["size"] == len(data)
        assert f["etag"] == s3.head("ckpt/step_1/" + f["key"]).etag
        assert f["checksum"]["algorithm"] == "CRC32C"
        assert f["checksum"]["value"] == _crc(data), f["key"]
    assert doc["file_count"] == 4 and doc["total_bytes"] == sum(map(len, files.values()))
    written = (m.path / "ckpt/step_1/model.pt").stat().st_mtime
    model = next(f for f in doc["files"] if f["key"] == "model.pt")
    assert model["mtime"] == pytest.approx(written, abs=1e-6)  # the mount's mtime

    # the proxy's log: the manifest's PUT came after every write of a data object
    log = [(method, unquote(target.split("?")[0].split("/", 2)[-1]))
           for method, target in fault_proxy.requests_log]
    writes = [i for i, (method, key) in enumerate(log)
              if method in ("PUT", "POST") and key.startswith("ckpt/step_1/")]
    manifest_puts = [i for i in writes if log[i][1].endswith(MANIFEST_NAME)]
    assert len(manifest_puts) == 1
    data_writes = [i for i in writes if i not in manifest_puts]
    assert {log[i][1] for i in data_writes if not log[i][1].endswith("/")} == {
        "ckpt/step_1/" + k for k in ("model.pt", "optim/shard-0.bin", "empty.txt")}
    assert max(data_writes) < manifest_puts[0], log[-10:]  # (directory markers too)


def test_commit_waits_for_another_nodes_file_and_times_out_when_one_never_comes(mount, s3):
    _write(mount.path / "run" / "rank0.pt", b"zero" * 1000)
    started = time.monotonic()
    with _running("commit", str(mount.path), "run", "--expect-files", "2", "--timeout",
                  "30") as proc:
        time.sleep(2.0)
        assert proc.poll() is None, proc.communicate()
        assert s3.head("run/" + MANIFEST_NAME) is None  # not before the other node's file
        s3.put("run/rank1.pt", b"one" * 1000, {})
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert time.monotonic() - started >= 2.0
    doc = _manifest(s3, "run/")
    assert sorted(f["key"] for f in doc["files"]) == ["rank0.pt", "rank1.pt"]

    _write(mount.path / "run2" / "rank0.pt", b"zero")
    proc = cli("commit", str(mount.path), "run2", "--expect", "rank0.pt", "--expect",
               "rank9.pt", "--timeout", "2")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"lakefs-mount: commit of {mount.path}/run2 failed: timed out after 2 s while "
        f"waiting for the expected files (missing rank9.pt); no manifest was written")
    assert s3.head("run2/" + MANIFEST_NAME) is None
    proc = cli("commit", str(mount.path), "no-such-dir")
    assert proc.returncode == 1 and "nothing under no-such-dir/ in S3" in proc.stderr
    assert s3.head("no-such-dir/" + MANIFEST_NAME) is None


def _verify(*args: str) -> subprocess.CompletedProcess:
    return cli("verify", *args)


def _doc_reader(monkeypatch, endpoint_url: str):
    """The boto3-only reader snippet of docs/checkpoints.md, as printed there."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    block = next(b for b in doc.split("```python\n")[1:] if "def checkpoint_ok" in b)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint_url)
    scope: dict = {}
    exec(block.split("```")[0], scope)
    return scope["checkpoint_ok"]


def test_verify_accepts_a_good_checkpoint_and_names_each_problem(mount, s3, s3_server,
                                                                 monkeypatch):
    checkpoint_ok = _doc_reader(monkeypatch, s3_server.endpoint_url)
    data = {f"f{i}.bin": os.urandom(MiB + i) for i in range(4)}
    for rel, body in data.items():
        _write(mount.path / "ck" / rel, body)
    assert cli("commit", str(mount.path), str(mount.path / "ck")).returncode == 0
    s3_form = (f"s3://{mount.bucket}/ck", "--endpoint-url", s3_server.endpoint_url)
    for args in ((str(mount.path), "ck"), s3_form):
        proc = _verify(*args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith(f"OK s3://{mount.bucket}/ck/: 4 files")
    assert checkpoint_ok(mount.bucket, "ck/") is True

    s3.put("ck/f0.bin", os.urandom(MiB), {})  # altered behind the mount's back
    s3.delete("ck/f1.bin")
    s3.put("ck/extra.bin", b"extra", {})
    expected = ["etag: f0.bin:", "missing: f1.bin:", "extra: extra.bin:"]
    assert checkpoint_ok(mount.bucket, "ck/") is False
    for args in ((str(mount.path), "ck"), s3_form):
        proc = _verify(*args)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()  # one line per problem
        assert sorted(":".join(line.split(":")[:2]) + ":" for line in lines) == sorted(
            expected), lines
        assert "does not match its manifest: 3 problems" in proc.stderr
    proc = _verify(*s3_form, "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["ok"] is False
    assert sorted((p["kind"], p["key"]) for p in report["problems"]) == [
        ("etag", "f0.bin"), ("extra", "extra.bin"), ("missing", "f1.bin")]

    # one digit of the manifest changed (at rest: S3's CRC of it is the new one): its own
    # CRC-32C refuses it, rather than a wrong commit time or checksum read as right
    body = s3.get_range("ck/" + MANIFEST_NAME, 0, 1 << 20)
    at = body.index(b'"committed_at": ') + len(b'"committed_at": ') + 3
    flipped = body[:at] + str((int(body[at:at + 1]) + 1) % 10).encode() + body[at + 1:]
    s3.put("ck/" + MANIFEST_NAME, flipped, {})
    proc = _verify(*s3_form)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "its own CRC-32C does not match" in proc.stdout + proc.stderr

    # same size and ETag, other bytes: only the CRC32C can tell (a manifest of a release
    # before the manifest's own CRC-32C, edited here)
    doc = json.loads(body)
    del doc[SELF_CHECK]
    entry = next(f for f in doc["files"] if f["key"] == "f2.bin")
    entry["checksum"]["value"] = _crc(b"something else")
    s3.put("ck/" + MANIFEST_NAME, json.dumps(doc).encode(), {})
    proc = _verify(*s3_form)
    assert "checksum: f2.bin: manifest says CRC32C" in proc.stdout
    assert "f3.bin" not in proc.stdout

    _write(mount.path / "never" / "a.bin", b"a")
    assert mount.flush().returncode == 0
    for args in ((str(mount.path), "never"), (f"s3://{mount.bucket}/never", "--endpoint-url",
                                              s3_server.endpoint_url)):
        proc = _verify(*args)
        assert proc.returncode == 3, proc.stderr
        assert "no manifest" in proc.stderr and "never committed" in proc.stderr
    assert checkpoint_ok(mount.bucket, "never/") is False
    proc = _verify(str(mount.path), "ck", "--endpoint-url", s3_server.endpoint_url)
    assert proc.returncode == 2 and "s3://BUCKET/PREFIX only" in proc.stderr


def test_python_api_flushes_commits_and_reports_status(mount, s3, tmp_path):
    import lakefs_mount

    _write(mount.path / "api" / "w.bin", b"w" * 4096)
    lakefs_mount.flush(mount.path / "api")
    assert s3.head("api/w.bin").size == 4096
    result = lakefs_mount.commit(str(mount.path / "api"), expect_files=1, timeout=30)
    assert result["files"] == 1 and result["manifest"] == "api/" + MANIFEST_NAME
    assert lakefs_mount.verify(mount.path / "api")["ok"] is True
    s3.put("api/w.bin", b"changed behind the manifest's back", {})
    with pytest.raises(lakefs_mount.VerifyFailed, match="w.bin") as failed:
        lakefs_mount.verify(mount.path / "api")
    assert failed.value.report["ok"] is False and failed.value.report["problems"]
    (mount.path / "never").mkdir()
    with pytest.raises(lakefs_mount.VerifyFailed, match="no manifest"):
        lakefs_mount.verify(mount.path / "never")
    assert lakefs_mount.status(mount.path)["pid"] == mount.pid
    from lakefs_mount.api import locate

    assert locate(mount.path / ".hidden" / "x") == (mount.path, ".hidden/x")
    assert locate(mount.path) == (mount.path, "")
    with pytest.raises(lakefs_mount.NotALakefsMount, match="not on a lakefs-mount mount"):
        lakefs_mount.flush(tmp_path)
    with pytest.raises(lakefs_mount.LakefsMountError, match="timed out"):
        lakefs_mount.commit(mount.path / "api", expect_files=5, timeout=0.5)
    light = subprocess.run([sys.executable, "-c", "import sys, lakefs_mount; print(sorted("
                            "m for m in ('trio', 'boto3', 'click') if m in sys.modules))"],
                           capture_output=True, text=True, timeout=60)
    assert light.stdout.strip() == "[]", light.stderr


def test_a_commit_cut_by_kill_9_before_its_manifest_is_finished_by_the_next_mount(mount, s3):
    """D24: every data object is in S3, the manifest is not; the next mount writes it."""
    rank0, rank1 = os.urandom(2 * MiB + 5), os.urandom(MiB)
    _write(mount.path / "ck" / "rank0.pt", rank0)
    with _running("commit", str(mount.path), "ck", "--expect", "rank1.pt", "--timeout",
                  "120") as proc:
        assert wait_for(lambda: s3.head("ck/rank0.pt"), 30), "rank0.pt not in S3"
        time.sleep(0.5)  # the commit waits for rank1.pt now: every data object is in S3
        mount.kill9()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert s3.head("ck/" + MANIFEST_NAME) is None

    mount.start()  # the same cache directory: its journal holds the commit under way
    time.sleep(1.0)
    assert s3.head("ck/" + MANIFEST_NAME) is None  # still waiting for the other node
    s3.put("ck/rank1.pt", rank1, {})
    assert wait_for(lambda: s3.head("ck/" + MANIFEST_NAME), 20), "no manifest in S3"
    doc = _manifest(s3, "ck/")
    assert {f["key"]: f["checksum"]["value"] for f in doc["files"]} == {
        "rank0.pt": _crc(rank0), "rank1.pt": _crc(rank1)}
    assert "finishing the commit of /ck that the last mount began" in mount.log_tail(400)
    assert _verify(str(mount.path), "ck").returncode == 0


@pytest.mark.parametrize("delay", ["0", "600"], ids=["uploading-at-rename", "pending-at-rename"])
def test_commit_on_rename_publishes_the_tmp_dir_pattern_of_the_frameworks(mount_factory, s3,
                                                                           delay):
    """A saver writes tmp-checkpoint-N/ and renames it to checkpoint-N/ (Hugging Face,
    Megatron, DeepSpeed): the rename commits it; a rename to another name does not.
    The files may be in S3 already (moved by copies) or only in the cache (uploaded
    under the new name by the commit's flush)."""
    m = mount_factory("--commit-on-rename", "checkpoint-*", "--commit-delay", delay)
    shards = {f"model-{i}.safetensors": os.urandom(MiB + i) for i in range(3)}
    for rel, data in shards.items():
        _write(m.path / "tmp-checkpoint-7" / rel, data)
    _write(m.path / "tmp-other" / "x.bin", b"x")
    os.rename(m.path / "tmp-checkpoint-7", m.path / "checkpoint-7")
    os.rename(m.path / "tmp-other", m.path / "other")
    assert wait_for(lambda: s3.head("checkpoint-7/" + MANIFEST_NAME), 20), m.log_tail()
    doc = _manifest(s3, "checkpoint-7/")
    assert {f["key"]: f["checksum"]["value"] for f in doc["files"]} == {
        rel: _crc(data) for rel, data in shards.items()}
    assert s3.list_dir("tmp-checkpoint-7/").objects == []  # every object had moved
    assert m.flush().returncode == 0
    assert s3.head("other/x.bin") is not None and s3.head("other/" + MANIFEST_NAME) is None
    assert "committed /checkpoint-7 on its rename: 3 files" in m.log_tail(400)


def test_an_object_is_hashed_only_in_the_version_listed(s3):
    """The ranged GETs of a checksum ask for the listed ETag (If-Match): an object
    replaced while it is read fails as changed instead of mixing two versions."""
    import trio

    from lakefs_mount.metrics import Metrics
    from lakefs_mount.publish.objecthash import ObjectChanged, ObjectHasher
    from lakefs_mount.s3.aiostore import AsyncStore

    data = os.urandom(3 * MiB + 1)
    etag = s3.put("v.bin", data, {})
    hasher = ObjectHasher(AsyncStore(s3, Metrics()), parallel=4, range_bytes=MiB)
    assert encode_crc(trio.run(hasher.crc, "v.bin", len(data), etag)) == _crc(data)
    assert hasher.bytes_read == len(data)
    with pytest.raises(ObjectChanged, match="changed while it was read"):
        trio.run(hasher.crc, "v.bin", len(data), "0" * 32)
