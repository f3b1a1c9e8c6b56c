"""Where a request's time went (bench/waterfall.py's parts), from a timeline built here:
the stage of several hops at once, the proxy's own work before its first hop, and the
order and table the benchmarks print them in."""

from __future__ import annotations

import pytest

from epd_serve.bench import waterfall

MS = 1_000_000  # ns


def span(name: str, start_ms: float, end_ms: float, source: str = "proxy",
         span_id: str | None = None, parent: str | None = None, **attrs) -> dict:
    return {"name": name, "source": source, "start_ns": int(start_ms * MS),
            "end_ns": int(end_ms * MS), "span_id": span_id, "parent_id": parent,
            "attrs": attrs, "events": []}


def engine(hop_id: str, name: str, start_ms: float, phases: dict[str, float]) -> list[dict]:
    """vLLM's span of one request under the hop `hop_id`, its phases back to back."""
    spans, at = [], start_ms
    for phase, ms in phases.items():
        spans.append(span(phase, at, at + ms, name, parent=f"{name}-llm"))
        at += ms
    return [span(waterfall.ENGINE_SPAN, start_ms, at, name, f"{name}-llm", hop_id), *spans]


def video_timeline() -> dict:
    """A video request: the proxy decodes it for 12 ms, two encoder hops run at once
    (the second ends last), then prefill, then decode."""
    spans = [
        span("request", 0, 200, span_id="req"),
        span("E hop", 12, 90, span_id="e-a", parent="req"),
        span("E hop", 13, 110, span_id="e-b", parent="req"),
        span("E hop", 14, 20, span_id="e-failed", parent="req", failed=True),
        span("P hop", 111, 150, span_id="p", parent="req"),
        span("D hop", 120, 199, span_id="d", parent="req"),
        *engine("e-a", "e0", 13, {"preprocess": 30, "queue": 0, "prefill": 40}),
        *engine("e-b", "e0", 14, {"preprocess": 50, "queue": 5, "prefill": 40}),
        *engine("p", "p0", 112, {"preprocess": 8, "queue": 0, "prefill": 28}),
        span("features load", 111, 121, "p0", parent="p"),
        span("features load", 112, 125, "p0", parent="p"),
        *engine("d", "d0", 121, {"preprocess": 6, "queue": 20, "prefill": 10, "decode": 40}),
    ]
    return {"spans": spans}


def test_a_stage_of_hops_at_once_counts_its_wall_time_and_the_hop_that_ended_last():
    parts = waterfall.stage_parts(video_timeline())
    # 12 -> 110 ms: the two hops' union, not their sum (78 + 97); the failed one is out.
    assert parts["E hop"] == pytest.approx(98.0)
    # The phases are the hop the prefill waited for (ended at 110), not the other one.
    assert parts["E preprocess"] == pytest.approx(50.0)
    assert parts["E queue"] == pytest.approx(5.0)
    assert parts["E outside engine"] == pytest.approx(97.0 - 95.0)
    # One hop: as before; a connector's spans add up (a load per image).
    assert parts["P hop"] == pytest.approx(39.0)
    assert parts["P prefill"] == pytest.approx(28.0)
    assert parts["P features load"] == pytest.approx(23.0)
    assert parts["D decode"] == pytest.approx(40.0)
    assert parts["total"] == pytest.approx(200.0)


def test_the_proxy_s_work_before_its_first_hop_is_a_part():
    parts = waterfall.stage_parts(video_timeline())
    assert parts["proxy before hops"] == pytest.approx(12.0)
    no_hop = {"spans": [span("request", 0, 5, span_id="req")]}  # refused before any hop
    assert waterfall.stage_parts(no_hop) == {"total": pytest.approx(5.0)}


def test_parts_print_in_request_order_in_a_table_wide_enough_for_its_names():
    parts = waterfall.stage_parts(video_timeline())
    order = sorted(parts, key=waterfall.part_order)
    assert order[0] == "proxy before hops"
    assert order[1:5] == ["E hop", "E preprocess", "E queue", "E prefill"]
    assert order.index("E outside engine") < order.index("P hop")
    assert order.index("D decode") < order.index("D outside engine") < order.index("total")
    name = "a deployment with a long name"
    lines = waterfall.parts_table([(name, parts), ("TP1", {"total": 150.0})])
    assert name in lines[0] and len(lines) == 1 + len(parts)
    total = next(line for line in lines if line.split()[0] == "total")
    assert total.split()[-2:] == ["200.0", "150.0"]
    decode = next(line for line in lines if line.strip().startswith("D decode"))
    assert decode.split()[-2:] == ["40.0", "-"]  # TP1's column has no such part
    assert len({len(line) for line in lines}) == 1  # columns line up
