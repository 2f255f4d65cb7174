"""Benchmark smoke runs: each benchmark runs, and the JSON it writes matches its documented schema."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import dataplane

ROOT = Path(__file__).resolve().parents[2]


def _mooncake(url: str) -> Any:
    """``url`` as a parameter that needs Mooncake (marked, and skipped with the reason where absent)."""
    missing = importlib.util.find_spec("mooncake") is None
    return pytest.param(
        url, marks=[pytest.mark.mooncake, pytest.mark.skipif(missing, reason="Mooncake is not installed")]
    )


def _run_bench(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    path = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.put_get", *args, "--no-progress", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(path.read_text())
    schema = json.loads((ROOT / "benchmarks" / "put_get.schema.json").read_text())
    jsonschema.validate(report, schema)
    return report, out.stdout


def _installed_backends() -> set[str]:
    from benchmarks.put_get import _backends

    return {b.name for b in _backends() if not b.missing()}


@pytest.mark.slow
def test_quick_benchmark_is_what_ci_runs_and_matches_schema(tmp_path: Path) -> None:
    """``--quick`` exactly as CI's smoke run: every installed backend is measured and reported."""
    report, stdout = _run_bench(tmp_path, "--quick")
    installed = _installed_backends()
    assert installed >= {"memory"}
    assert {name for name, status in report["backends"].items() if status == "ok"} == installed, report["backends"]
    measured = {r["backend"] for r in report["results"]}
    assert measured == installed
    for r in report["results"]:
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0 and r["memcpy_gbps"] > 0
        if r["backend"] != "memory":  # every backend but memory is compared with its raw API
            assert r["put_vs_raw"] is not None and r["get_vs_raw"] is not None
    assert report["machine"]["cpu_count"] == os.cpu_count()
    assert "put GB/s" in stdout


