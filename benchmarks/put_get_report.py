"""What ``benchmarks.put_get`` reports: which figures are noise, the table, the markdown and the plot.

A figure is *noisy*, and printed as ``noisy`` rather than as a result, where its repeats disagree
(their spread, :func:`spread`, is over :data:`SPREAD_LIMIT` of the median) or where it beats the
physical ceiling measured beside it by more than :data:`CEILING_FACTOR` (a put or a get moves every
byte at least once, so neither can outrun a memcpy of the batch by much; one that does was timed
while the machine stalled every memcpy, or measured nothing). A ratio to memcpy is noisy where its
figure is (the memcpy ceiling is the fastest of its repeats, so its own spread does not matter).
A ratio to raw is a paired median (ours and raw timed in turns): it is noisy where its 95% interval
is wider than :data:`SPREAD_LIMIT` of it, whatever the machine's drift did to both figures alike,
or where ours beats the memcpy ceiling.
"""

from __future__ import annotations

from typing import Any

from benchmarks.backends import PUT_FROM
from benchmarks.harness import machine_line
from benchmarks.workload import human_bytes

__all__ = [
    "CEILING_FACTOR",
    "SPREAD_LIMIT",
    "format_table",
    "noisy_figures",
    "noisy_summary",
    "plot",
    "spread",
    "to_markdown",
]

SPREAD_LIMIT = 0.5
CEILING_FACTOR = 1.3
# figure -> the figures it is computed from (a ratio is noisy where one of them is)
_RATIOS = {"put_vs_memcpy": ("put_gbps",), "get_vs_memcpy": ("get_gbps",)}
_PAIRED = {"put_vs_raw": "put_gbps", "get_vs_raw": "get_gbps"}
# figure -> its timing; memcpy is not here: its figure is the fastest repeat (a ceiling), whose
# error shows as figures above it
_TIMINGS = {"put_gbps": "put", "get_gbps": "get", "raw_put_gbps": "raw_put", "raw_get_gbps": "raw_get"}


def spread(xs: list[float]) -> float:
    """How far the repeats of one figure disagree: the range of their middle half over their median
    (the fastest and the slowest quarter dropped: a stall or a lucky run is not spread, the median
    already ignores it; below 4 repeats, the full range)."""
    s = sorted(xs)
    k = len(s) // 4
    mid = s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
    return (s[-1 - k] - s[k]) / mid if mid > 0 else 0.0


def noisy_figures(r: dict[str, Any]) -> dict[str, str]:
    """figure name -> why it is not a result, for one row of the report (see the module's doc)."""
    out: dict[str, str] = {}
    for fig, timing in _TIMINGS.items():
        t = r.get(timing)
        if t and t["spread"] > SPREAD_LIMIT:
            which = f"the middle half of its {t['n']} repeats spans" if t["n"] >= 4 else f"its {t['n']} repeats span"
            out[fig] = f"{which} {t['spread']:.0%} of their median"
    ceiling = r["memcpy_gbps"]  # the fastest of its repeats: a figure far above it means memcpy was stalled
    bounds = {"put_gbps": ceiling, "raw_put_gbps": ceiling, "get_gbps": ceiling * max(1, r["readers"])}
    if not r["readers"]:
        bounds["raw_get_gbps"] = ceiling
    for fig, bound in bounds.items():
        value = r.get(fig)
        if value is not None and value > CEILING_FACTOR * bound:
            out.setdefault(fig, f"{value / bound:.2f}x the memcpy ceiling measured beside it (> {CEILING_FACTOR})")
    for ratio, parts in _RATIOS.items():
        bad = [p for p in parts if p in out]
        if bad and r.get(ratio) is not None:
            out[ratio] = f"computed from noisy {' and '.join(bad)}"
    for ratio, ours in _PAIRED.items():
        value, ci = r.get(ratio), r.get(f"{ratio}_ci95")
        if value is None:
            continue
        if ci and (ci[1] - ci[0]) > SPREAD_LIMIT * value:
            out[ratio] = f"its 95% interval {ci[0]:.2f}-{ci[1]:.2f} is wider than {SPREAD_LIMIT:.0%} of it"
        elif ours in out and "ceiling" in out[ours]:
            out[ratio] = f"computed from noisy {ours}"
    return out


def _cell(r: dict[str, Any], fig: str) -> str:
    value = r.get(fig)
    if value is None:
        return "-"
    return "noisy" if fig in r["noisy"] else f"{value:.2f}"


