"""Points, goals, the headline table and plots of the checkpoint benchmark's rounds."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from benchmarks import report

LABELS = {"local": "local disk", "native": "lakefs-mount (native)",
          "pyfuse3": "lakefs-mount (pyfuse3)", "s3tc": "s3torchconnector",
          "juicefs": "JuiceFS (writeback)", "rclone": "rclone mount (vfs full)",
          "raw": "raw boto3 upload"}
TITLES = {
    "torch_save_1": "torch.save, 1 rank", "torch_save_4": "torch.save, 4 ranks at once",
    "safetensors_save_1": "safetensors save_file", "dcp_save_1": "DCP save, world size 1",
    "dcp_save_4": "DCP save, world size 4 (gloo)",
    "torch_load_cold": "torch.load cold", "safetensors_load_cold": "safetensors safe_open cold",
    "dcp_load_cold": "DCP load cold", "torch_load_warm": "torch.load warm",
    "dcp_load_4_cold": "DCP load cold, world size 4 (4 ranks at once)",
    "torch_load_mmap": "torch.load(mmap=True)",
}
# restore -> (workload, system) whose restore_s of the same round is its ratio's baseline
RESTORE_BASE = {"torch_load_cold": (None, "s3tc"), "safetensors_load_cold": (None, "s3tc"),
                "dcp_load_cold": (None, "s3tc"), "dcp_load_4_cold": (None, "s3tc"),
                "torch_load_warm": ("torch_load_cold", "local"),
                "torch_load_mmap": (None, "local")}
STALL_GOAL, DURABLE_GOAL, RESTORE_GOAL = 1.1, 1.05, 0.9
STALL_GOAL_WORKLOADS = ("torch_save_1", "torch_save_4", "dcp_save_1", "dcp_save_4")

Rows = dict[str, dict[str, list[dict[str, float] | None]]]


def _values(runs: list[dict[str, float] | None], key: str) -> list[float | None]:
    return [(row or {}).get(key) for row in runs]


def _point(values: list[float | None], label: str, unit: str = "s",
           base: list[float | None] | None = None, base_label: str = "") -> dict | None:
    """A point of the rounds that have a value (and a baseline value, when paired)."""
    base = base if base is not None else [None] * len(values)
    pairs = [(v, b) for v, b in zip(values, base + [None] * len(values), strict=False)
             if v is not None and (b is not None or base_label == "")]
    if not pairs:
        return None
    extra: dict[str, Any] = {"label": label}
    if base_label:
        extra.update(baseline=base_label, baseline_label=base_label,
                     paired=[b for _, b in pairs])
    return report.point([v for v, _ in pairs], unit, higher_is_better=False, **extra)


def save_points(runs: dict[str, list[dict[str, float] | None]]) -> dict[str, Any]:
    local = runs.get("local", [])
    stall_base, raw = _values(local, "stall_s"), _values(local, "raw_upload_s")
    points = {"local_stall": _point(stall_base, "local disk stall"),
              "raw_durable": _point(raw, "raw boto3 upload")}
    for system, rows in runs.items():
        if system == "local":
            continue
        name = LABELS.get(system, system)
        points[f"{system}_stall"] = _point(_values(rows, "stall_s"), f"{name} stall",
                                           base=stall_base, base_label="local disk stall")
        points[f"{system}_durable"] = _point(_values(rows, "durable_s"), f"{name} durable",
                                             base=raw, base_label="raw boto3 upload")
        points[f"{system}_daemon_cpu"] = _point(_values(rows, "daemon_cpu_s"),
                                                f"{name} daemon CPU", unit="CPU s")
    for system, rows in runs.items():
        points[f"{system}_s3_cpu"] = _point(_values(rows, "s3_cpu_s"),
                                            f"SeaweedFS CPU, {LABELS.get(system, system)}",
                                            unit="CPU s")
    return {k: v for k, v in points.items() if v is not None}


def restore_points(restore: str, rows: Rows) -> dict[str, Any]:
    workload, base_system = RESTORE_BASE[restore]
    base_runs = rows.get(workload or restore, {}).get(base_system, [])
    base = _values(base_runs, "restore_s")
    base_label = LABELS[base_system] + (f" ({TITLES[workload]})" if workload else "")
    points = {}
    for system, runs in rows[restore].items():
        # without the baseline (s3torchconnector not installed) the seconds still show
        paired = (system != base_system or workload is not None) and any(
            b is not None for b in base)
        points[system] = _point(_values(runs, "restore_s"), LABELS.get(system, system),
                                base=base if paired else None,
                                base_label=base_label if paired else "")
    return {k: v for k, v in points.items() if v is not None}


def goals(workloads: dict[str, Any], sessions: list[str]) -> list[dict[str, Any]]:
    out = []

    def check(workload: str, key: str, limit: float, text: str) -> None:
        p = workloads.get(workload, {}).get("points", {}).get(key)
        if p is None or p.get("ratio") is None:
            out.append({"pass": False, "text": f"{text}: no measurement"})
            return
        out.append({"pass": p["ratio"] <= limit,
                    "text": f"{text}: {p['ratio']:.2f} x ({p['median']:.2f} s)"})

    for s in sessions:
        for w in STALL_GOAL_WORKLOADS:
            if w in workloads:
                check(w, f"{s}_stall", STALL_GOAL,
                      f"{TITLES[w]}, {s}: stall <= {STALL_GOAL} x local")
        for w in (w for w in workloads if "save" in w):
            check(w, f"{s}_durable", DURABLE_GOAL,
                  f"{TITLES[w]}, {s}: durable <= {DURABLE_GOAL} x raw upload")
        for w in ("torch_load_cold", "safetensors_load_cold", "dcp_load_cold",
                  "dcp_load_4_cold"):
            if w in workloads:
                check(w, s, RESTORE_GOAL,
                      f"{TITLES[w]}, {s}: restore <= {RESTORE_GOAL} x s3torchconnector")
    return out


def results(meta: dict[str, Any], rows: Rows, errors: list[str], checked: int,
            fatal: str) -> dict[str, Any]:
    workloads = {}
    for name, runs in rows.items():
        points = save_points(runs) if "save" in name else restore_points(name, rows)
        report.fill_ratios(points)
        workloads[name] = {"title": TITLES[name], "points": points, "rounds": runs}
    return {"meta": meta, "workloads": workloads, "errors": errors, "fatal": fatal,
            "checked": checked, "goals": goals(workloads, meta["sessions"]),
            "ok": not fatal and not errors and checked > 0}


def _cell(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    spread = f"{p['median']:.2f} s [{p['min']:.2f}-{p['max']:.2f}]"
    return f"**{p['ratio']:.2f} x** ({spread})" if p.get("ratio") else spread


def _cpu(points: dict[str, Any], system: str) -> str:
    daemon, s3 = points.get(f"{system}_daemon_cpu"), points.get(f"{system}_s3_cpu")
    if s3 is None:
        return "-"
    return (f"{daemon['median']:.1f} + " if daemon else "") + f"{s3['median']:.1f}"


def table(results: dict[str, Any]) -> list[str]:
    """The headline: one row per workload and measure, one column per system."""
    systems = ["local", *results["meta"]["sessions"], *results["meta"].get("peers", []),
               "s3tc"]
    lines = ["| | " + " | ".join(LABELS[s] for s in systems) + " | raw boto3 upload |",
             "|---|" + "---:|" * (len(systems) + 1)]
    for name, w in results["workloads"].items():
        pts = w["points"]
        if "save" in name:
            lines.append(f"| {w['title']}: stall, x local | "
                         + " | ".join(_cell(pts.get(f"{s}_stall")) for s in systems) + " | |")
            lines.append(f"| {w['title']}: durable, x raw upload | - | "
                         + " | ".join(_cell(pts.get(f"{s}_durable")) for s in systems[1:])
                         + f" | {_cell(pts.get('raw_durable'))} |")
            lines.append(f"| {w['title']}: CPU s, daemon + SeaweedFS | "
                         + " | ".join(_cpu(pts, s) for s in systems) + " | |")
        else:
            base = next((p["baseline_label"] for p in pts.values() if p.get("ratio")), "")
            lines.append(f"| {w['title']}{f', x {base}' if base else ''} | "
                         + " | ".join(_cell(pts.get(s)) for s in systems) + " | |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    meta, m = results["meta"], results["meta"]["machine"]
    lines = [f"Run {meta['date']} at {meta['commit']} on `{m['hostname']}`: {m['nproc']} CPUs,"
             f" {m['mem_gib']:.0f} GiB RAM, kernel {m['kernel']}; {meta['mib_per_rank']} MiB "
             f"per rank, {meta['runs']} round(s), network "
             f"{meta.get('profile', 'lan')}, medians of per-round ratios "
             f"(median s [min-max]); {meta['elapsed_s']:.0f} s in all.", "", *table(results),
             "", "Goals:", ""]
    lines += [f"- {'PASS' if g['pass'] else 'FAIL'} {g['text']}" for g in results["goals"]]
    lines += ["", f"Data check: {results['checked']} checkpoints loaded back and compared "
              f"tensor by tensor{'' if results['ok'] else ' (run NOT ok)'}."]
    for title, items in (("Errors", results["errors"]), ("Notes", meta["notes"])):
        if items:
            lines += ["", f"{title}:", ""] + [f"- {e[:400]}" for e in items]
    if results["fatal"]:
        lines += ["", f"Fatal: {results['fatal'][:600]}"]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> None:
    with contextlib.suppress(Exception):
        report.plots(results, out)
