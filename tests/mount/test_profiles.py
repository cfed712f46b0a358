"""The mount over S3 as users have it: https with a CA of the run's own, a round trip on
every request and a bandwidth per direction (the `region` and `wan` profiles of
benchmarks/profiles.py, each in front of its own SeaweedFS)."""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from benchmarks.profiles import Served
from benchmarks.tlsca import make_ca
from tests.mounting import Mount, cli

MiB = 1 << 20
pytestmark = pytest.mark.parametrize("served", ["region", "wan"], indirect=True)


@pytest.fixture
def served_env(served: Served, monkeypatch: pytest.MonkeyPatch) -> Served:
    """This test's CLI and daemons reach the served endpoint: its CA, its keys."""
    for name, value in served.client_env().items():
        monkeypatch.setenv(name, value)
    return served


@pytest.fixture
def served_bucket(served: Served) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:16]}"
    served.server.create_bucket(name)
    yield name


@pytest.fixture
def served_mounts(served_env: Served, served_bucket: str, tmp_path: Path) -> Iterator[list]:
    made: list[Mount] = []
    yield made
    for m in made:
        m.cleanup()


def _mount(made: list[Mount], served: Served, bucket: str, root: Path) -> Mount:
    m = Mount(root, bucket, served.endpoint_url, options=("--part-size", "8M"))
    made.append(m)
    m.start()
    return m


def _client(served: Served):  # boto3's own client, trusting the served CA
    env = served.client_env()
    return boto3.client("s3", endpoint_url=served.endpoint_url, region_name="us-east-1",
                        verify=env["AWS_CA_BUNDLE"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


def test_each_request_pays_the_round_trip_and_bytes_the_bandwidth(served: Served,
                                                                   served_bucket: str):
    """The profile is what it says: a HEAD on a warm connection takes at least the round
    trip, and a GET of 16 MiB at least its bytes over the bandwidth."""
    client = _client(served)
    body = os.urandom(16 * MiB)
    client.put_object(Bucket=served_bucket, Key="blob", Body=body)
    heads = []
    for _ in range(5):
        started = time.perf_counter()
        client.head_object(Bucket=served_bucket, Key="blob")
        heads.append(time.perf_counter() - started)
    assert statistics.median(heads) >= served.profile.rtt_s, heads
    started = time.perf_counter()
    assert client.get_object(Bucket=served_bucket, Key="blob")["Body"].read() == body
    took = time.perf_counter() - started
    assert served.profile.bits_per_s is not None
    assert took >= len(body) * 8 / served.profile.bits_per_s, took


def test_a_mount_over_https_writes_flushes_commits_verifies_and_reads_back_cold(
        served_env: Served, served_bucket: str, served_mounts: list[Mount], tmp_path: Path):
    """Small files and a multipart upload travel over TLS through the link; the commit's
    manifest verifies from S3; a new mount with an empty cache reads every byte back."""
    m = _mount(served_mounts, served_env, served_bucket, tmp_path / "a")
    ckpt = m.path / "ckpt"
    ckpt.mkdir()
    files = {"model.bin": os.urandom(20 * MiB + 3), "config.json": b'{"step": 7}'}
    files |= {f"shard-{i}.pt": os.urandom(70_000 + i) for i in range(8)}
    for name, body in files.items():
        (ckpt / f"{name}.tmp").write_bytes(body)
        os.rename(ckpt / f"{name}.tmp", ckpt / name)
    assert m.flush().returncode == 0, m.log_tail()
    assert cli("commit", str(m.path), "ckpt").returncode == 0, m.log_tail()
    proc = cli("verify", "--json", f"s3://{served_bucket}/ckpt/",
               "--endpoint-url", served_env.endpoint_url)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["files"] == len(files), (report, proc.stderr)
    assert m.unmount().returncode == 0, m.log_tail()

    cold = _mount(served_mounts, served_env, served_bucket, tmp_path / "b")
    assert set(os.listdir(cold.path / "ckpt")) == {*files, ".lakefs-commit.json"}
    for name, body in files.items():
        assert (cold.path / "ckpt" / name).read_bytes() == body, name


@pytest.mark.parametrize("trust", ["none", "another CA"])
def test_a_certificate_the_mount_does_not_trust_fails_it_in_one_line(
        served_env: Served, served_bucket: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, trust: str):
    """Without the CA, or with another one, the mount refuses in one line that names
    AWS_CA_BUNDLE, within seconds, and leaves nothing mounted."""
    if trust == "none":
        monkeypatch.delenv("AWS_CA_BUNDLE")
        monkeypatch.delenv("SSL_CERT_FILE")
    else:
        other = make_ca(tmp_path / "other-ca").ca
        monkeypatch.setenv("AWS_CA_BUNDLE", str(other))
    m = Mount(tmp_path / "m", served_bucket, served_env.endpoint_url)
    started = time.monotonic()
    proc = cli("mount", m.source, str(m.path), "--endpoint-url", m.endpoint_url,
               "--cache-dir", str(m.cache_dir), "--log-file", str(m.log_file))
    took = time.monotonic() - started
    try:
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "AWS_CA_BUNDLE" in lines[0], proc.stderr
        assert took < 15, took
        assert not os.path.ismount(m.path)
    finally:
        m.cleanup()
