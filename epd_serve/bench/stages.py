"""The proxy's `x-epd-stages` header: parsed per request, aggregated per load run.

Imported by metrics.py (per request and per run) and report.py (tables, plot). Pure
Python and numpy. The header reads, stages in pipeline order,
`E=e0:12.3ms;P=p1:40.1ms;D=d2:88.0ms;KV=done:bytes=65536B:transfer=0.5ms:exposed=0.0ms:groups=2;IMG=ref`.
It is the proxy's debugging aid, not a contract, so parsing never raises: parts it
cannot read are skipped, and a header with nothing readable gives no breakdown.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

HEADER = "x-epd-stages"
# Stage labels in pipeline order. PD is a merged prefill+decode instance; EP and EPD
# are merged roles the instance table allows.
STAGES: tuple[str, ...] = ("E", "EP", "EPD", "P", "D", "PD")
KV_TIMINGS: tuple[str, ...] = ("transfer_ms", "exposed_ms")


@dataclasses.dataclass(frozen=True)
class StageVisit:
    """One attempt at one stage: `P=p0!:3.0ms` is a failed attempt on p0."""

    stage: str
    instances: tuple[str, ...]  # several when images were encoded on encoders at once
    ms: float | None  # None: the stage was still streaming when headers were sent
    failed: bool = False


@dataclasses.dataclass(frozen=True)
class StageBreakdown:
    """Everything one request's header said."""

    visits: tuple[StageVisit, ...] = ()
    kv: dict = dataclasses.field(default_factory=dict)  # outcome, bytes, transfer_ms, exposed_ms, groups
    images: str | None = None  # how images reached P and D: ref, pixels, recompute

    def stage_ms(self) -> dict[str, float]:
        """Milliseconds the request spent in each stage. A retried stage counts its
        failed attempts too (the request waited for them); a stage whose answering
        attempt was still streaming has no time."""
        out: dict[str, float] = {}
        for stage in STAGES:
            times = [v.ms for v in self.visits if v.stage == stage]
            if times and all(t is not None for t in times):
                out[stage] = float(sum(times))
        return out


def parse(header: str | None) -> StageBreakdown | None:
    """The breakdown a header gives, or None when it gives none (absent or garbage)."""
    if not header:
        return None
    visits: list[StageVisit] = []
    kv: dict = {}
    images = None
    for part in header.split(";"):
        key, sep, value = part.partition("=")
        key, value = key.strip().upper(), value.strip()
        if not sep or not value:
            continue
        if key in STAGES:
            visit = _visit(key, value)
            if visit is not None:
                visits.append(visit)
        elif key == "KV":
            kv = _kv(value)
        elif key == "IMG":
            images = value
    if not visits and not kv and images is None:
        return None
    return StageBreakdown(tuple(visits), kv, images)


def _visit(stage: str, value: str) -> StageVisit | None:
    who, *fields = value.split(":")
    who = who.strip()
    failed = who.endswith("!")
    instances = tuple(name.strip() for name in who.rstrip("!").split("+") if name.strip())
    if not instances:
        return None
    ms = next((t for t in (_number(f, "ms") for f in fields) if t is not None), None)
    return StageVisit(stage, instances, ms, failed)


def _kv(value: str) -> dict:
    out: dict = {}
    for field in value.split(":"):
        name, sep, raw = field.partition("=")
        name = name.strip()
        if not sep:
            if name and "outcome" not in out:
                out["outcome"] = name
        elif name == "bytes":
            number = _number(raw, "B")
            if number is not None:
                out["bytes"] = int(number)
        elif name in ("transfer", "exposed"):
            number = _number(raw, "ms")
            if number is not None:
                out[f"{name}_ms"] = number
        elif name == "groups":
            number = _number(raw, "")
            if number is not None:
                out["groups"] = int(number)
    return out


def _number(text: str, unit: str) -> float | None:
    """`12.3ms` -> 12.3 for unit "ms"; None for anything else, negatives and nan too."""
    text = text.strip()
    if unit:
        if not text.endswith(unit):
            return None
        text = text[: -len(unit)]
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def timing_stats(values: list[float]) -> dict:
    """count, mean, p50, p99 in ms (None when there is nothing to measure)."""
    if not values:
        return {"count": 0, "mean_ms": None, "p50_ms": None, "p99_ms": None}
    arr = np.asarray(values, dtype=float)
    return {"count": int(arr.size), "mean_ms": float(arr.mean()),
            "p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99))}


def summarize(breakdowns: list[StageBreakdown | None]) -> dict | None:
    """The per-stage breakdown of a run's requests, or None when no request carried
    the header (a run straight against a vLLM instance).

    stages: per stage (pipeline order, only those seen) the timing stats, how many
    requests went through it, failed attempts, and per instance the requests it served
    and its share of them (an encode split over e0+e1 credits both).
    kv: hand-off outcomes and transfer/exposed timing stats. images: IMG= counts.
    """
    seen = [b for b in breakdowns if b is not None]
    if not seen:
        return None
    per_request = [b.stage_ms() for b in seen]
    stages: dict[str, dict] = {}
    for stage in STAGES:
        visits = [v for b in seen for v in b.visits if v.stage == stage]
        if not visits:
            continue
        served = Counter(name for v in visits if not v.failed for name in v.instances)
        failed = Counter(name for v in visits if v.failed for name in v.instances)
        total = sum(served.values())
        instances = {
            name: {"served": served[name], "share": served[name] / total if total else 0.0,
                   "failed": failed[name]}
            for name in sorted(served.keys() | failed.keys(), key=lambda n: (-served[n], n))
        }
        times = [ms[stage] for ms in per_request if stage in ms]
        stages[stage] = {
            **timing_stats(times),
            "requests": sum(1 for b in seen if any(v.stage == stage for v in b.visits)),
            "failed_attempts": sum(1 for v in visits if v.failed),
            "instances": instances,
        }
    with_kv = [b.kv for b in seen if b.kv]
    kv = None
    if with_kv:
        kv = {"requests": len(with_kv),
              "outcomes": dict(Counter(k.get("outcome", "?") for k in with_kv)),
              **{key: timing_stats([k[key] for k in with_kv if key in k]) for key in KV_TIMINGS}}
        sizes = [k["bytes"] for k in with_kv if "bytes" in k]
        kv["mean_bytes"] = float(np.mean(sizes)) if sizes else None
    return {"requests": len(seen), "stages": stages, "kv": kv,
            "images": dict(Counter(b.images for b in seen if b.images))}
