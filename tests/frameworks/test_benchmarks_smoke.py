"""The benchmark suite runs end to end at a tiny size and reports every workload.

`python -m benchmarks run --quick` in a subprocess (peers skipped, a few MiB per writer so
it finishes in well under 3 minutes); the results JSON must hold every workload with
numeric medians/min/max/ratios and matched checksums.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.report import fill_ratios, point
from lakefs_mount.fuse.splice import PIPE_MAX_SIZE, writes_can_splice

# the benchmarks set fs.pipe-max-size and /dev/fuse's ACL: one at a time (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("machine")

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("checkpoint_write", "time_to_durable", "restore", "small_files", "resources")


@pytest.mark.timeout(400)
def test_benchmark_suite_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    pipe_max_size = PIPE_MAX_SIZE.read_text()
    tuned = not writes_can_splice()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--quick", "--peers", "none",
         "--file-mib", "8", "--small-files", "200", "--runs", "1",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    log = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    results = json.loads((out / "results.json").read_text())
    assert results["checksums"]["ok"], log
    assert results["checksums"]["checked"] > 0
    assert not results["checksums"]["mismatches"], log
    for name in WORKLOADS:
        w = results["workloads"].get(name)
        assert w is not None, f"workload {name} missing\n{log}"
        assert not w.get("error"), f"{name}: {w.get('error')}\n{log}"
        assert not w.get("errors"), f"{name}: {w.get('errors')}\n{log}"
        assert w["points"], name
        for pname, p in w["points"].items():
            for field in ("median", "min", "max"):
                assert isinstance(p[field], (int, float)) and math.isfinite(p[field]), \
                    (name, pname, field, p)
            assert p["min"] <= p["median"] <= p["max"]
            if p.get("baseline") is not None:
                assert isinstance(p["ratio"], float) and p["ratio"] > 0, (name, pname, p)
    pts = results["workloads"]
    assert {"lakefs_uring", "lakefs_threads", "lakefs_pyfuse3", "raw_disk"} <= set(
        pts["checkpoint_write"]["points"])
    # durable against the ideal, and against what a job does without a mount on these cores
    assert {"ideal", "raw_then", "raw_during"} <= set(pts["time_to_durable"]["points"])
    assert {"lakefs_uring_cold", "lakefs_uring_warm", "lakefs_uring_warmup", "raw_get"} <= set(
        pts["restore"]["points"])
    for phase in ("cold", "warm"):  # each compared with a baseline run just before it
        p = pts["restore"]["points"][f"lakefs_uring_{phase}"]
        assert len(p["paired"]) == len(p["runs"]) and all(b > 0 for b in p["paired"]), p
        assert p["ratio"] == pytest.approx(p["runs"][0] / p["paired"][0]), p
    assert results["goals"], log
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout, log
    assert (out / "results.md").is_file()
    assert list(out.glob("*.png")), "no plots written"
    assert proc.returncode == 0, log
    # the README's tuning (spliced write requests) held for the run only, and is reported
    assert PIPE_MAX_SIZE.read_text() == pipe_max_size
    assert any("fs.pipe-max-size" in note for note in results["meta"]["notes"]) == tuned, log


def test_a_paired_ratio_is_the_median_of_each_run_over_its_own_baseline() -> None:
    """The disk slowed from ~1.9 to ~1 GiB/s between the baseline's runs at the start
    and the mount's reads: paired, the mount read at 0.9 of the disk's rate of the moment;
    against the early runs it would look like 0.47."""
    points = {"raw": point([2.0, 1.8, 1.9], "GiB/s"),
              "mount": point([0.9, 0.855, 0.945], "GiB/s", baseline="raw",
                             paired=[1.0, 0.95, 1.05]),
              "unpaired": point([0.9], "GiB/s", baseline="raw")}
    fill_ratios(points)
    assert points["mount"]["ratio"] == pytest.approx(0.9)
    assert points["unpaired"]["ratio"] == pytest.approx(0.9 / 1.9)
    assert points["raw"]["ratio"] is None


def test_cache_disk_benchmark_reports_the_mixed_rate_and_leaves_nothing(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/cache_disk.py", "--dir", str(tmp_path),
                           "--per-file-mib", "4", "--runs", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rates = {line.split()[0]: float(re.findall(r"([\d.]+) GiB/s", line)[0])
             for line in proc.stdout.splitlines() if line.startswith("  ") and "=>" not in line}
    assert set(rates) == {"writes", "reads", "both"}, proc.stdout
    assert all(rate > 0 for rate in rates.values()), proc.stdout
    assert "tops out near" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(150)
def test_checkpoint_benchmark_quick_loads_back_every_checkpoint_it_saved(
        tmp_path: Path) -> None:
    """`python -m benchmarks checkpoint --quick --profile region` (32 MiB per rank, the
    native session, https with a round trip): every save and restore of every workload
    and system has its figure, and every checkpoint read back equals the state saved; the
    figures themselves are not judged."""
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "checkpoint", "--quick", "--mib", "32",
         "--sessions", "native", "--profile", "region", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    log = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0 and results["ok"], log
    assert not results["errors"] and not results["fatal"], log
    assert results["meta"]["profile"].startswith("region (https"), results["meta"]
    systems = {"local", "native"} | ({"s3tc"} if any(
        "s3torchconnector " in n for n in results["meta"]["notes"]) else set())
    saves = ("torch_save_1", "torch_save_4", "safetensors_save_1", "dcp_save_1", "dcp_save_4")
    restores = ("torch_load_cold", "safetensors_load_cold", "dcp_load_cold", "dcp_load_4_cold")
    for name in (*saves, *restores):
        assert set(results["workloads"][name]["rounds"]) == systems, (name, log)
    # 1-rank checkpoints: 3 formats x every system, read back cold, and torch.load warm
    # and mmap on the mount; 4-rank ones: 4 ranks x 2 formats x every system
    assert results["checked"] == 3 * len(systems) + 3 + 8 * len(systems), results["checked"]
    for p in results["workloads"]["torch_save_4"]["points"].values():
        assert p["min"] <= p["median"] <= p["max"], p
    assert "| torch.save, 1 rank: stall, x local |" in (out / "results.md").read_text()
    assert not (tmp_path / "work").exists()


@pytest.mark.timeout(400)
def test_outage_benchmark_quick(tmp_path: Path) -> None:
    """`python -m benchmarks outage` at a tiny size: both phases run, the bucket ends as
    the mount shows it, and every step's stall is reported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "outage", "--rounds", "1", "--steps", "2",
         "--mib", "4", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((tmp_path / "results.json").read_text())
    (only,) = results["rounds"]
    assert only["bucket_matches_mount"]
    assert {len(v) for v in only["seconds"].values()} == {2}
    assert set(only["seconds"]) == {"healthy", "black-hole"}
    assert math.isfinite(results["median_ratio"]) and results["median_ratio"] > 0


