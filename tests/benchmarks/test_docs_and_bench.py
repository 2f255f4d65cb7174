"""One smoke run of every maintained benchmark checks its output.

Each smoke run is as small as still exercises each contender (every installed backend, raw, ceilings)
and checks what the benchmark reports (schema, reads checked bit-exact inside the benchmark, which
raises otherwise). Figures from these runs mean nothing: the reports in ``benchmarks/reports/`` do.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str, timeout: int = 600) -> str:
    """``python -m benchmarks.<module> ARGS`` from the repository root; its stdout."""
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    done = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _report(module: str, tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Run a benchmark's ``main`` in this process (no second start of torch) with ``--out STEM``
    (STEM.json, STEM.md): the report and its markdown, after checking what the harness stamps on
    every report."""
    out = tmp_path / module
    assert importlib.import_module(f"benchmarks.{module}").main([*args, "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["benchmark"].startswith(module)
    machine = report["machine"]
    assert machine["cpu_count"] == os.cpu_count() and {"python", "torch", "dataplane"} <= set(machine)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", report["date"])
    assert report["command"].startswith(f"python -m benchmarks.{module} ")
    return report, out.with_suffix(".md").read_text()


def _installed_backends() -> set[str]:
    from benchmarks.put_get import _backends

    return {b.name for b in _backends() if not b.missing()}


@pytest.mark.slow
def test_put_get_measures_every_installed_backend_and_matches_schema(tmp_path: Path) -> None:
    """``--quick`` (what CI runs) on the smallest grid with both layouts and a scalar field: every
    installed backend is measured beside memcpy (and its raw API: every backend but memory), each
    put path a row compared with raw from the same place, and the report is written where ``--out``
    says (JSON, markdown, PNG)."""
    stem = tmp_path / "bench"
    args = ("--quick", "--sizes", "1", "--fields", "4", "--layouts", "jagged,padded", "--repeat", "1")
    stdout = _run("put_get", *args, "--no-progress", "--out", str(stem))
    report = json.loads(stem.with_suffix(".json").read_text())
    jsonschema.validate(report, json.loads((ROOT / "benchmarks" / "put_get.schema.json").read_text()))
    installed = _installed_backends()
    assert installed >= {"memory"}
    assert {name for name, status in report["backends"].items() if status == "ok"} == installed, report["backends"]
    paths = {"memory": ("tensors",), "mooncake": ("tensors", "empty")}
    got = {(r["backend"], r["put_from"], r["n_fields"], r["layout"]) for r in report["results"]}
    assert got == {
        (b, path, 4, lay) for b in installed for path in paths.get(b, ("tensors",)) for lay in ("jagged", "padded")
    }
    for r in report["results"]:
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert r["put"]["min_s"] <= r["put"]["median_s"] <= r["put"]["max_s"]
        assert r["memcpy_gbps"] == pytest.approx(r["payload_bytes"] / r["memcpy"]["min_s"] / 1e9)
        if r["layout"] == "jagged":  # jagged fields carry no padding
            assert r["padded_bytes"] > r["payload_bytes"]
        if r["backend"] != "memory":  # every backend but memory is compared with its raw API
            assert r["put_vs_raw"] is not None and r["get_vs_raw"] is not None
            assert r["raw_put"]["n"] == 1
    if "mooncake" in installed:  # raw's put from tensors includes the copy into registered memory
        by_path = {r["put_from"]: r for r in report["results"] if r["backend"] == "mooncake"}
        assert by_path["tensors"]["raw_put"]["median_s"] > by_path["empty"]["raw_put"]["median_s"]
    assert set(report["paths"]) == installed and all(report["paths"].values())
    assert report["machine"]["cpu_count"] == os.cpu_count() and "loadavg_after" in report["machine"]
    assert "put GB/s" in stdout and "memcpy GB/s" in stdout and "raw put GB/s" in stdout
    assert f"wrote {stem}.png, {stem}.md, {stem}.json" in stdout and "--no-output" in stdout
    md = stem.with_suffix(".md").read_text()
    assert "memcpy GB/s" in md and "(bench.png)" in md and stem.with_suffix(".png").stat().st_size > 0


def test_put_get_flags_noisy_figures_instead_of_reporting_them() -> None:
    """A figure whose repeats spread widely, or above 1.3x the memcpy beside it, is printed as
    ``noisy`` (with its value and why under the table), and so is its ratio to memcpy; a paired
    ratio to raw is noisy where its own 95% interval is wide, not where the machine's drift moved
    ours and raw alike."""
    from benchmarks.put_get_report import format_table, noisy_figures, noisy_summary, spread

    assert spread([1.0, 1.0, 1.0]) == 0.0
    assert spread([1.0, 2.0]) == pytest.approx(1 / 1.5)  # below 4 repeats: the full range
    assert spread([0.1, 1.0, 1.1, 1.0, 1.05, 9.0, 1.02, 1.08]) == pytest.approx(0.08 / 1.035)  # the middle half

    def timing(spread: float) -> dict[str, Any]:
        return {"median_s": 1.0, "min_s": 1.0, "max_s": 1.0, "n": 9, "spread": spread, "samples_s": [1.0] * 9}

    row: dict[str, Any] = {
        "backend": "mooncake", "put_from": "tensors", "payload_bytes": 1 << 20, "n_fields": 8, "layout": "jagged",
        "readers": 0, "put": timing(0.1), "get": timing(0.9), "memcpy": timing(3.0), "raw_put": timing(0.1),
        "raw_get": timing(0.9), "put_gbps": 29.0, "get_gbps": 0.5, "memcpy_gbps": 1.0, "raw_put_gbps": 1.0,
        "raw_get_gbps": 1.2, "put_vs_memcpy": 29.0, "get_vs_memcpy": 0.5, "put_vs_raw": 29.0, "get_vs_raw": 0.42,
        "put_vs_raw_ci95": [28.0, 30.0], "get_vs_raw_ci95": [0.40, 0.44],
    }  # fmt: skip
    row["noisy"] = noisy = noisy_figures(row)
    assert set(noisy) == {"put_gbps", "get_gbps", "raw_get_gbps", "put_vs_memcpy", "get_vs_memcpy", "put_vs_raw"}
    assert "29.00x the memcpy ceiling" in noisy["put_gbps"] and "spans 90%" in noisy["get_gbps"]
    table = format_table({"results": [row], "backends": {"mooncake": "ok"}})
    line = table.splitlines()[2]
    assert "29.00" not in line and line.split()[-9:] == [
        "noisy",
        "noisy",
        "1.00",
        "1.00",
        "noisy",
        *["noisy"] * 3,
        "0.42",
    ]
    assert "put GB/s 29.00: 29.00x the memcpy ceiling" in table
    # the terminal: the same table, one line instead of the reasons (they stay in the .md and .json)
    report = {"results": [row], "backends": {"mooncake": "ok"}, "config": {"repeat": 5}}
    terse = format_table(report, notes=False)
    assert terse.splitlines()[2] == line and "29.00x" not in terse and len(terse.splitlines()) == 3
    summary = noisy_summary(report, "x.md and x.json")
    assert summary is not None and summary.startswith("6 figures in 1 of 1 rows are noisy")
    assert "x.md and x.json" in summary and "--repeat 10" in summary
    assert noisy_summary({"results": [{**row, "noisy": {}}], "config": {"repeat": 5}}, "x.md") is None
    row["put_gbps"], row["get_vs_raw_ci95"] = 0.9, [0.2, 0.7]
    assert set(noisy_figures(row)) == {"get_gbps", "raw_get_gbps", "get_vs_memcpy", "get_vs_raw"}


def test_put_get_writes_its_report_where_it_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default ``./put_get-<date>-<time>_<machine>.{json,md,png}``; ``--out STEM``, ``--report``
    (the dated report in benchmarks/reports/), ``--json``/``--plot`` (only those) or ``--no-output``."""
    from benchmarks.harness import REPORTS
    from benchmarks.put_get import output_paths, parse_args

    machine = {"cpu_count": 2}
    monkeypatch.chdir(tmp_path)
    default = output_paths(parse_args([]), machine)
    assert sorted(default) == ["json", "md", "png"]
    assert re.fullmatch(r"put_get-\d{4}-\d\d-\d\d-\d{4}_2cpu\.json", str(default["json"]))
    assert output_paths(parse_args(["--out", "x/y"]), machine)["md"] == Path("x/y.md")
    assert output_paths(parse_args(["--report"]), machine)["png"].parent == REPORTS
    assert output_paths(parse_args(["--json", "a.json"]), machine) == {"json": Path("a.json")}
    assert output_paths(parse_args(["--no-output"]), machine) == {}
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    usage = capsys.readouterr().out
    for option in ("--out", "--report", "--json", "--plot", "--no-output"):
        assert option in usage


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.soak  # ~15 s of CI: reader processes are what mooncake_xproc and rl_step's trainers also do
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_put_get_reader_processes_get_the_batch(tmp_path: Path) -> None:
    """``--readers N``: N spawned processes get each batch by its meta at once (in this process: no
    Ray, no TransferQueue)."""
    from benchmarks.put_get import main

    path = tmp_path / "bench.json"
    args = ["--backend", "mooncake", "--sizes", "1", "--fields", "4", "--repeat", "1", "--readers", "1", "--no-ray"]
    assert main([*args, "--no-progress", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["backends"] == {"mooncake": "ok"}, report
    assert {r["put_from"] for r in report["results"]} == {"tensors", "empty"}
    for r in report["results"]:
        assert r["readers"] == 1 and r["get_gbps"] > 0 and r["raw_put"] is None


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.soak  # 18 s of CI for a benchmark's smoke run; the soak run keeps it
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_xproc_contenders_are_bit_exact(tmp_path: Path) -> None:
    """Every contender of the between-process benchmark reads the writer's batch back bit-exact (raw_njt:
    the nested tensors it put, values and offsets, rebuilt from what it read), and the ratios are computed."""
    report, md = _report(
        "mooncake_xproc",
        tmp_path,
        *["--sizes", "1", "--fields", "5", "--repeat", "1", "--warmup", "0", "--no-tq", "--segment-gib", "1"],
    )
    cells = report["results"]["1MB"]
    assert cells["bit_exact"] == {"ours": True, "ours_zc": True, "raw": True, "raw_njt": True}, cells["bit_exact"]
    ratios = cells["ratios"]
    for name in (
        "get_ours_vs_raw",
        "put_ours_zc_vs_raw",
        "put_ours_vs_raw_copied",
        "get_ours_vs_raw_njt",
        "get_raw_njt_vs_raw",
        "get_ours_vs_raw_njt_paired",
        "put_ours_zc_vs_raw_njt",
        "put_raw_njt_vs_raw",
        "put_ours_zc_vs_raw_njt_paired",
    ):
        assert ratios[name] > 0, name
    assert "raw_njt" in md


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.soak  # ~25 s of CI (writer and reader processes, ours and raw)
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_concurrent_benchmark_reads_every_writer_back_bit_exact(tmp_path: Path) -> None:
    """Writers and readers in processes of their own: each reader reads its writer's batches bit-exact,
    ours and raw, and the paired ratios are computed."""
    report, md = _report(
        "mooncake_concurrent",
        tmp_path,
        *[
            "--sizes",
            "1",
            "--fields",
            "5",
            "--writers",
            "1",
            "--ops",
            "2",
            "--repeat",
            "1",
            "--warmup",
            "0",
            "--segment-gib",
            "1",
        ],
    )
    assert report["benchmark"] == "mooncake_concurrent_1w"
    cell = report["results"]["1MB"]
    assert cell["bit_exact"] == {"ours": True, "raw": True}, cell["bit_exact"]
    for op in ("put", "get"):
        assert cell["ours"][op]["gbps"] > 0 and cell["raw"][op]["gbps"] > 0
        assert cell[f"{op}_ours_vs_raw_paired"]["n"] == 1
    assert "| 1MB | ours |" in md


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_scale_benchmark_fills_the_master_and_reads_back(tmp_path: Path) -> None:
    """The scaling benchmark puts the foreign objects it reports (its gets check bit-exactness)."""
    report, md = _report(
        "mooncake_scale", tmp_path, *["--levels", "0,100", "--repeat", "1", "--warmup", "0", "--segment-mib", "128"]
    )
    results = report["results"]
    assert [results[level]["listed_keys"] for level in ("0", "100")] == [0, 100]
    for r in results.values():
        assert min(r["put_ms"], r["put_again_ms"], r["get_ms"], r["raw_get_ms"], r["listing_ms"]) > 0
    assert "| 100 | 100 |" in md


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_layout_benchmark_times_every_layout_and_checks_its_reads(tmp_path: Path) -> None:
    """The layout benchmark stores the objects each layout names and reads them back (bit-exact checks
    raise inside it), over both transports."""
    report, md = _report(
        "mooncake_layout", tmp_path, *["--sizes", "1", "--repeat", "1", "--warmup", "0", "--segment-mib", "128"]
    )
    rows = report["config"]["rows"]["1MB"]
    assert report["config"]["objects"]["1MB"] == {"row_field": rows * 8, "field": 8, "field_index": 9, "put": 1}
    for transport in ("shm", "tcp"):
        cell = report["results"][f"{transport}/1MB"]
        assert cell["field"]["put_vs_field"] == 1.0 and 0 < cell["shard_bytes"] < cell["bytes"]
        for layout in ("row_field", "field", "field_index", "put"):
            assert min(cell[layout][op] for op in ("put", "get_all", "get_shard")) > 0
    assert "| tcp | 1MB | row_field |" in md


def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _urls(*mooncake: str) -> list[str]:
    """memory, and the given mooncake:// URLs where Mooncake is installed."""
    return ["memory://", *(mooncake if importlib.util.find_spec("mooncake") is not None else ())]


@pytest.mark.slow
def test_rank_rows_benchmark_checks_every_kind_of_read(tmp_path: Path) -> None:
    """The rank-read benchmark checks its whole and per-rank reads bit-exact (raising inside) and
    reports each rank's read against the whole one."""
    urls = _urls("mooncake://local?segment_bytes=128MiB&shm=false")
    args = [
        "--backends",
        ";".join(urls),
        *["--size-mb", "1", "--rows", "16", "--dp", "2,8", "--repeat", "1", "--warmup", "0"],
    ]
    report, md = _report("rank_rows", tmp_path, *args)
    assert list(report["results"]) == urls
    for url in urls:
        (cell,) = report["results"][url].values()
        assert min(cell["whole_ms"], cell["dp2_ms"], cell["dp8_ms"], cell["dp8_vs_whole"]) > 0
        assert f"| `{url}` | 16 |" in md


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.soak  # 60-80 s; CI runs it in-process on two backends (test_rl_step.py)
def test_rl_step_benchmark_times_every_contender_and_phase(tmp_path: Path) -> None:
    """The ``--quick`` command: the driver funnel and every installed multi-process backend (a second
    ``tq://`` in a round of its own), each phase timed; reads checked inside (raising otherwise)."""
    from test_rl_step import check_report

    from benchmarks.rl_step import BACKENDS, installed

    out = tmp_path / "step.json"
    stdout = _run("rl_step", "--quick", "--no-progress", "--json", str(out), "--plot", str(tmp_path / "step.png"))
    report = json.loads(out.read_text())
    urls, skipped = installed(list(BACKENDS))
    assert set(report["skipped"]) == set(skipped)
    check_report(report, out.with_suffix(".md").read_text(), urls)
    assert (tmp_path / "step.png").stat().st_size > 0 and "wrote" in stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.tq
@pytest.mark.mooncake
@pytest.mark.soak  # ~80 s (three processes, two TransferQueues); CI covers the facade with test_install.py
def test_verl_step_benchmark_times_every_phase_of_every_contender(tmp_path: Path) -> None:
    """``--quick``: TransferQueue and the facade on both backends, each in a process of its own; the
    step checks every read against what it wrote (raising otherwise)."""
    from benchmarks.verl_step import CONTENDERS, PHASES

    out = tmp_path / "verl.json"
    stdout = _run("verl_step", "--quick", "--json", str(out))
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["contenders"]] == list(CONTENDERS)
    for c in report["contenders"]:
        assert c["facade"] == (c["name"] != "transferqueue") and c["trajectories"] == 8
        assert set(c["phases"]) == set(PHASES) and min(c["phases"].values()) >= 0 and c["step_seconds"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| transferqueue |" in md and "facade on `mooncake://local`" in md and "wrote" in stdout


@pytest.mark.slow
def test_many_rows_benchmark_times_every_step_and_checks_its_reads(tmp_path: Path) -> None:
    """The many-rows benchmark checks its gets and listing against what was put (raising inside)."""
    from benchmarks.many_rows import STEPS

    urls = _urls("mooncake://local?segment_bytes=64MiB")
    args = ["--backends", ";".join(urls), *["--rows", "40", "--size-mb", "1", "--repeat", "1"]]
    report, md = _report("many_rows", tmp_path, *args)
    for url in urls:
        cell = report["results"][url]["40"]
        assert list(cell) == [f"{k}_ms" for k in STEPS] and min(cell.values()) > 0
        assert f"| `{url}` | 40 |" in md


@pytest.mark.slow
def test_streaming_puts_benchmark_reads_every_row_back(tmp_path: Path) -> None:
    """The streaming benchmark reads every streamed row and every rollout back (raising on a
    mismatch), per block of puts and per round."""
    urls = _urls("mooncake://local?segment_bytes=64MiB")
    args = [
        "--backends",
        ";".join(urls),
        *["--puts", "20", "--block", "10", "--fields", "3", "--rollouts", "8", "--rounds", "1", "--repeat", "1"],
    ]
    report, md = _report("streaming_puts", tmp_path, *args)
    for url in urls:
        r = report["results"][url]
        assert len(r["stream_ms_per_put"]) == 2 and min(r["stream_ms_per_put"]) > 0
        (rollouts,) = r["rollouts"]
        assert set(rollouts) == {"put_s", "get_all_s", "get_quarter_s", "bytes"} and min(rollouts.values()) > 0
        assert f"| `{url}` | 1 |" in md


def test_preshard_quality_benchmark_reports_quality_and_timing(tmp_path: Path) -> None:
    from benchmarks.preshard_quality import main

    path = tmp_path / "q.json"
    assert main(["--seeds", "2", "--repeat", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["benchmark"] == "preshard_quality" and isinstance(report["machine"]["cpu_count"], int)
    q = report["quality"]
    assert q["rows"] == 512 and q["dp_size"] == 8 and q["seeds"] == [0, 1]
    for row in q["per_seed"]:
        assert row["ours"] <= 1.02 * min(row["greedy"], row["karmarkar_karp"])  # quality, not wall time
    t = report["timing"]
    assert t["rows"] == 4096 and t["dp_size"] == 64
    for case in t["cases"]:
        assert {"name", "median_ms", "target_ms"} <= set(case) and case["median_ms"] > 0
    assert "ours/best" in path.with_suffix(".md").read_text()


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(_cuda_gpus() < 2, reason="needs at least 2 CUDA GPUs")
def test_worker_gpu_benchmark_times_every_way_onto_the_gpus(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    _run(
        "worker_gpu",
        *["--ranks", "2", "--gb", "0.01", "--rows", "256", "--warmup", "0", "--repeat", "1", "--json"],
        str(path),
    )
    report = json.loads(path.read_text())
    assert set(report["result"]["runs"]) == {"independent_single", "independent_all", "leader_broadcast"}
    assert report["machine"]["ranks"] == 2 and len(report["machine"]["gpus"]) >= 2
    assert min(report["ratios"].values()) > 0


def test_median_confidence_interval_is_the_binomial_order_statistics() -> None:
    from benchmarks.harness import median_ci95

    xs = [float(i) for i in range(100)]
    low, high = median_ci95(list(reversed(xs)))  # order does not matter
    # Bin(100, 1/2): P(X <= 39) = 0.0176 <= 2.5% < P(X <= 40) = 0.0284, so ranks 39 and 60 (0-based)
    assert (low, high) == (39.0, 60.0)
    assert median_ci95([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)  # n = 6: P(X <= 0) = 1/64
    assert median_ci95([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95%: the full range
    with pytest.raises(ValueError):
        median_ci95([])


def test_reports_are_named_by_date_machine_and_benchmark() -> None:
    """Every report in ``benchmarks/reports/`` is ``<date>_<machine>_<benchmark>[_variant]`` (a JSON,
    its markdown) measured on the machine its name says, and the index links every one."""
    from benchmarks.harness import REPORTS, machine_label

    index = (REPORTS / "README.md").read_text()
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    stems = {p.stem for p in REPORTS.iterdir() if p.name != "README.md"}
    assert stems
    for stem in stems:
        date, label, benchmark = stem.split("_", 2)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", date), stem
        assert any(benchmark == m or benchmark.startswith(f"{m}_") for m in modules), stem
        assert (REPORTS / f"{stem}.md").exists() and (REPORTS / f"{stem}.json").exists(), stem
        assert machine_label(json.loads((REPORTS / f"{stem}.json").read_text())["machine"]) == label, stem
        assert f"({stem}.md)" in index, f"{stem} is not in the index"
    assert machine_label({"cpu_count": 16}) == "16cpu"
    assert machine_label({"cpu_count": 64, "gpus": ["NVIDIA H200, 143771 MiB, 580.1"] * 4}) == "4xH200"
