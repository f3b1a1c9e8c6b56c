"""The proxy's x-epd-stages header: parsing, per-run aggregation, and where the load
report shows it (JSON, CSV, HTML, stages.png)."""

from __future__ import annotations

import csv
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from epd_serve.bench import stages
from epd_serve.bench.client import run, run_schedule
from epd_serve.bench.timings import SLO, RequestRecord, summarize
from epd_serve.bench.report import write_report
from epd_serve.bench.runner import LoadSpec, RunResult, _one_line
from epd_serve.testing.fake_server import ThreadedServer

FULL = ("E=e0:12.3ms;P=p1:40.1ms;D=d2:88.0ms;"
        "KV=done:bytes=65536B:transfer=0.5ms:exposed=0.0ms:groups=2;IMG=ref")


def test_full_header():
    b = stages.parse(FULL)
    assert [(v.stage, v.instances, v.ms, v.failed) for v in b.visits] == [
        ("E", ("e0",), 12.3, False), ("P", ("p1",), 40.1, False), ("D", ("d2",), 88.0, False)]
    assert b.stage_ms() == {"E": 12.3, "P": 40.1, "D": 88.0}
    assert b.kv == {"outcome": "done", "bytes": 65536, "transfer_ms": 0.5, "exposed_ms": 0.0,
                    "groups": 2}
    assert b.images == "ref"


@pytest.mark.parametrize("header, stage_ms, instances", [
    # Still streaming when headers were sent: the instance is known, the time is not.
    ("E=e0:12.3ms;P=p1:40.1ms;D=d2", {"E": 12.3, "P": 40.1}, {"D": ("d2",)}),
    # The MM store had every image.
    ("E=store:0.0ms;P=p0:5ms", {"E": 0.0, "P": 5.0}, {"E": ("store",)}),
    # Images encoded on two encoders at once.
    ("E=e0+e1:12.0ms;PD=pd0:30ms", {"E": 12.0, "PD": 30.0}, {"E": ("e0", "e1")}),
    # A merged prefill+decode instance, still streaming.
    ("PD=pd0", {}, {"PD": ("pd0",)}),
    # Text-only request with encode skipped by the proxy.
    ("E=skipped;P=p0:1.5ms", {"P": 1.5}, {"E": ("skipped",)}),
    # Unknown keys and empty parts are ignored; whitespace and key case do not matter.
    (" e = e0 : 2ms ;;X=1;FOO;P=p0:3ms:extra=9", {"E": 2.0, "P": 3.0}, {"E": ("e0",)}),
])
def test_stage_variants(header, stage_ms, instances):
    b = stages.parse(header)
    assert b.stage_ms() == pytest.approx(stage_ms)
    for stage, names in instances.items():
        assert [v.instances for v in b.visits if v.stage == stage] == [names]


def test_retried_stage_counts_the_failed_attempt_time_and_marks_it():
    b = stages.parse("P=p0!:3.0ms;P=p1:40ms;D=d0:10ms")
    assert [(v.instances, v.failed) for v in b.visits if v.stage == "P"] == [
        (("p0",), True), (("p1",), False)]
    assert b.stage_ms() == {"P": 43.0, "D": 10.0}
    # A retry whose answering attempt is still streaming has no time at all.
    assert stages.parse("D=d0!:2ms;D=d1").stage_ms() == {}


@pytest.mark.parametrize("header", [
    None, "", ";;;", "garbage", "hello world", "X=1;Y=2", "E=", "E=:12ms", "E=+:1ms",
    "KV=", "IMG=", "=e0:1ms",
])
def test_garbage_gives_no_breakdown(header):
    assert stages.parse(header) is None


@pytest.mark.parametrize("header, expected", [
    ("E=e0:abcms", {}),  # a time that is not a number
    ("E=e0:12.3", {}),  # no unit
    ("E=e0:-4ms", {}),  # negative
    ("E=e0:nanms", {}),
    ("E=e0:1e3ms", {"E": 1000.0}),
])
def test_bad_times_leave_the_instance_but_drop_the_time(header, expected):
    b = stages.parse(header)
    assert b.visits[0].instances == ("e0",) and b.stage_ms() == expected


