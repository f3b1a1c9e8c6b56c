"""Workloads, the load generator against the fake server, and the report files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from epd_serve.bench import workloads
from epd_serve.bench.client import run, run_schedule
from epd_serve.bench.timings import SLO
from epd_serve.bench.report import write_report
from epd_serve.bench.runner import Bodies, LoadSpec, find_goodput, sweep
from epd_serve.cli.bench import add_bench_parser  # noqa: F401  (import check)
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app


def test_sharegpt4o_preset_shape():
    specs = workloads.PRESETS["sharegpt4o"].requests(2000, seed=3)
    assert all(len(s.images) == 1 for s in specs)
    widths = [s.images[0].width for s in specs]
    heights = [s.images[0].height for s in specs]
    assert np.mean(widths) == pytest.approx(802, rel=0.02)
    assert np.mean(heights) == pytest.approx(652, rel=0.02)
    assert np.mean([len(s.text.split()) for s in specs]) == pytest.approx(9.6, rel=0.05)
    assert {s.max_tokens for s in specs} == {64}


def test_visualwebinstruct_is_half_text_only_with_720p_images():
    specs = workloads.PRESETS["visualwebinstruct"].requests(2000, seed=4)
    assert np.mean([s.multimodal for s in specs]) == pytest.approx(0.5, abs=0.03)
    assert {(i.width, i.height) for s in specs for i in s.images} == {(1280, 720)}
    assert np.mean([len(s.text.split()) for s in specs]) == pytest.approx(63.1, rel=0.03)


def test_images_per_request_range():
    wl = workloads.SyntheticWorkload("x", 5, 1.0, (64, 64), images_per_request=(2, 4))
    counts = {len(s.images) for s in wl.requests(300)}
    assert counts == {2, 3, 4}


def test_aisbench_jsonl_sharegpt_and_folder(tmp_path):
    Image.new("RGB", (40, 30), (1, 2, 3)).save(tmp_path / "a.png")
    Image.new("RGB", (40, 30), (4, 5, 6)).save(tmp_path / "b.jpg")
    jsonl = tmp_path / "mm.jsonl"
    jsonl.write_text(json.dumps({"type": "image", "path": ["a.png", "b.jpg"],
                                 "question": "what?", "answer": "x"}) + "\n")
    (spec,) = workloads.aisbench_jsonl(jsonl, 8)
    assert spec.text == "what?" and len(spec.images) == 2 and spec.max_tokens == 8
    assert spec.images[0].data_url().startswith("data:image/png;base64,")

    share = tmp_path / "sg.json"
    share.write_text(json.dumps([{"image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nDescribe"}, {"from": "gpt", "value": "one two three"}]}]))
    (spec,) = workloads.sharegpt_json(share, None)
    assert spec.text == "Describe" and spec.max_tokens == 3 and len(spec.images) == 1

    specs = workloads.load_workload(str(tmp_path), 5, 16)
    assert [len(s.images) for s in specs] == [1] * 5  # two files cycled to five requests
    assert [s.index for s in specs] == [0, 1, 2, 3, 4]


def test_bad_dataset_lines_are_reported_with_their_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "image", "path": ["missing.png"], "question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: image .*missing.png not found"):
        workloads.aisbench_jsonl(bad, 8)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.load_workload("nope.txt", 3, 8)


def test_bodies_are_streaming_chat_requests():
    specs = workloads.PRESETS["tiny-mm"].requests(6, seed=1)
    bodies = [json.loads(b) for b in workloads.build_bodies(specs, "m")]
    assert all(b["stream"] and b["stream_options"]["include_usage"] for b in bodies)
    assert all(b["ignore_eos"] and b["max_tokens"] == 16 for b in bodies)
    mm = [b for b, s in zip(bodies, specs) if s.multimodal]
    assert mm and all(b["messages"][0]["content"][0]["type"] == "image_url" for b in mm)


def test_client_times_each_chunk_against_the_fake_server():
    app = create_fake_app("fake", ttft_ms=30, itl_ms=10)
    with ThreadedServer(app) as server:
        bodies = [json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()] * 4
        records = run(run_schedule(server.url + "/v1/chat/completions", bodies,
                                   [0.0, 0.05, 0.1, 0.15], [False] * 4))
    assert all(r.ok for r in records)
    for r in records:
        assert r.output_tokens == 5 and len(r.token_times) == 5
        assert 0.025 <= r.ttft <= 0.5
        # Each chunk stamped when it came, 10 ms apart: a client held off the CPU may
        # read two at once (one gap ~0), so the gaps are judged together, not each.
        assert 0.03 <= r.token_times[-1] - r.token_times[0] <= 1.0
        assert 0.005 <= float(np.median(r.itls)) <= 0.3
        assert abs(r.send_lag) < 0.02
    assert [round(r.scheduled, 2) for r in records] == [0.0, 0.05, 0.1, 0.15]


def test_client_records_failures_with_reasons():
    app = create_fake_app("fake", fail_status=503)
    with ThreadedServer(app) as server:
        records = run(run_schedule(server.url + "/v1/chat/completions", [b"{}"], [0.0], [False]))
    (r,) = records
    assert not r.ok and r.error.startswith("HTTP 503")
    dead = run(run_schedule("http://127.0.0.1:9/v1/chat/completions", [b"{}"], [0.0], [False]))
    assert not dead[0].ok and "Connect" in dead[0].error


def test_concurrency_cap_limits_requests_in_flight():
    app = create_fake_app("fake", ttft_ms=100)
    with ThreadedServer(app) as server:
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": 1, "stream": True}).encode()
        records = run(run_schedule(server.url + "/v1/chat/completions", [body] * 6, [0.0] * 6,
                                   [False] * 6, max_concurrency=2))
    starts = sorted(r.sent for r in records)
    # Three waves of two: the 3rd and 5th requests wait for a free slot (~100 ms each).
    assert starts[2] - starts[0] >= 0.09 and starts[4] - starts[0] >= 0.18


def test_sweep_goodput_and_report_files(tmp_path):
    app = create_fake_app("fake", ttft_ms=5, itl_ms=2)
    with ThreadedServer(app) as server:
        spec = LoadSpec(url=server.url, model="fake", workload="tiny-mm", num_requests=12,
                        output_tokens=4, process="poisson", slo=SLO(1000, 50), num_devices=2)
        from rich.console import Console

        console = Console(quiet=True)
        bodies = Bodies(spec, console)
        results = sweep(spec, [5.0, 10.0], "fake (P-D)", console, bodies)
        goodput, runs = find_goodput(spec, 5.0, 20.0, label="fake (P-D)", console=console,
                                     bodies=bodies)
    assert goodput == 20.0 and len(runs) == 2  # both ends pass: no search needed
    assert [r.summary["per_device"]["request_rate"] for r in results] == [2.5, 5.0]
    out = write_report(results + runs, tmp_path / "r", spec, {"fake (P-D)": goodput})
    for name in ("results.json", "summary.csv", "requests.csv", "vs_rate.png",
                 "ttft_tpot.png", "report.html"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4 and len(data["runs"][0]["requests"]) == 12
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "fake (P-D)" in html
    # A header, then per run its row and its text and image rows.
    assert (out / "summary.csv").read_text().count("\n") == 1 + 4 * 3


def test_goodput_search_finds_the_knee():
    """A server whose TTFT grows with load: the search narrows to the knee."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    state = {"inflight": 0}

    @app.post("/v1/chat/completions")
    async def chat():
        async def events():
            state["inflight"] += 1
            try:
                # Every concurrent request adds 60 ms to the first token.
                await asyncio.sleep(0.06 * state["inflight"])
                yield 'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1
        return StreamingResponse(events(), media_type="text/event-stream")

    with ThreadedServer(app) as server:
        spec = LoadSpec(url=server.url, model="m", workload="text", num_requests=16,
                        output_tokens=1, process="fixed", slo=SLO(ttft_ms=250, tpot_ms=50))
        from rich.console import Console

        goodput, runs = find_goodput(spec, 4.0, 64.0, iterations=4,
                                     console=Console(quiet=True))
    assert goodput is not None and 4.0 <= goodput < 64.0
    assert len(runs) == 2 + 4
    passing = [r.rate for r in runs if r.summary["slo_attainment"] >= 0.9]
    assert max(passing) == goodput
