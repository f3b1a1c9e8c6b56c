"""Reading request timelines (the proxy's /v1/traces/{id}, proxy/timeline.py): as a
waterfall of rows, as a terminal view and a PNG, and as the per-stage parts the load
tool's report and the latency benchmarks aggregate over many requests (their order
and table: `part_order`, `parts_table`).

A row is one span, placed relative to the moment the proxy received the request:
the request itself, each hop the proxy sent (E, P, D, PD), under a hop the spans its
engine exported (vLLM's request span; our connectors': a feature loaded, the KV
arriving), and under vLLM's span the engine's phases (preprocess, queue, prefill,
decode). Pure functions over the JSON, but for `fetch` and the PNG.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import httpx

from epd_serve.proxy.tenancy import ADMIN_KEY_HEADER

PHASES = ("preprocess", "queue", "prefill", "decode")
STAGES = ("E", "P", "D", "PD")  # hops in request order
HOP_PARTS = ("hop", *PHASES)  # a stage's row of parts, then its engine's phases
ENGINE_SPAN = "llm_request"  # vLLM's span of a request (the others are our connectors')
# What of the KV hand-off's report (on the decode hop) a waterfall row shows.
KV_NOTE = ("outcome", "bytes", "groups", "transfer_ms", "exposed_ms")
# Engines export their spans in batches every 200 ms (OTEL_BSP_SCHEDULE_DELAY, set by
# the HAL): the last requests' spans are in the proxy this long after they ended.
SPANS_SETTLE_S = 0.6


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    depth: int  # 0 the request, 1 a hop, 2 its engine, 3 an engine phase
    start_ms: float
    end_ms: float
    note: str = ""

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


class TraceNotFound(LookupError):
    pass


def fetch(proxy_url: str, key: str, api_key: str | None = None, timeout_s: float = 10.0,
          admin_key: str | None = None) -> dict:
    """One timeline from a running proxy, by its id (x-epd-trace-id) or request id
    ("last": the newest). Without API keys the list of requests and request ids are
    the operator's: `admin_key` opens them."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if admin_key:
        headers[ADMIN_KEY_HEADER] = admin_key
    with httpx.Client(base_url=proxy_url, timeout=timeout_s, headers=headers) as client:
        if key == "last":
            recent = client.get("/v1/traces", params={"last": 1})
            recent.raise_for_status()
            if not recent.json():
                raise TraceNotFound("the proxy has served no request yet")
            key = recent.json()[0]["id"]
        resp = client.get(f"/v1/traces/{key}")
    if resp.status_code == 404:
        raise TraceNotFound(resp.json().get("error", {}).get("message", resp.text))
    resp.raise_for_status()
    return resp.json()