def test_kv_with_bad_and_unknown_fields():
    b = stages.parse("KV=failed:bytes=xB:transfer=2.5ms:exposed=oops:groups=:new=1")
    assert b.kv == {"outcome": "failed", "transfer_ms": 2.5}
    assert b.visits == () and b.stage_ms() == {}


def test_summarize_counts_instances_retries_kv_and_images():
    headers = [
        "E=e0:10ms;P=p0:20ms;D=d0:100ms;KV=done:bytes=100B:transfer=1.0ms:exposed=0.0ms;IMG=ref",
        "E=e1:30ms;P=p0!:5ms;P=p1:20ms;D=d0;KV=done:bytes=300B:transfer=3.0ms:exposed=1.0ms;IMG=ref",
        "E=store:0.0ms;P=p1:20ms;D=d0:50ms;IMG=pixels",
        "E=e0+e1:20ms;P=p1:20ms;D=d0:50ms;KV=failed;IMG=recompute",
    ]
    out = stages.summarize([stages.parse(h) for h in headers] + [None])
    assert out["requests"] == 4
    assert list(out["stages"]) == ["E", "P", "D"]
    e = out["stages"]["E"]
    assert e["count"] == 4 and e["mean_ms"] == pytest.approx(15.0)
    assert e["p50_ms"] == pytest.approx(15.0)
    # e0 and e1 each served two (one of them together); the store one.
    assert {n: (i["served"], i["share"]) for n, i in e["instances"].items()} == {
        "e0": (2, 0.4), "e1": (2, 0.4), "store": (1, 0.2)}
    p = out["stages"]["P"]
    assert p["failed_attempts"] == 1 and p["requests"] == 4
    assert p["instances"]["p0"] == {"served": 1, "share": 0.25, "failed": 1}
    assert p["instances"]["p1"]["served"] == 3
    # 20, 5+20 (the failed attempt counts), 20, 20
    assert (p["mean_ms"], p["p50_ms"]) == pytest.approx((21.25, 20.0))
    d = out["stages"]["D"]
    assert d["requests"] == 4 and d["count"] == 3  # one was still streaming
    assert out["kv"]["requests"] == 3
    assert out["kv"]["outcomes"] == {"done": 2, "failed": 1}
    assert out["kv"]["transfer_ms"]["count"] == 2
    assert out["kv"]["transfer_ms"]["mean_ms"] == pytest.approx(2.0)
    assert out["kv"]["exposed_ms"]["p99_ms"] == pytest.approx(0.99)
    assert out["kv"]["mean_bytes"] == pytest.approx(200.0)
    assert out["images"] == {"ref": 2, "pixels": 1, "recompute": 1}


def test_no_header_means_no_breakdown():
    assert stages.summarize([None, None]) is None
    assert stages.summarize([]) is None


def record(i: int, header: str | None, ok: bool = True) -> RequestRecord:
    r = RequestRecord(i, True, 0.1 * i)
    r.sent = 0.1 * i
    r.token_times = [r.sent + 0.05, r.sent + 0.06]
    r.first_token = r.token_times[0]
    r.end = r.token_times[-1]
    r.output_tokens = 2
    r.error = None if ok else "HTTP 502: bad"
    r.stages_header = header
    return r


def test_run_summary_uses_successful_requests_only():
    records = [record(0, FULL), record(1, "E=e9:999ms;P=p9:1ms", ok=False), record(2, None)]
    summary = summarize(records, SLO())
    breakdown = summary["stage_breakdown"]
    assert breakdown["requests"] == 1
    assert list(breakdown["stages"]["E"]["instances"]) == ["e0"]
    assert summarize([record(0, None)], SLO())["stage_breakdown"] is None
    row = records[0].to_row()
    assert row["E_ms"] == 12.3 and row["D_ms"] == 88.0 and row["PD_ms"] is None
    assert row["kv_transfer_ms"] == 0.5 and row["images"] == "ref"
    assert row["stages_header"] == FULL
    assert set(records[2].to_row()) == set(row)  # same CSV columns with or without it


