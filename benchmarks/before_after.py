"""Pairs runs of the suite (`python -m benchmarks run`) on two versions of the code, made
alternately on one machine: each round is one run of each. Prints, per lakefs-mount point,
the median over the rounds of after / before within the round (the rates of this VM drift
between rounds, rarely within one), and the same for the point's ratio to its baseline of
its own run (which takes out what moved the baseline too).

    python -m benchmarks.before_after BEFORE_1 AFTER_1 BEFORE_2 AFTER_2 ...

Each argument is a results directory (or its results.json), given as pairs BEFORE AFTER
of one round each, whichever of the two ran first in that round.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _load(arg: str) -> dict[str, Any]:
    path = Path(arg)
    return json.loads((path / "results.json" if path.is_dir() else path).read_text())


def _points(results: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(w, name): p for w, workload in results["workloads"].items()
            for name, p in workload.get("points", {}).items() if name.startswith("lakefs")}


def _median_of(pairs: list[tuple[float | None, float | None]]) -> float | None:
    quotients = [a / b for b, a in pairs if a is not None and b]
    return statistics.median(quotients) if quotients else None


def table(rounds: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    before = [_points(b) for b, _ in rounds]
    after = [_points(a) for _, a in rounds]
    rows = ["| Workload | Point | Unit | before (median) | after (median) | after / before "
            "| in-run ratio, after / before |", "|---|---|---|---:|---:|---:|---:|"]
    for key, first in before[0].items():
        if not all(key in b and key in a for b, a in zip(before, after, strict=True)):
            continue
        values = [(b[key]["median"], a[key]["median"]) for b, a in zip(before, after, strict=True)]
        ratios = [(b[key].get("ratio"), a[key].get("ratio"))
                  for b, a in zip(before, after, strict=True)]
        change, ratio_change = _median_of(values), _median_of(ratios)
        better = "higher" if first.get("higher_is_better", True) else "lower"
        title = rounds[0][0]["workloads"][key[0]]["title"]
        rows.append(
            f"| {title} | {first['label']} | {first['unit']} ({better} is better) "
            f"| {statistics.median(v for v, _ in values):.4g} "
            f"| {statistics.median(v for _, v in values):.4g} "
            f"| {'-' if change is None else f'{change:.3f}'} "
            f"| {'-' if ratio_change is None else f'{ratio_change:.3f}'} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [_load(arg) for arg in argv]
    print(table(list(zip(runs[0::2], runs[1::2], strict=True))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
