"""Measured results of the fault scenarios, and docs/reliability.md rendered from them.

The fault tests hand one row per scenario to the `reliability` fixture (conftest.py);
a run with `--write-reliability[=PATH]` (`bash packaging/test.sh --write-reliability`)
merges every row recorded into docs/reliability.md (or PATH) at the end of the session;
other runs leave the document alone. The rows are kept as JSON lines in a comment at the
end of the document: a run of some tests replaces the rows of the tests it ran (also
those that recorded nothing this time: a scenario that failed before measuring is not
shown with an old result) and keeps the others.

    python tests/reliability.py docs/reliability.md   # re-render without running tests
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
_ROWS_BEGIN = "<!-- rows (JSON lines, read back by tests/reliability.py)"
_ROWS_END = "-->"


COVERED_WITHOUT_A_ROW = [
    "Issue 29's other faults and bad input are tested without a measured row: kill -9 with",
    "S3 down and a resumed multipart upload (`faults/test_durability.py`), each 503 counted in",
    "`status` and the log (`ops/test_mount_errors.py`), black-holed requests and listings",
    "(`faults/test_s3_black_hole.py`), namespace changes through an outage and kill -9",
    "(`mount/test_namespace_writeback.py`), an interrupted warm-up that stops fetching",
    "(`mount/test_warmup.py`), wrong credentials, a missing bucket, an unreachable endpoint,",
    "invalid sources, bad mount points and cache directories, a mount point held by a live",
    "daemon (`ops/test_mount_errors.py`, `ops/test_cli_errors.py`, `ops/test_mountpoint.py`),",
    "names too long, files over 5 TiB (EFBIG), hard links (`mount/test_posix.py`), xattrs",
    "(`mount/test_semantics_doc.py`), and other users with `--allow-other`",
    "(`mount/test_permissions.py`).",
]


@dataclass
class Row:
    """One scenario as measured: what was done to the mount and what came out of it.
    `acknowledged` counts files the application was told were written (fsync or close
    returned); `lost` of them are missing from S3 after the final flush, `corrupt` differ
    from what was written. Times are seconds; `healthy_s` is the same work without the
    fault, where that comparison means something."""

    scenario: str
    injects: str
    acknowledged: int
    lost: int
    corrupt: int
    seconds: float
    healthy_s: float | None = None
    notes: str = ""
    test: str = ""
    machine: dict[str, str] = field(default_factory=dict)
    at: str = ""
    commit: str = ""


def machine() -> dict[str, str]:
    """What the numbers depend on: kernel, CPU and cores (no host name)."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"kernel": platform.release(), "cpu": cpu, "cores": str(os.cpu_count()),
            "python": platform.python_version()}


def stamp(row: Row) -> Row:
    """Fill in where and when `row` was measured."""
    row.machine = row.machine or machine()
    row.at = row.at or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    row.commit = row.commit or commit_of(Path(__file__).parent)
    return row


def merge(old: list[Row], new: list[Row], ran: set[str]) -> list[Row]:
    """The rows of `new`, and those of `old` whose test did not run (`ran`: node ids);
    one row per scenario, the fault tests (tests/faults/) first, then by test file, then
    as recorded."""
    kept = [r for r in old if r.test not in ran and r.scenario not in {n.scenario for n in new}]
    order = {test: i for i, test in enumerate(dict.fromkeys(r.test for r in kept + new))}

    def place(row: Row) -> tuple[bool, str, int]:
        file = row.test.split("::")[0]
        return (not file.startswith("tests/faults/"), file, order[row.test])

    rows = sorted(kept + new, key=place)
    latest: dict[str, Row] = {}
    for row in rows:
        latest[row.scenario] = row
    return list(latest.values())


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[Row]) -> str:
    """docs/reliability.md: one table row per scenario, then the rows as JSON lines."""
    if not rows:
        raise ValueError("no results to render")
    machines = sorted({f"{m.get('cores')}-core {m.get('cpu')}, Linux {m.get('kernel')}, "
                       f"Python {m.get('python')}" for m in (r.machine for r in rows)})
    dates = sorted({r.at[:10] for r in rows})
    commits = sorted({r.commit for r in rows if r.commit}) or ["unknown"]
    out = [
        "# Reliability: measured under injected faults",
        "",
        "<!-- generated by tests/reliability.py at the end of a test run; do not edit -->",
        "",
        "What the fault tests did to a real mount (real FUSE, real SeaweedFS, faults through",
        "`tests/faultproxy.py`, `kill -9`, signals, a small tmpfs as the cache disk) and what",
        "came out of it. A file counts as *acknowledged* once the application's `fsync()` or",
        "`close()` returned (a daemon crash keeps both, see [durability.md](durability.md));",
        "*lost* means missing from S3 after the final `lakefs-mount flush` (or, where the",
        "scenario says so, neither in S3 nor kept in the cache's `orphans/`), *corrupt* means",
        "S3 holds other bytes. Times are wall-clock seconds of the scenario; *healthy* is the",
        "same work without the fault where that comparison means something. Each row names",
        "the test that measured it (under `tests/`); every one of them asserts that nothing",
        "was lost or corrupt.",
        "",
        f"Measured on {', '.join(dates)} ({'; '.join(machines)}), "
        f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}"
        + (" ('+': with changes not committed yet)." if any(c.endswith("+") for c in commits)
           else "."),
        "",
        "| Scenario | Injects | Acknowledged | Lost | Corrupt | Time (s) | Healthy (s) | Notes "
        "| Test |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        test = r.test.removeprefix("tests/")
        out.append(f"| {_cell(r.scenario)} | {_cell(r.injects)} | {r.acknowledged} | "
                   f"{r.lost} | {r.corrupt} | {_seconds(r.seconds)} | "
                   f"{_seconds(r.healthy_s)} | {_cell(r.notes)} | `{_cell(test)}` |")
    out += [
        "",
        *COVERED_WITHOUT_A_ROW,
        "",
        "A test run with --write-reliability rewrites the rows of the tests it ran (root "
        "and /dev/fuse needed):",
        "",
        "```sh",
        "sudo bash packaging/test.sh --write-reliability tests/faults   # or the whole suite",
        "```",
        "",
        _ROWS_BEGIN,
        # "-->" would end the comment: escaped, the JSON still reads the same
        *(json.dumps(asdict(r), ensure_ascii=False).replace("-->", "--\\u003e")
          for r in rows),
        _ROWS_END,
        "",
    ]
    return "\n".join(out)


def read_rows(doc: Path) -> list[Row]:
    """The rows a rendered document carries; none if it is missing or has none."""
    try:
        text = doc.read_text()
    except FileNotFoundError:
        return []
    _, begin, rest = text.partition(_ROWS_BEGIN)
    if not begin:
        return []
    block = rest.partition(_ROWS_END)[0]
    return [Row(**json.loads(line)) for line in block.splitlines() if line.strip()]


def commit_of(repo: Path) -> str:
    """The checkout's short commit, with '+' when it has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=repo).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
               if not line.endswith("docs/reliability.md")]
    return head + ("+" if changed else "")


def update(doc: Path, new: list[Row], ran: set[str]) -> None:
    """Merge this run's rows into `doc` and write it (atomically)."""
    rows = merge(read_rows(doc), new, ran)
    if not rows:
        return
    text = render(rows)
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(doc)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/reliability.py docs/reliability.md", file=sys.stderr)
        return 2
    update(Path(argv[0]), [], set())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