def test_benchmark_grid_options(tmp_path: Path) -> None:
    report, _ = _run_bench(
        tmp_path, "--backend", "memory", "--sizes", "1", "--fields", "1,4", "--layouts", "jagged,padded",
        "--repeat", "2", "--no-ray",
    )  # fmt: skip
    assert report["backends"] == {"memory": "ok"}
    got = {(r["n_fields"], r["layout"]) for r in report["results"]}
    assert got == {(1, "jagged"), (4, "jagged"), (1, "padded"), (4, "padded")}
    for r in report["results"]:
        if r["layout"] == "jagged":  # jagged fields carry no padding
            assert r["padded_bytes"] > r["payload_bytes"]
        assert r["put"]["min_s"] <= r["put"]["median_s"] <= r["put"]["max_s"]


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_reader_processes_get_the_batch(tmp_path: Path) -> None:
    report, _ = _run_bench(
        tmp_path, "--backend", "mooncake", "--sizes", "1", "--fields", "4", "--repeat", "1", "--readers", "2",
        "--no-ray",
    )  # fmt: skip
    assert report["backends"] == {"mooncake": "ok"}, report
    (r,) = report["results"]
    assert r["readers"] == 2 and r["get_gbps"] > 0


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_xproc_contenders_are_bit_exact(tmp_path: Path) -> None:
    """Every contender of the between-process benchmark reads the writer's batch back bit-exact (raw_njt:
    the nested tensors it put, values and offsets, rebuilt from what it read), and the ratios the
    closing notes quote are computed."""
    out = tmp_path / "xproc"
    _run_results_bench("mooncake_xproc", out, "--sizes 1 --fields 5 --repeat 2 --warmup 0 --no-tq --segment-gib 1")
    report = json.loads(out.with_suffix(".json").read_text())
    cells = report["results"]["1MB"]
    assert cells["bit_exact"] == {"ours": True, "ours_zc": True, "raw": True, "raw_njt": True}, cells["bit_exact"]
    ratios = cells["ratios"]
    for name in (
        "get_ours_vs_raw",
        "get_ours_vs_raw_njt",
        "get_raw_njt_vs_raw",
        "get_ours_vs_raw_njt_paired",
        "put_ours_zc_vs_raw_njt",
        "put_raw_njt_vs_raw",
        "put_ours_zc_vs_raw_njt_paired",
    ):
        assert ratios[name] > 0, name
    assert "raw_njt" in out.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_concurrent_benchmark_reads_every_writer_back_bit_exact(tmp_path: Path) -> None:
    """Several writers and readers at once: each reader reads its writer's batches bit-exact, ours and
    raw, and the paired ratios are computed."""
    out = tmp_path / "conc"
    _run_results_bench(
        "mooncake_concurrent", out, "--sizes 1 --fields 5 --writers 2 --ops 2 --repeat 2 --warmup 0 --segment-gib 1"
    )
    cell = json.loads(out.with_suffix(".json").read_text())["results"]["1MB"]
    assert cell["bit_exact"] == {"ours": True, "raw": True}, cell["bit_exact"]
    for op in ("put", "get"):
        assert cell["ours"][op]["gbps"] > 0 and cell["raw"][op]["gbps"] > 0
        assert cell[f"{op}_ours_vs_raw_paired"]["n"] == 2
    assert "| 1MB | ours |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_scale_benchmark_fills_the_master_and_reads_back(tmp_path: Path) -> None:
    """The scaling benchmark puts the foreign objects it reports (its gets check bit-exactness)."""
    out = tmp_path / "scale"
    _run_results_bench("mooncake_scale", out, "--levels 0,300 --repeat 2 --warmup 0 --segment-mib 256")
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [results[level]["listed_keys"] for level in ("0", "300")] == [0, 300]
    for r in results.values():
        assert min(r["put_ms"], r["put_again_ms"], r["get_ms"], r["raw_get_ms"], r["listing_ms"]) > 0
    assert "| 300 | 300 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_beside_gate_benchmark_times_every_case_and_checks_its_gets(tmp_path: Path) -> None:
    """The gate benchmark times each kind of Python beside a raw read and each way of getting a batch
    (it raises on a get that reads back wrong)."""
    out = tmp_path / "gate"
    _run_results_bench("results.mooncake_beside_gate", out, "--size-mb 4 --repeat 1")
    report = json.loads(out.with_suffix(".json").read_text())
    assert len(report["raw_read_ms"]) == 6 and min(report["raw_read_ms"].values()) > 0
    assert set(report["get_by_meta"]) == {"in line", "beside, no gate", "beside, gate"}
    assert all(v["get_ms"] >= v["read_ms"] > 0 for v in report["get_by_meta"].values())


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_floor_benchmark_times_every_contender(tmp_path: Path) -> None:
    """The floor benchmark times raw Mooncake with and without the check and the index object, and
    ours (it raises on a get that reads back wrong)."""
    out = tmp_path / "floor"
    _run_results_bench("results.mooncake_floor", out, "--size-mb 4 --repeat 1")
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["get"]["ms"]) == {"raw", "raw + check after", "raw + check beside", "ours"}
    assert set(report["put"]["ms"]) == {
        "raw",
        "raw + index object",
        "ours_zc",
        "ours_zc write",
        "ours_zc python before the write",
    }
    for part in ("get", "put"):
        assert min(report[part]["ms"].values()) > 0 and min(report[part]["raw_over"].values()) > 0
    assert report["put"]["ms"]["ours_zc"] > report["put"]["ms"]["ours_zc write"]


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_streaming_copy_benchmark_compares_both_deployments(tmp_path: Path) -> None:
    """The streaming-copy benchmark starts one store server streaming its copies and one with glibc's
    own, and times raw (padded and odd) and ours on each, checking what each read back."""
    out = tmp_path / "streaming"
    _run_results_bench("results.mooncake_streaming_copy", out, "--sizes 2 --repeat 1 --segment-gib 1")
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["store_server_tunables"] == {"streamed": "glibc.cpu.x86_non_temporal_threshold=0x40000", "glibc": ""}
    cell = report["2MB"]
    assert cell["bit_exact"] is True
    assert set(cell["ms"]) == {
        f"{d} {c} {op}" for d in ("streamed", "glibc") for c in ("raw", "raw odd", "ours") for op in ("put", "get")
    }
    assert min(cell["ms"].values()) > 0 and len(cell["paired"]) == 12 and min(cell["paired"].values()) > 0
    assert set(report["memcpy_32MB_ms"]) == {"glibc", "streamed"}


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_mooncake_layout_benchmark_times_every_layout_and_checks_its_reads(tmp_path: Path) -> None:
    """The layout benchmark stores the objects each layout names and reads them back (bit-exact checks
    raise inside it), over both transports."""
    out = tmp_path / "layout"
    _run_results_bench("mooncake_layout", out, "--sizes 1 --repeat 2 --warmup 0 --segment-mib 256")
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["config"]["rows"]["1MB"]
    assert report["config"]["objects"]["1MB"] == {"row_field": rows * 8, "field": 8, "field_index": 9, "put": 1}
    for transport in ("shm", "tcp"):
        cell = report["results"][f"{transport}/1MB"]
        assert cell["field"]["put_vs_field"] == 1.0 and 0 < cell["shard_bytes"] < cell["bytes"]
        for layout in ("row_field", "field", "field_index", "put"):
            assert min(cell[layout][op] for op in ("put", "get_all", "get_shard")) > 0
    assert "| tcp | 1MB | row_field |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("url", ["memory://", _mooncake("mooncake://local?segment_bytes=256MiB&shm=false")])