_COLUMNS = (
    ("put GB/s", "put_gbps"),
    ("get GB/s", "get_gbps"),
    ("memcpy GB/s", "memcpy_gbps"),
    ("raw put GB/s", "raw_put_gbps"),
    ("raw get GB/s", "raw_get_gbps"),
    ("put/memcpy", "put_vs_memcpy"),
    ("get/memcpy", "get_vs_memcpy"),
    ("put/raw", "put_vs_raw"),
    ("get/raw", "get_vs_raw"),
)


def format_table(report: dict[str, Any], *, notes: bool = True) -> str:
    """The results as a text table, the noisy figures' values and reasons under it (the markdown's
    table; ``notes=False``: without them, what the terminal gets beside :func:`noisy_summary`)."""
    head = ("backend", "put from", "payload", "fields", "layout", *(c for c, _ in _COLUMNS))
    rows = [head]
    noted = []
    for r in report["results"]:
        rows.append((
            r["backend"], r["put_from"], human_bytes(r["payload_bytes"]), str(r["n_fields"]), r["layout"],
            *(_cell(r, fig) for _, fig in _COLUMNS),
        ))  # fmt: skip
        for fig, why in r["noisy"].items():
            if fig in _TIMINGS or fig in _PAIRED:  # the memcpy ratios follow from the figures
                label = {f: c for c, f in _COLUMNS}[fig]
                noted.append(
                    f"  {r['backend']} ({r['put_from']}) {human_bytes(r['payload_bytes'])} x{r['n_fields']} "
                    f"{r['layout']}: {label} {r[fig]:.2f}: {why}"
                )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if noted and notes:
        lines += ["", "noisy (not results; rerun on a quieter machine or with more --repeat):", *noted]
    for name, status in report["backends"].items():
        if status != "ok":
            lines.append(f"skipped {name}: {status}")
    return "\n".join(lines)


def noisy_summary(report: dict[str, Any], where: str) -> str | None:
    """One line for the terminal about the figures the table marks ``noisy`` (None when none is):
    how many, where each one's value and reason are (``where``: the report's files), and the
    ``--repeat`` to try.

    >>> rows = [{"noisy": {"put_gbps": "...", "put_vs_memcpy": "..."}, "put_gbps": 1.0}, {"noisy": {}}]
    >>> noisy_summary({"results": rows, "config": {"repeat": 5}}, "run.md and run.json")
    '2 figures in 1 of 2 rows are noisy (marked in the table, not results; each value and why: run.md and run.json); rerun with --repeat 10 (this run: 5) or on a quieter machine'
    """
    rows = report["results"]
    cells = sum(len(r["noisy"]) for r in rows)
    if not cells:
        return None
    hit = sum(1 for r in rows if r["noisy"])
    repeat = int(report["config"]["repeat"])
    figures = "figure" if cells == 1 else "figures"
    verb = "is" if cells == 1 else "are"
    return (
        f"{cells} {figures} in {hit} of {len(rows)} rows {verb} noisy (marked in the table, not results; each value "
        f"and why: {where}); rerun with --repeat {2 * repeat} (this run: {repeat}) or on a quieter machine"
    )