@pytest.mark.timeout(240)
def test_soak_benchmark_quick_loses_nothing(tmp_path: Path) -> None:
    """`python -m benchmarks soak --quick`: 4 small steps with a kill -9 of the daemon
    and its restart, a short S3 black hole and a full cache disk; no checkpoint lost or
    corrupt, no multipart upload left, the bucket holding the steps kept; nothing of the
    run left behind (mounts, the loop-mounted cache disk, the scratch dir)."""
    out, work = tmp_path / "results", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "soak", "--quick", "--out", str(out),
         "--workdir", str(work)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=220)
    log = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 4, log
    assert results["lost"] == 0 and not results["lost_detail"], log
    assert not results["corrupt"] and results["restores"] >= 1, log
    assert results["final"]["mpu_incomplete"] == 0, log
    assert results["final"]["stray_prefixes"] == [] and results["final"]["verified"], log
    kinds = [e["kind"] for e in results["events"]]
    assert {"kill -9", "daemon died", "restarted", "outage", "outage over"} <= set(kinds), \
        kinds
    assert "UNEXPECTEDLY" not in json.dumps(results["events"]), results["events"]
    if os.geteuid() == 0:
        assert "cache disk filled" in kinds, kinds
    rows = (out / "steps.csv").read_text().splitlines()
    assert len(rows) == 5 and "kill -9" in rows[2], rows
    assert "| 0 lost checkpoints | PASS |" in (out / "results.md").read_text()
    assert (out / "soak.png").is_file()
    assert proc.returncode == 0, log
    assert not work.exists()
    assert str(work) not in Path("/proc/self/mountinfo").read_text()
