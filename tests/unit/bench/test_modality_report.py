"""Per-modality rows: each run's summary split by text / image / video, in the JSON,
the CSV, the HTML page, the printed lines and the goodput."""

from __future__ import annotations

import csv
import json

import pytest

from epd_serve.bench.client import run, run_schedule
from epd_serve.bench.report import modality_goodputs, summary_rows, write_report
from epd_serve.bench.runner import LoadSpec, RunResult, modality_lines
from epd_serve.bench.timings import SLO, RequestRecord, summarize
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

SLO_ = SLO(ttft_ms=500, tpot_ms=50)


def record(i: int, modality: str, ttft_s: float, ok: bool = True) -> RequestRecord:
    r = RequestRecord(i, modality != "text", float(i), modality=modality)
    r.sent = float(i)
    r.first_token = r.sent + ttft_s
    r.token_times = [r.first_token, r.first_token + 0.01, r.first_token + 0.02]
    r.end = r.token_times[-1]
    r.output_tokens = 3
    r.error = None if ok else "HTTP 502: bad"
    return r


def mixed_run(label: str, rate: float, video_ttft_s: float) -> RunResult:
    """Two text requests (100 ms), one image (200 ms), two videos (one failed)."""
    records = [record(0, "video", video_ttft_s), record(1, "text", 0.1), record(2, "image", 0.2),
               record(3, "text", 0.1), record(4, "video", video_ttft_s, ok=False)]
    summary = summarize(records, SLO_, 1, rate)
    summary.update({"label": label, "rate": rate})
    return RunResult(label, rate, summary, records)


def test_a_record_without_a_modality_takes_it_from_multimodal():
    assert RequestRecord(0, True, 0.0).modality == "image"
    assert RequestRecord(0, False, 0.0).modality == "text"
    assert RequestRecord(0, True, 0.0, modality="video").to_row()["modality"] == "video"


def test_summary_per_modality_in_the_reports_order():
    by = mixed_run("x", 1.0, video_ttft_s=0.9).summary["by_modality"]
    assert list(by) == ["text", "image", "video"]
    assert by["text"]["ttft_ms"]["median"] == pytest.approx(100.0)
    assert by["image"]["ttft_ms"]["median"] == pytest.approx(200.0)
    assert by["video"]["ttft_ms"]["median"] == pytest.approx(900.0)
    assert by["video"]["e2el_ms"]["median"] == pytest.approx(920.0)
    assert by["video"]["itl_ms"]["median"] == pytest.approx(10.0)
    assert (by["video"]["total_requests"], by["video"]["success_requests"]) == (2, 1)
    assert by["text"]["slo_attainment"] == 1.0 and by["video"]["slo_attainment"] == 0.0
    assert by["text"]["output_token_throughput"] + by["image"]["output_token_throughput"] + \
        by["video"]["output_token_throughput"] == pytest.approx(
            mixed_run("x", 1.0, 0.9).summary["output_token_throughput"])


def test_rows_follow_their_run():
    rows = summary_rows([mixed_run("E-P-D", 1.0, 0.3)])
    assert [r["label"] for r in rows] == ["E-P-D", "E-P-D [text]", "E-P-D [image]", "E-P-D [video]"]
    assert all(r["rate"] == 1.0 for r in rows)


def test_goodput_per_modality_from_the_runs_made():
    results = [mixed_run("E-P-D", 1.0, 0.3), mixed_run("E-P-D", 2.0, 0.9)]
    # Video meets its SLO at 1 req/s only (its failed request counts against it: 50%).
    good = modality_goodputs(results, {"E-P-D": 1.0})
    assert good["E-P-D"]["text"] == 2.0 and good["E-P-D"]["image"] == 2.0
    assert good["E-P-D"]["video"] is None
    ok_video = [RunResult(r.label, r.rate, {**r.summary, "by_modality": {
        **r.summary["by_modality"], "video": {**r.summary["by_modality"]["video"],
                                              "slo_attainment": 0.95 if r.rate == 1.0 else 0.5}}},
        r.records) for r in results]
    assert modality_goodputs(ok_video, {"E-P-D": 1.0})["E-P-D"]["video"] == 1.0


def test_report_files_carry_a_row_per_modality(tmp_path):
    spec = LoadSpec(url="http://x", model="m", workload="video-mme", num_requests=5, slo=SLO_)
    results = [mixed_run("E-P-D", 1.0, 0.3), mixed_run("E-P-D", 2.0, 0.9)]
    out = write_report(results, tmp_path / "r", spec, {"E-P-D": 2.0})
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["deployment"] for r in rows[:4]] == ["E-P-D", "E-P-D [text]", "E-P-D [image]",
                                                   "E-P-D [video]"]
    assert float(rows[7]["TTFT p50 ms"]) == pytest.approx(900.0)
    assert float(rows[3]["SLO attainment"]) == pytest.approx(0.5)
    data = json.loads((out / "results.json").read_text())
    assert data["runs"][1]["summary"]["by_modality"]["video"]["ttft_ms"]["median"] == \
        pytest.approx(900.0)
    assert data["goodput_by_modality"]["E-P-D"] == {"text": 2.0, "image": 2.0, "video": None}
    assert data["runs"][0]["requests"][0]["modality"] == "video"
    html = (out / "report.html").read_text()
    assert "E-P-D [video]" in html and "(text 2.000, image 2.000, video - req/s)" in html


def test_printed_lines_one_per_modality():
    lines = modality_lines(mixed_run("E-P-D", 1.0, 0.9).summary)
    assert [line.split(":")[0].strip() for line in lines] == ["text", "image", "video"]
    assert lines[2].startswith("  video: 1/2 ok, TTFT p50 900.0 ms")
    assert "E2EL p50 920.0 ms" in lines[2] and lines[2].endswith("SLO attainment 0%")


def test_the_client_records_each_requests_modality():
    app = create_fake_app("fake", ttft_ms=5, itl_ms=1)
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 2, "stream": True}).encode()
    with ThreadedServer(app) as server:
        records = run(run_schedule(server.url + "/v1/chat/completions", [body] * 3,
                                   [0.0, 0.0, 0.0], ["video", "text", True]))
    assert [(r.modality, r.multimodal) for r in records] == [
        ("video", True), ("text", False), ("image", True)]
    assert list(summarize(records, SLO_)["by_modality"]) == ["text", "image", "video"]