def result(label: str, rate: float, headers: list[str | None]) -> RunResult:
    records = [record(i, h) for i, h in enumerate(headers)]
    summary = summarize(records, SLO(), 1, rate)
    summary.update({"label": label, "rate": rate})
    return RunResult(label, rate, summary, records)


def test_report_shows_the_breakdown(tmp_path):
    spec = LoadSpec(url="http://x", model="m", workload="tiny-mm", num_requests=3)
    results = [
        result("E-P-D", 1.0, [FULL, "E=e1:20ms;P=p0!:3.0ms;P=p1:40ms;D=d2;IMG=pixels", FULL]),
        result("E-P-D", 2.0, [FULL] * 3),
        result("bare vLLM", 1.0, [None] * 3),
    ]
    out = write_report(results, tmp_path / "r", spec)

    data = json.loads((out / "results.json").read_text())
    first = data["runs"][0]["summary"]["stage_breakdown"]
    assert first["stages"]["P"]["failed_attempts"] == 1
    assert first["stages"]["E"]["instances"]["e0"]["share"] == pytest.approx(2 / 3)
    assert first["images"] == {"ref": 2, "pixels": 1}
    assert data["runs"][2]["summary"]["stage_breakdown"] is None
    assert data["runs"][0]["requests"][1]["P_ms"] == 43.0

    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    # Each run's row is followed by its modality's (all image requests here).
    assert [r["deployment"] for r in rows[:2]] == ["E-P-D", "E-P-D [image]"]
    assert float(rows[2]["E p50 ms"]) == pytest.approx(12.3)
    assert float(rows[2]["KV transfer p50 ms"]) == pytest.approx(0.5)
    assert rows[4]["E p50 ms"] == ""

    html = (out / "report.html").read_text()
    assert "Per stage" in html and "E-P-D @ 1.0 req/s" in html
    assert "e0 67% (2), e1 33% (1)" in html and "failed: p0 1" in html
    assert "images travelled as: ref 2, pixels 1" in html
    assert "KV transfer" in html and "KV exposed" in html
    assert "bare vLLM @ 1.0 req/s" not in html  # its run has no breakdown table
    assert html.count('alt="stages.png"') == 1
    assert (out / "stages.png").stat().st_size > 0


def test_report_without_any_header_has_no_stage_section(tmp_path):
    spec = LoadSpec(url="http://x", model="m", workload="tiny-mm", num_requests=2)
    out = tmp_path / "r"
    out.mkdir()
    (out / "stages.png").write_bytes(b"stale")  # from an earlier report in the same folder
    write_report([result("bare", 1.0, [None, None])], out, spec)
    assert not (out / "stages.png").exists()
    assert "Per stage" not in (out / "report.html").read_text()


def test_one_line_summary_mentions_stage_p50():
    line = _one_line("x", 1.0, result("x", 1.0, [FULL]).summary)
    assert "stage p50 E 12.3, P 40.1, D 88.0 ms" in line
    assert "stage p50" not in _one_line("x", 1.0, result("x", 1.0, [None]).summary)


def test_client_records_the_header_of_each_answer():
    app = FastAPI()
    answers = iter([FULL, None])

    @app.post("/v1/chat/completions")
    async def chat():
        async def events():
            yield 'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
            yield "data: [DONE]\n\n"
        header = next(answers)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={stages.HEADER: header} if header else None)

    with ThreadedServer(app) as server:
        records = run(run_schedule(server.url + "/v1/chat/completions", [b"{}"] * 2,
                                   [0.0, 0.2], [False] * 2))
    assert all(r.ok for r in records)
    assert records[0].stages_header == FULL
    assert records[0].stage_breakdown.stage_ms()["P"] == 40.1
    assert records[1].stages_header is None and records[1].stage_breakdown is None
