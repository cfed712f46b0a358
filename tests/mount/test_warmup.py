"""`lakefs-mount warmup`: a checkpoint fetched into the cache ahead of its restore, through a
real mount over SeaweedFS; the restore that follows sends no GET."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time

from tests.mounting import CLI, cli

MiB = 1024 * 1024
PART = 8 * MiB


def _checkpoint(s3) -> dict[str, bytes]:
    """Objects made by another tool (boto3): a multi-chunk file, a nested one, an empty
    one, a small one; and one outside the checkpoint."""
    bodies = {
        "ckpt/model.bin": random.randbytes(3 * PART + 5),
        "ckpt/optim/shard0.bin": random.randbytes(PART + 1),
        "ckpt/optim/empty": b"",
        "ckpt/meta.json": b'{"step": 100}',
        "other/data.bin": random.randbytes(MiB),
    }
    for key, body in bodies.items():
        s3.put(key, body, {})
    return bodies


def _gets(m) -> int:
    return m.counters().get("gets", 0)


def test_a_warmed_up_checkpoint_restores_without_a_get(mount_factory, s3):
    bodies = _checkpoint(s3)
    m = mount_factory("--part-size", "8M")
    done = cli("warmup", str(m.path), "ckpt")
    assert done.returncode == 0, done.stderr
    assert "4 files" in done.stderr and "fetched from S3" in done.stderr
    size, fetched = re.search(r"4 files, (.+?) \((.+?) fetched from S3\)", done.stderr).groups()
    assert fetched == size  # nothing was cached: every byte came (readahead's GETs too)
    assert _gets(m) >= 4 + 2  # chunks of model.bin and shard0.bin, the small ones
    before = _gets(m)
    for key, body in bodies.items():
        if key.startswith("ckpt/"):
            assert (m.path / key).read_bytes() == body
    assert _gets(m) == before
    assert (m.path / "other/data.bin").read_bytes() == bodies["other/data.bin"]
    assert _gets(m) > before  # outside PATH: not warmed


def test_a_warm_up_survives_a_remount_and_a_second_one_fetches_nothing(mount_factory, s3):
    bodies = _checkpoint(s3)
    m = mount_factory("--part-size", "8M")
    one = cli("warmup", str(m.path), str(m.path / "ckpt" / "model.bin"))  # absolute PATH
    assert one.returncode == 0 and "1 file," in one.stderr, one.stderr
    assert m.unmount().returncode == 0
    m.start()
    again = cli("warmup", str(m.path))  # the whole mount
    assert again.returncode == 0, again.stderr
    assert "5 files" in again.stderr
    fetched = _gets(m)
    assert 0 < fetched < 4 + 2  # model.bin's chunks came from the cache a mount left
    for key, body in bodies.items():
        assert (m.path / key).read_bytes() == body
    assert _gets(m) == fetched


def test_a_path_larger_than_the_cache_is_refused_before_any_get(mount_factory, s3):
    for i in range(3):
        s3.put(f"big/{i}.bin", random.randbytes(PART), {})
    m = mount_factory("--part-size", "8M", "--cache-size", "16M", "--max-dirty", "16M")
    done = cli("warmup", str(m.path), "big")
    assert done.returncode == 1
    assert "do not fit in the cache" in done.stderr and "24 MiB" in done.stderr
    assert _gets(m) == 0


def test_a_missing_path_is_a_clear_error(mount_factory, s3):
    m = mount_factory()
    done = cli("warmup", str(m.path), "no/such/step")
    assert done.returncode == 1
    assert "no such file or directory" in done.stderr


def test_files_with_local_changes_are_skipped_as_already_here(mount_factory, s3):
    m = mount_factory("--part-size", "8M", "--commit-delay", "60")
    (m.path / "new.bin").write_bytes(random.randbytes(2 * MiB))
    done = cli("warmup", str(m.path))
    assert done.returncode == 0, done.stderr
    assert "0 files" in done.stderr and "1 file with changes not yet in S3 skipped" in done.stderr
    assert _gets(m) == 0


def test_an_s3_outage_fails_the_warm_up_and_a_retry_completes_it(mount_factory, s3,
                                                                 fault_proxy):
    bodies = _checkpoint(s3)
    m = mount_factory("--part-size", "8M", "--metadata-ttl", "600",
                      endpoint_url=fault_proxy.endpoint_url)
    for key in bodies:  # listed and known: the outage hits the GETs of the chunks
        assert (m.path / key).stat().st_size == len(bodies[key])
    fault_proxy.fail = True
    failed = cli("warmup", str(m.path), "ckpt")
    assert failed.returncode == 1
    assert "warm-up of" in failed.stderr and "unreachable" in failed.stderr
    assert "what was fetched stays cached" in failed.stderr
    fault_proxy.fail = False
    done = cli("warmup", str(m.path), "ckpt")
    assert done.returncode == 0, done.stderr
    before = _gets(m)
    for key, body in bodies.items():
        if key.startswith("ckpt/"):
            assert (m.path / key).read_bytes() == body
    assert _gets(m) == before


def test_an_interrupted_warm_up_stops_fetching_and_keeps_what_came(mount_factory, s3,
                                                                  fault_proxy):
    """The first 16 chunks (one GET each, 8 s at 1 MiB/s) have come when the warm-up is
    interrupted during the next 8: those are kept, the others stop; a second warm-up
    fetches only what did not come whole."""
    bodies = {f"slow/{i}.bin": random.randbytes(PART) for i in range(24)}  # a chunk each
    for key, body in bodies.items():
        s3.put(key, body, {})
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.bandwidth_bytes_per_s = MiB  # per connection: 8 s per GET
    proc = subprocess.Popen([CLI, "warmup", str(m.path), "slow"], stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(11)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) != 0
    gets, deadline = -1, time.monotonic() + 30
    while gets != (gets := _gets(m)) and time.monotonic() < deadline:
        time.sleep(2)  # the GETs under way stop; no new one starts
    assert 0 < gets <= len(bodies)
    fault_proxy.bandwidth_bytes_per_s = 0
    done = cli("warmup", str(m.path), "slow")
    assert done.returncode == 0, done.stderr
    refetched = _gets(m) - gets
    assert 0 < refetched < len(bodies)  # what came whole before the interrupt was kept
    before = _gets(m)
    for key, body in bodies.items():
        assert (m.path / key).read_bytes() == body
    assert _gets(m) == before


def test_a_killed_warm_up_stops_its_gets_mid_way(mount_factory, s3, fault_proxy):
    """Issue 29 defect 7: the daemon notices at once that the CLI is gone (EOF on the
    control socket), and the GETs under way stop at their next piece instead of running
    to the end of their chunks: a single large file no longer arrives whole."""
    body = random.randbytes(12 * PART)
    s3.put("big/model.bin", body, {})
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.bandwidth_bytes_per_s = MiB // 2  # per connection: 16 s per chunk
    proc = subprocess.Popen([CLI, "warmup", str(m.path), "big"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)
    proc.kill()
    proc.wait(timeout=10)
    used, deadline = -1, time.monotonic() + 30
    while used != (used := m.status()["cache_used"]) and time.monotonic() < deadline:
        time.sleep(3)  # each GET writes at most one more piece, then gives up
    assert used < len(body) // 2, used
    assert "the client went away" in m.log_tail(200)
    fault_proxy.bandwidth_bytes_per_s = 0
    assert cli("warmup", str(m.path), "big").returncode == 0  # the rest, fetched again
    assert (m.path / "big" / "model.bin").read_bytes() == body