def test_rank_rows_benchmark_checks_every_kind_of_read(tmp_path: Path, url: str) -> None:
    """The rank-read benchmark checks its whole and per-rank reads bit-exact (raising inside) and
    reports each rank's read against the whole one."""
    out = tmp_path / "rank"
    _run_results_bench("rank_rows", out, f"--backends {url} --size-mb 1 --rows 16,64 --dp 2,8 --repeat 2 --warmup 0")
    cells = json.loads(out.with_suffix(".json").read_text())["results"][url]
    assert sorted(cells) == ["16", "64"]
    for cell in cells.values():
        assert min(cell["whole_ms"], cell["dp2_ms"], cell["dp8_ms"], cell["dp8_vs_whole"]) > 0
    assert f"| `{url}` | 64 |" in out.with_suffix(".md").read_text()


def test_many_rows_benchmark_times_every_step_and_checks_its_reads() -> None:
    """The many-rows step checks its gets against what was put (raising inside), on few rows."""
    from benchmarks.results.many_rows import STEPS, step_times

    client = dataplane.connect("memory://")
    try:
        med = step_times(client, client, rows=40, repeat=1)
    finally:
        client.close()
    assert list(med) == list(STEPS) and min(med.values()) > 0


@pytest.mark.parametrize("url", ["memory://", _mooncake("mooncake://local?segment_bytes=64MiB")])
def test_single_row_puts_benchmark_times_each_block_and_reads_every_row(url: str) -> None:
    """The streaming benchmark reads every row back (raising on a mismatch) and clears after itself."""
    from benchmarks.results.single_row_puts import stream

    client = dataplane.connect(url)
    try:
        per = stream(client, 30, 3, block=10)
        assert len(per) == 3 and min(per) > 0
        assert client.kv_list("stream") == {}
    finally:
        client.close()


@pytest.mark.parametrize("url", ["memory://", _mooncake("mooncake://local?segment_bytes=64MiB")])
def test_rollouts_benchmark_reads_every_row_back_and_clears(url: str) -> None:
    """The streamed-rollouts benchmark checks every row it reads (raising on a mismatch)."""
    from benchmarks.results.single_row_puts import rollouts

    client = dataplane.connect(url)
    try:
        r = rollouts(client, 12, repeat=1)
        assert set(r) == {"put", "get all", "get 1/4", "bytes"} and min(r.values()) > 0
        assert client.kv_list("rollouts") == {}
    finally:
        client.close()


def _run_results_bench(module: str, out: Path, args: str) -> None:
    """``python -m benchmarks.<module> ARGS --out OUT`` (a results benchmark: writes OUT.json and OUT.md)."""
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args.split(), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def test_median_confidence_interval_is_the_binomial_order_statistics() -> None:
    from benchmarks.mooncake_xproc import median_ci95

    xs = [float(i) for i in range(100)]
    low, high = median_ci95(list(reversed(xs)))  # order does not matter
    # Bin(100, 1/2): P(X <= 39) = 0.0176 <= 2.5% < P(X <= 40) = 0.0284, so ranks 39 and 60 (0-based)
    assert (low, high) == (39.0, 60.0)
    assert median_ci95([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)  # n = 6: P(X <= 0) = 1/64
    assert median_ci95([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95%: the full range
    with pytest.raises(ValueError):
        median_ci95([])


def test_timing_calls_times_each_call_and_puts_the_method_back() -> None:
    from benchmarks.base import timing_calls

    class Thing:
        def work(self, x: int) -> int:
            if x < 0:
                raise ValueError(x)
            return x * 2

    thing = Thing()
    with timing_calls(thing, "work") as seconds:
        assert thing.work(3) == 6
        with pytest.raises(ValueError):
            thing.work(-1)  # a call that raises is timed too
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)
    assert "work" not in vars(thing)  # the instance attribute is gone: the class's method is back
    assert thing.work(4) == 8 and len(seconds) == 2
