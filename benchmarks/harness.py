"""What every benchmark shares: machine info, timing, statistics and reports.

A benchmark measures with :func:`timed` (medians after warm-up, by :func:`stats`), compares with
baselines as paired ratios (:func:`paired`), and writes its report with :func:`bench_main`: a JSON
(the report, with ``machine`` and ``date``) and a markdown beside it, by default
``benchmarks/reports/<date>_<machine>_<benchmark>.{json,md}`` (see ``benchmarks/reports/README.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = [
    "REPORTS",
    "add_out_argument",
    "bench_main",
    "default_out",
    "machine_info",
    "machine_label",
    "machine_line",
    "median",
    "median_ci95",
    "paired",
    "quiet_torch_fx_notice",
    "report_head",
    "stats",
    "timed",
    "write_report",
]

REPORTS = Path(__file__).resolve().parent / "reports"
_PACKAGES = (
    "numpy",
    "tensordict",
    "transferqueue",
    "ray",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "transformers",
)


_FX_NOTICE = "is_fx_tracing will return true"


def _not_fx_notice(record: logging.LogRecord) -> bool:
    return _FX_NOTICE not in record.getMessage()


def quiet_torch_fx_notice() -> None:
    """Drop the one notice torch 2.13 logs (once per process, at WARNING, on the logger
    ``torch.fx._symbolic_trace``) the first time anything calls
    ``torch.nested.nested_tensor_from_jagged``: "is_fx_tracing will return true for both
    fx.symbolic_trace and torch.export ...". It is about torch's own tracing API, says nothing about
    a benchmark, and would be the first line every benchmark prints (the batch builder, the raw
    backends and the readers all build nested tensors with torch's constructor). Only that message
    is filtered; the logger's other records pass. Idempotent; the package does it on import."""
    logger = logging.getLogger("torch.fx._symbolic_trace")
    if _not_fx_notice not in logger.filters:
        logger.addFilter(_not_fx_notice)


def _gpus() -> list[str]:
    """``name, memory, driver`` of every NVIDIA GPU (empty without ``nvidia-smi``)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.strip().splitlines() if out.returncode == 0 else []


def machine_info(*, gpus: bool = False) -> dict[str, Any]:
    """The machine and software a report was measured on (``gpus``: also the GPUs, CUDA and NCCL)."""
    import torch

    import dataplane

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dataplane": dataplane.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    for dist in _PACKAGES:
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if hasattr(os, "getloadavg"):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if gpus:
        info["gpus"] = _gpus()
        info["cuda"] = torch.version.cuda
        info["nccl"] = (
            ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
            if torch.cuda.is_available()
            else None
        )
    return info


def machine_label(info: dict[str, Any]) -> str:
    """A short name of the machine for report file names: ``16cpu``, or ``4xH200`` with GPUs."""
    gpus = info.get("gpus") or []
    if gpus:
        name = gpus[0].split(",")[0]  # "NVIDIA H200, 143771 MiB, ..." or "NVIDIA H100 80GB HBM3, ..."
        found = re.search(r"\b([A-Z]{1,2}\d{2,4}[a-z]?)\b", name)  # the model: H200, H100, A100, L40s
        model = found.group(1) if found else name.split()[-1]
        return f"{len(gpus)}x{model}"
    return f"{info.get('cpu_count') or 0}cpu"


def machine_line(m: dict[str, Any]) -> str:
    """The "Machine: ..." line of a report's markdown, from its ``machine`` dict."""
    parts = [f"{m.get('cpu_count') or m.get('cpus')} CPUs"]
    if m.get("mem_total_gib"):
        parts.append(f"{m['mem_total_gib']} GiB")
    parts += [str(m.get("platform")), f"torch {m.get('torch')}"]
    mooncake = m.get("mooncake-transfer-engine-non-cuda") or m.get("mooncake-transfer-engine")
    if mooncake:
        parts.append(f"mooncake {mooncake}")
    if m.get("gpus"):
        parts.append(f"GPUs: {'; '.join(m['gpus'])}")
    line = "Machine: " + ", ".join(parts)
    if m.get("loadavg"):
        line += f"; load average {', '.join(f'{x:.2f}' for x in m['loadavg'])}"
        if m.get("loadavg_after"):
            line += f", after {', '.join(f'{x:.2f}' for x in m['loadavg_after'])}"
    return line + "."


def report_head(title: str, about: str, columns: Sequence[str]) -> list[str]:
    """The top of a report's markdown: ``# title``, the ``about`` paragraph (machine line, command,
    method), then the header row and separator of a table over ``columns``.

    >>> report_head("T", "M.", ["a", "b"])[-2:]
    ['| a | b |', '| --- | --- |']
    """
    return [f"# {title}", "", about, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def median(xs: list[float]) -> float:
    """The median (``nan`` for no samples)."""
    return statistics.median(xs) if xs else math.nan


def stats(xs: list[float]) -> dict[str, float]:
    """``median_s``, ``min_s``, ``max_s`` and ``n`` of a list of seconds."""
    return {"median_s": median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def timed(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    out = []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def median_ci95(xs: list[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median of ``xs``: the order statistics
    ``s[j]``, ``s[n-1-j]`` with the largest ``j`` whose binomial(n, 1/2) tail P(X <= j) is at most
    2.5%. Below 6 samples no pair reaches 95%: the full range is returned."""
    s = sorted(xs)
    n = len(s)
    if not n:
        raise ValueError("no samples")
    j, cdf = -1, 0.0
    while True:
        nxt = cdf + math.comb(n, j + 1) / 2**n  # P(X <= j + 1)
        if nxt > 0.025:
            break
        cdf, j = nxt, j + 1
    return (s[0], s[-1]) if j < 0 else (s[j], s[n - 1 - j])


def paired(baseline: list[float], contender: list[float]) -> dict[str, float]:
    """Baseline seconds over contender seconds, timed back to back in each repetition (the drift of
    a shared machine cancels): the median (above 1: the contender is faster), its 95% interval, n."""
    ratios = [b / c for b, c in zip(baseline, contender, strict=True)]
    low, high = median_ci95(ratios)
    return {"median": statistics.median(ratios), "low": low, "high": high, "n": len(ratios)}


def default_out(benchmark: str, machine: dict[str, Any] | None = None) -> Path:
    """``benchmarks/reports/<today>_<machine>_<benchmark>`` (no extension)."""
    label = machine_label(machine if machine is not None else machine_info())
    return REPORTS / f"{datetime.date.today().isoformat()}_{label}_{benchmark}"


def add_out_argument(p: argparse.ArgumentParser) -> None:
    """``--out STEM``: where the report goes (STEM.json and STEM.md); default a dated report."""
    p.add_argument(
        "--out",
        default=None,
        help="path without extension (.json, .md); default benchmarks/reports/<date>_<machine>_<benchmark>",
    )


def write_report(report: dict[str, Any], markdown: str, out: str | Path) -> Path:
    """Write ``out.json`` (the report) and ``out.md`` (its markdown); returns the JSON's path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown)
    return json_path


def bench_main(
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    to_markdown: Callable[[dict[str, Any]], str],
) -> int:
    """A benchmark's ``main``: parse, run, stamp the report (``benchmark``, ``date``, ``machine``,
    ``command``), write it (``--out``, default a dated report) and print its markdown.

    ``run`` returns the report with ``benchmark`` (its name in report file names) and may set
    ``machine`` itself (e.g. with figures taken before and after); else it is taken here.
    """
    args = parse_args(argv)
    report = run(args)
    report.setdefault("machine", machine_info())
    report.setdefault("date", datetime.date.today().isoformat())
    report.setdefault("created_unix", time.time())
    report.setdefault("command", " ".join(["python -m", _module_of(run), *(sys.argv[1:] if argv is None else argv)]))
    markdown = to_markdown(report)
    out = args.out or default_out(report["benchmark"], report["machine"])
    write_report(report, markdown, out)
    print(markdown)
    print(f"wrote {Path(out).with_suffix('.json')} and .md", file=sys.stderr)
    return 0


def _module_of(fn: Callable[..., Any]) -> str:
    """The dotted name of the module ``fn`` is defined in (also when run as ``python -m``)."""
    name = fn.__module__
    if name == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        name = spec.name if spec is not None else name
    return name