def _ceilings_table(report: dict[str, Any]) -> list[str]:
    """One line per case: memcpy's range over the run (measured beside each row) and ray.put/get."""
    cases: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in report["results"]:
        cases.setdefault((r["payload_bytes"], r["n_fields"], r["layout"]), []).append(r)
    lines = ["| payload | fields | layout | memcpy GB/s (best of each measurement) | ray.put GB/s | ray.get GB/s |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for (payload, n_fields, layout), rs in cases.items():
        memcpy = [r["memcpy_gbps"] for r in rs]
        ray_put, ray_get = (rs[0]["extra"].get(f"ray_{op}_gbps") for op in ("put", "get"))
        lines.append(
            f"| {human_bytes(payload)} | {n_fields} | {layout} | {min(memcpy):.2f}-{max(memcpy):.2f} "
            f"| {'-' if ray_put is None else f'{ray_put:.2f}'} | {'-' if ray_get is None else f'{ray_get:.2f}'} |"
        )
    return lines


def to_markdown(report: dict[str, Any], plot_name: str | None = None) -> str:
    """The report as markdown: machine (with its load), command, what each row compares, the table."""
    cfg = report["config"]
    m = report["machine"]
    loads = [*m.get("loadavg", [])[:1], *m.get("loadavg_after", [])[:1]]
    busy = (
        f" The machine was busy: a 1-minute load average of {max(loads):.1f} on {m.get('cpu_count')} CPUs "
        "while it ran (other jobs shared its cores), so absolute GB/s are low; compare the ratios."
        if loads and max(loads) > (m.get("cpu_count") or 1)
        else ""
    )
    parts = [
        "# put/get throughput of every backend beside its ceilings",
        "",
        machine_line(m) + busy,
        "",
        f"`{report['command']}` (sizes {cfg['sizes_mb']} MB, fields {cfg['fields']}, layouts {cfg['layouts']}, "
        f"medians of {cfg['repeat']} after one warm-up"
        + (f", {cfg['readers']} reader processes" if cfg.get("readers") else "")
        + ")."
        + (f" Plot: [{plot_name}]({plot_name})." if plot_name else ""),
        "",
        "Columns: `memcpy GB/s` is a copy of the batch into one preallocated buffer, measured just before "
        "the row (the fastest of its repeats: the ceiling of any in-host path); `raw` is the backend's own "
        "API on the same deployment, its put starting from the same place as ours (`put from`), timed in "
        "turns with ours; `put/raw`, `get/raw` are paired medians (raw's time over ours, repetition by "
        "repetition; their 95% intervals are in the JSON). "
        f"A figure is `noisy` where the middle half of its repeats spans over {SPREAD_LIMIT:.0%} of their median "
        f"or it beats memcpy by more than {CEILING_FACTOR}x, a paired ratio where its 95% interval is wider "
        f"than {SPREAD_LIMIT:.0%} of it; the values and reasons are listed under the table.",
        "",
        "What each backend's rows compare:",
        "",
        *(f"- `{name}`: {what}" for name, what in report.get("paths", {}).items()),
        *(f"- put from `{k}`: {v}" for k, v in PUT_FROM.items()),
        "",
        "```",
        format_table(report),
        "```",
        "",
        "Ceilings of each case in this run:",
        "",
        *_ceilings_table(report),
    ]
    if report.get("notes"):
        parts += ["", *(f"- {k}: {v}" for k, v in report["notes"].items())]
    return "\n".join(parts) + "\n"


def plot(report: dict[str, Any], path: str) -> None:
    """Put and get GB/s against payload for the 8-field jagged batch (or the most fields run), each
    backend and put path a line, memcpy and ray dashed; noisy points are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = report["config"]["fields"]
    n_fields = 8 if 8 in counts else max(counts)  # 8: an RL batch's usual handful of fields
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors: dict[str, Any] = {}  # one colour per line in both panels (the get panel has fewer lines)
    palette = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3)
    for ax, op in zip(axes, ("put", "get"), strict=True):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in report["results"]:
            if r["layout"] != "jagged" or r["n_fields"] != n_fields or r["readers"] != report["config"]["readers"]:
                continue
            mb = r["payload_bytes"] / 1e6
            name = r["backend"] if r["put_from"] == "tensors" else f"{r['backend']} (client.empty)"
            if op == "get" and r["put_from"] != "tensors":
                continue  # the same get as the row from tensors
            if f"{op}_gbps" not in r["noisy"]:
                series.setdefault(name, []).append((mb, r[f"{op}_gbps"]))
            if "memcpy_gbps" not in r["noisy"]:
                series.setdefault("memcpy ceiling", []).append((mb, r["memcpy_gbps"]))
            ray = r.get("extra", {}).get(f"ray_{op}_gbps")
            if ray:
                series.setdefault(f"ray.{op} ceiling", []).append((mb, ray))
        for name, pts in series.items():
            by_mb: dict[float, float] = {}
            for mb, v in pts:  # memcpy was measured beside every backend: its best per size
                by_mb[mb] = max(v, by_mb.get(mb, 0.0))
            xs = sorted(by_mb)
            color = colors.setdefault(name.replace(".get", ".put"), next(palette))
            style = "--" if "ceiling" in name else "-"
            ax.plot(xs, [by_mb[x] for x in xs], marker="o", label=name, color=color, linestyle=style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("payload (MB)")
        ax.set_title(f"{op} throughput")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    for ax in axes:
        ax.legend(fontsize=7)
    m = report["machine"]
    fig.suptitle(
        f"dataplane put/get, {n_fields} fields, jagged, {m.get('cpu_count')} CPUs, torch {m.get('torch')}"
        + (f", load {m['loadavg'][0]:.1f}" if m.get("loadavg") else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
