"""Statistics, Markdown table and matplotlib plots of a benchmark results dict."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def point(values: list[float], unit: str, *, higher_is_better: bool = True,
          baseline: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values, "unit": unit, "higher_is_better": higher_is_better,
            "baseline": baseline, **extra}


def fill_ratios(points: dict[str, dict[str, Any]]) -> None:
    """ratio = median / baseline's median (for times: our time / baseline time); for a
    point with `paired` baseline values (one measured right before each of its runs), the
    median of the runs' own ratios."""
    for p in points.values():
        base = p.get("baseline")
        if base is None:
            p["ratio"] = None
            continue
        paired = p.get("paired")
        if paired and len(paired) == len(p["runs"]) and all(paired):
            p["ratio"] = statistics.median(v / b for v, b in zip(p["runs"], paired, strict=True))
            continue
        ref = points.get(base) if isinstance(base, str) else None
        ref_median = ref["median"] if ref else p.get("baseline_value")
        p["ratio"] = (p["median"] / ref_median) if ref_median else None


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    if abs(v) >= 0.01:
        return f"{v:.3f}"
    return f"{v:.2e}"


def size_name(cfg: dict[str, Any]) -> str:
    if cfg.get("quick"):
        return "quick"
    full = {"writers": 8, "file_mib": 512, "small_files": 10000, "read_files": 20000}
    return "full" if all(cfg.get(k, v) == v for k, v in full.items()) else "reduced"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    m = meta["machine"]
    cfg = meta["config"]
    lines = [
        f"Run {meta['date']} on `{m['hostname']}`: {m['nproc']} CPUs ({m['cpu']}), "
        f"{m['mem_gib']:.0f} GiB RAM, kernel {m['kernel']}; "
        f"{size_name(cfg)} size: {cfg['writers']} writers x "
        f"{cfg['file_mib']} MiB, {cfg['small_files']} small files of {cfg['small_kib']} KiB, "
        + (f"{cfg['read_files']} small-file reads of {cfg.get('read_kib', 100)} KiB, "
           if cfg.get("read_files") else "") +
        f"{cfg['runs']} run(s) per point (median [min-max]). "
        f"Total wall time {meta.get('elapsed_s', 0):.0f} s.",
        "",
        "| Workload | Point | Median | Min | Max | Unit | Ratio | Ratio to |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for w in results["workloads"].values():
        if w.get("error"):
            lines.append(f"| {w['title']} | **crashed**: {w['error'][:120]} | | | | | | |")
            continue
        for pname, p in w["points"].items():
            base = p.get("baseline")
            ratio_to = p.get("baseline_label") or (
                w["points"][base]["label"] if isinstance(base, str) and base in w["points"]
                else "-")
            lines.append(
                f"| {w['title']} | {p.get('label', pname)} | {_fmt(p['median'])} | "
                f"{_fmt(p['min'])} | {_fmt(p['max'])} | {p['unit']} | "
                f"{_fmt(p.get('ratio'))} | {ratio_to} |")
    errs = [f"{w['title']}: {k}: {e}" for w in results["workloads"].values()
            for k, e in (w.get("errors") or {}).items()]
    if errs:
        lines += ["", "Errors (points missing above):", ""] + [f"- {e[:300]}" for e in errs]
    if results.get("anomalies"):
        lines += ["", "Anomalies:", ""] + [f"- {a}" for a in results["anomalies"]]
    if results.get("fatal"):
        lines += ["", f"Fatal: {results['fatal']}"]
    lines += ["", "Goals (informative):", ""]
    for g in results.get("goals", []):
        lines.append(f"- {'PASS' if g['pass'] else 'FAIL'} {g['text']}")
    peers = meta.get("peers", {})
    if peers:
        lines += ["", "Peers: " + "; ".join(f"{k}: {v}" for k, v in peers.items())]
    if meta.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in meta["notes"]]
    chk = results.get("checksums", {})
    lines += ["", f"Checksums: {chk.get('checked', 0)} files/objects verified, "
              f"{len(chk.get('mismatches', []))} mismatches."]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for wname, w in results["workloads"].items():
        if w.get("error") or not w.get("points"):
            continue
        groups: dict[str, list[tuple[str, dict]]] = {}
        for pname, p in w["points"].items():
            groups.setdefault(p["unit"], []).append((p.get("label", pname), p))
        fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2),
                                 squeeze=False)
        for ax, (unit, pts) in zip(axes[0], groups.items(), strict=True):
            labels = [lbl for lbl, _ in pts]
            med = [p["median"] for _, p in pts]
            lo = [p["median"] - p["min"] for _, p in pts]
            hi = [p["max"] - p["median"] for _, p in pts]
            colors = ["#4c72b0" if "lakefs" in lbl else "#999999" if "raw" in lbl
                      or "ideal" in lbl else "#dd8452" for lbl in labels]
            ax.bar(range(len(pts)), med, yerr=[lo, hi], capsize=4, color=colors)
            ax.set_xticks(range(len(pts)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(unit)
            for i, (_, p) in enumerate(pts):
                if p.get("ratio") is not None:
                    ax.annotate(f"{p['ratio']:.2f}x", (i, p["median"]), ha="center",
                                va="bottom", fontsize=7, xytext=(0, 2),
                                textcoords="offset points")
        fig.suptitle(f"{w['title']} (median, min-max; ratio to baseline)", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{wname}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