def collect(proxy_url: str, records: list, timeout_s: float = 10.0,
            headers: dict[str, str] | None = None) -> dict | None:
    """The timelines of a load run's requests (records with a trace id), read back from
    the proxy (with the run's `headers`: its API key, the admin key) once their engines'
    spans have arrived: how many were found, how many carry engine spans, the median of
    each part (`median_parts`), and the timeline of the request whose E2EL is the
    median. None where no request went through our proxy."""
    traced = [r for r in records if getattr(r, "trace_id", None)]
    if not traced:
        return None
    time.sleep(SPANS_SETTLE_S)
    found = []
    with httpx.Client(base_url=proxy_url, timeout=timeout_s, headers=headers) as client:
        for rec in traced:
            try:
                resp = client.get(f"/v1/traces/{rec.trace_id}")
            except httpx.HTTPError:
                break  # the proxy went away: report what was read
            if resp.status_code == 200:
                found.append((rec, resp.json()))
    if not found:
        return {"requests": len(traced), "found": 0, "with_engine_spans": 0,
                "median_parts": {}, "median_request": None}
    by_e2el = sorted(found, key=lambda pair: pair[0].e2el)
    return {
        "requests": len(traced), "found": len(found),
        "with_engine_spans": sum(any(s["source"] != "proxy" for s in t["spans"])
                                 for _, t in found),
        "median_parts": median_parts([t for _, t in found]),
        "median_request": by_e2el[len(by_e2el) // 2][1],
    }


def rows(timeline: dict) -> list[Row]:
    """The waterfall, in the order a reader follows the request."""
    t0 = timeline["start_ns"]

    def at(ns: int) -> float:
        return (ns - t0) / 1e6

    spans = timeline["spans"]
    children = spans_by_parent(spans)
    out = []
    for span in spans:
        if span["source"] != "proxy":
            continue
        if span["name"] == "request":
            tokens = [ns for name, ns in span.get("events", []) if name == "relayed"]
            note = span["attrs"].get("stages", "")
            if len(tokens) > 1:
                gaps = [(b - a) / 1e6 for a, b in zip(tokens, tokens[1:])]
                note = (f"{len(tokens)} chunks relayed, first at {at(tokens[0]):.1f} ms, "
                        f"then every {statistics.median(gaps):.1f} ms (median)")
            out.append(Row("request (proxy)", 0, at(span["start_ns"]), at(span["end_ns"]),
                           note))
            continue
        attrs = span.get("attrs", {})
        first = next((ns for name, ns in span.get("events", []) if name == "first byte"), None)
        note = f"first byte at {at(first):.1f} ms" if first else ""
        kv = {k[3:]: v for k, v in attrs.items() if k.startswith("kv.") and k[3:] in KV_NOTE}
        if kv:
            note += ("; " if note else "") + "KV " + " ".join(f"{k}={v}" for k, v in kv.items())
        failed = " (failed)" if attrs.get("failed") else ""
        out.append(Row(f"{span['name']} -> {attrs.get('instance', '?')}{failed}", 1,
                       at(span["start_ns"]), at(span["end_ns"]), note))
        for engine in children.get(span.get("span_id") or "-", []):
            if engine["name"] in PHASES:
                continue
            out.append(Row(f"{engine['source']}: {engine['name']}", 2,
                           at(engine["start_ns"]), at(engine["end_ns"]),
                           _engine_note(engine["attrs"])))
            for phase in children.get(engine.get("span_id") or "-", []):
                out.append(Row(phase["name"], 3, at(phase["start_ns"]), at(phase["end_ns"])))
    return out


def spans_by_parent(spans: list[dict]) -> dict[str, list[dict]]:
    """Spans by their parent's span id ("" for none)."""
    children: dict[str, list[dict]] = {}
    for span in spans:
        children.setdefault(span.get("parent_id") or "", []).append(span)
    return children


def _engine_note(attrs: dict) -> str:
    prompt = attrs.get("gen_ai.usage.prompt_tokens")
    done = attrs.get("gen_ai.usage.completion_tokens")
    if prompt is not None:
        return f"{prompt} prompt, {done} generated tokens"
    if "epd.kv.outcome" in attrs:  # the KV connector's receive span
        return " ".join(f"{k}={attrs[f'epd.kv.{k}']}" for k in KV_NOTE if f"epd.kv.{k}" in attrs)
    if "epd.ec.source" in attrs:  # the MM Store connector's feature load
        return f"{attrs['epd.ec.source']}, {attrs.get('epd.ec.bytes', '?')} B"
    return ""


def stage_parts(timeline: dict) -> dict[str, float]:
    """Where one request's time went, in ms: each stage's hops as the proxy saw them
    ("P hop"), and inside them each engine phase ("P prefill", "D decode", ...) plus what
    the engine did not account for ("P outside engine": HTTP, the API server's own
    work, the answer's way back); "proxy before hops" is the proxy's own work before
    its first hop (parsing, checks, decoding a video). "total" is the request as the
    proxy served it.

    A stage whose hops run at once (an encoder's batches of images, a video's chunks)
    counts from its first hop's start to its last one's end, and its engine phases are
    those of the hop that ended last: the one the next stage waited for."""
    parts: dict[str, float] = {}
    by_parent = spans_by_parent(timeline["spans"])
    by_stage: dict[str, list[dict]] = {}
    received_ns = None
    for span in timeline["spans"]:
        if span["source"] != "proxy":
            continue
        if span["name"] == "request":
            parts["total"] = (span["end_ns"] - span["start_ns"]) / 1e6
            received_ns = span["start_ns"]
        elif not span.get("attrs", {}).get("failed"):
            by_stage.setdefault(span["name"].removesuffix(" hop"), []).append(span)
    for stage, hops in by_stage.items():
        parts[f"{stage} hop"] = (max(h["end_ns"] for h in hops)
                                 - min(h["start_ns"] for h in hops)) / 1e6
        last = max(hops, key=lambda h: h["end_ns"])
        _engine_parts(stage, last, by_parent, parts)
    if by_stage and received_ns is not None:
        first_ns = min(h["start_ns"] for hops in by_stage.values() for h in hops)
        parts["proxy before hops"] = max(0.0, (first_ns - received_ns) / 1e6)
    return parts


def _engine_parts(stage: str, hop: dict, by_parent: dict[str, list[dict]],
                  parts: dict[str, float]) -> None:
    """The spans the engine exported under `hop`, as parts of `stage`."""
    hop_ms = (hop["end_ns"] - hop["start_ns"]) / 1e6
    for child in by_parent.get(hop.get("span_id") or "-", []):
        child_ms = (child["end_ns"] - child["start_ns"]) / 1e6
        if child["name"] != ENGINE_SPAN:  # a connector's: the KV arriving, a feature load
            name = f"{stage} {child['name']}"
            parts[name] = parts.get(name, 0.0) + child_ms  # one load per image
            continue
        parts[f"{stage} outside engine"] = max(0.0, hop_ms - child_ms)
        for phase in by_parent.get(child.get("span_id") or "-", []):
            parts[f"{stage} {phase['name']}"] = (phase["end_ns"] - phase["start_ns"]) / 1e6


def part_order(part: str) -> tuple:
    """Sort key of a part: the proxy's work before its hops, then the hops in request
    order, each hop's row first, then its engine's phases in order, the connectors'
    spans, what lies outside the engine; the whole request last."""
    stage, _, rest = part.partition(" ")
    if stage == "proxy":
        return -1, 0, rest
    hop = STAGES.index(stage) if stage in STAGES else len(STAGES)
    if rest in HOP_PARTS:
        return hop, HOP_PARTS.index(rest), rest
    return hop, len(HOP_PARTS) + (rest == "outside engine"), rest


def parts_table(columns: list[tuple[str, dict[str, float]]]) -> list[str]:
    """The lines of a table with one row per part, in request order, and one column per
    (name, parts) given; '-' where a column has no such part."""
    width = max([10, *(len(name) + 2 for name, _ in columns)])
    parts = sorted({part for _, cells in columns for part in cells}, key=part_order)
    lines = [f"  {'part':28s}" + "".join(f"{name:>{width}s}" for name, _ in columns)]
    for part in parts:
        cells = [found.get(part) for _, found in columns]
        lines.append(f"  {part:28s}" + "".join(
            f"{'-' if ms is None else f'{ms:.1f}':>{width}s}" for ms in cells))
    return lines


def median_parts(timelines: list[dict]) -> dict[str, float]:
    """The median of each part over the requests that have it; a part missing from
    some (a text request has no E hop) is the median over those that have it."""
    samples: dict[str, list[float]] = {}
    for timeline in timelines:
        for name, ms in stage_parts(timeline).items():
            samples.setdefault(name, []).append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


def render(timeline: dict, width: int = 100):
    """A rich Table: one row per span, with a bar on the request's time axis."""
    from rich.table import Table
    from rich.text import Text

    waterfall = rows(timeline)
    total = max((r.end_ms for r in waterfall), default=1.0) or 1.0
    bar_width = max(16, width // 3)
    table = Table(title=f"request {timeline['request_id']} (trace {timeline['trace_id']}), "
                        f"status {timeline['status']}", title_justify="left")
    table.add_column("span", min_width=24)
    table.add_column("start", justify="right")
    table.add_column("ms", justify="right")
    table.add_column(f"0 .. {total:.0f} ms", no_wrap=True, min_width=bar_width)
    table.add_column("note", overflow="fold")
    for row in waterfall:
        lead = min(bar_width - 1, round(row.start_ms / total * bar_width))
        length = max(1, min(bar_width - lead, round(row.ms / total * bar_width)))
        style = ("bold", "cyan", "green", "yellow")[row.depth]
        bar = Text(" " * lead) + Text("█" * length, style=style)
        table.add_row("  " * row.depth + row.label, f"{row.start_ms:.1f}", f"{row.ms:.1f}",
                      bar, row.note)
    return table


def plot_parts(runs: list[tuple[str, dict]], path: Path) -> Path:
    """Where the median request's time goes, per run: for each hop a bar split into its
    engine phases and what lies outside the engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segments = ("outside engine", *PHASES)
    colors = dict(zip(segments, ("#bbbbbb", "#9467bd", "#d62728", "#1f77b4", "#2ca02c")))
    labels, lefts = [], []
    fig, ax = plt.subplots(figsize=(10, 0.45 * sum(
        1 + sum(1 for k in parts if k.endswith(" hop")) for _, parts in runs) + 1.2))
    y = 0
    seen: set[str] = set()
    for name, parts in runs:
        hops = [k.removesuffix(" hop") for k in parts if k.endswith(" hop")]
        for stage in sorted(hops, key=lambda h: "EPD".find(h[0])):
            left = 0.0
            for seg in segments:
                ms = parts.get(f"{stage} {seg}", 0.0)
                if ms <= 0:
                    continue
                ax.barh(y, ms, left=left, color=colors[seg],
                        label=seg if seg not in seen else None)
                seen.add(seg)
                left += ms
            labels.append(f"{name}: {stage} hop")
            lefts.append(y)
            y += 1
        ax.barh(y, parts.get("total", 0.0), color="#444444",
                label="request (proxy)" if "total" not in seen else None)
        seen.add("total")
        labels.append(f"{name}: whole request")
        lefts.append(y)
        y += 1.5
    ax.set_yticks(lefts)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms, median over the run's requests (each part its own median)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(timeline: dict, path: Path) -> Path:
    """The waterfall as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    waterfall = rows(timeline)
    colors = ("#444444", "#1f77b4", "#2ca02c", "#ff7f0e")
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(waterfall) + 1.2))
    for i, row in enumerate(waterfall):
        ax.barh(i, max(row.ms, 0.05), left=row.start_ms, color=colors[row.depth])
        ax.text(row.end_ms, i, f" {row.ms:.1f}", va="center", fontsize=7)
    ax.set_yticks(range(len(waterfall)))
    ax.set_yticklabels(["  " * r.depth + r.label for r in waterfall], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the proxy received the request")
    ax.set_title(f"request {timeline['request_id']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
