"""Per-request timings and their aggregates, named as AISBench names them.

Pure numpy. All times are seconds from monotonic clocks at the client; reports show
milliseconds. The SLO rule is the papers': a request meets its SLO when its TTFT is
under the TTFT SLO and at least 90% of its token gaps are under the TPOT (TBT) SLO.
Where the server is the epd-serve proxy, each record also keeps the proxy's per-stage
header, which stages.py parses and aggregates. Every run is also summarised per
modality (text, image, video): the latencies and the SLO attainment of each kind.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from epd_serve.bench import stages

STAT_NAMES = ("avg", "min", "max", "median", "p75", "p90", "p99")
GAP_QUANTILE = 0.9  # share of token gaps that must meet the TPOT SLO
GOODPUT_ATTAINMENT = 0.9  # goodput = highest rate with at least 90% SLO attainment
MODALITIES = ("text", "image", "video", "image+video")  # the order reports list them in


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    multimodal: bool
    scheduled: float  # planned send offset from the run's start
    sent: float = 0.0  # actual send offset
    first_token: float | None = None  # offset of the first content chunk
    token_times: list[float] = dataclasses.field(default_factory=list)  # offset per chunk
    end: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    stages_header: str | None = None  # the proxy's x-epd-stages; None from a bare engine
    trace_id: str | None = None  # the proxy's x-epd-trace-id: the request's timeline
    modality: str = ""  # workloads.RequestSpec.modality; "" takes it from `multimodal`

    def __post_init__(self):
        if not self.modality:  # callers that only know text from not-text
            self.modality = "image" if self.multimodal else "text"

    @property
    def stage_breakdown(self) -> stages.StageBreakdown | None:
        return stages.parse(self.stages_header)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def send_lag(self) -> float:
        return self.sent - self.scheduled

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks carrying tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def meets_slo(self, ttft_slo: float, tpot_slo: float) -> bool:
        if not self.ok or self.ttft is None or self.ttft > ttft_slo:
            return False
        gaps = self.itls
        if not gaps:
            return True
        within = sum(1 for g in gaps if g <= tpot_slo)
        return within >= GAP_QUANTILE * len(gaps)

    def to_row(self) -> dict:
        ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
        breakdown = self.stage_breakdown or stages.StageBreakdown()
        stage_ms = breakdown.stage_ms()
        # Same keys in every row: requests.csv takes its columns from the first one.
        per_stage = {f"{stage}_ms": stage_ms.get(stage) for stage in stages.STAGES}
        per_stage.update({f"kv_{key}": breakdown.kv.get(key) for key in stages.KV_TIMINGS})
        return {
            "index": self.index, "multimodal": self.multimodal, "modality": self.modality,
            "ok": self.ok,
            "error": self.error, "scheduled_s": round(self.scheduled, 6),
            "send_lag_ms": ms(self.send_lag), "ttft_ms": ms(self.ttft),
            "tpot_ms": ms(self.tpot), "e2el_ms": ms(self.e2el),
            "itl_mean_ms": ms(float(np.mean(self.itls))) if self.itls else None,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            **per_stage, "images": breakdown.images, "stages_header": self.stages_header,
        }


def stats(values: list[float] | np.ndarray, scale: float = 1.0) -> dict[str, float | None]:
    """avg, min, max, median, P75, P90, P99 (None when there is nothing to measure)."""
    arr = np.asarray(values, dtype=float) * scale
    if arr.size == 0:
        return {name: None for name in STAT_NAMES}
    return {
        "avg": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max()),
        "median": float(np.percentile(arr, 50)), "p75": float(np.percentile(arr, 75)),
        "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99)),
    }


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_ms: float = 2000.0
    tpot_ms: float = 50.0


def summarize(records: list[RequestRecord], slo: SLO, num_devices: int = 1,
              target_rate: float | None = None) -> dict:
    """The aggregate report of one load run."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if records:
        start = min(r.sent for r in records)
        end = max((r.end for r in ok), default=max(r.sent for r in records))
        duration = max(end - start, 1e-9)
    else:
        duration = 1e-9
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    meeting = [r for r in ok if r.meets_slo(slo.ttft_ms / 1e3, slo.tpot_ms / 1e3)]
    good_tokens = sum(r.output_tokens for r in meeting)
    sends = sorted(r.sent for r in records)
    send_span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    summary = {
        "duration_s": duration,
        "total_requests": len(records),
        "success_requests": len(ok),
        "failed_requests": len(failed),
        "failure_reasons": dict(Counter(_reason(r.error) for r in failed)),
        "multimodal_requests": sum(1 for r in records if r.multimodal),
        "concurrency": sum(r.e2el for r in ok) / duration,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": in_tokens / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prefill_token_throughput": (in_tokens / sum(r.ttft for r in ok)) if ok else 0.0,
        **latency_stats(ok),
        "slowest_over_median": slowest_over_median(ok),
        "input_tokens": stats([r.input_tokens for r in ok]),
        "output_tokens": stats([r.output_tokens for r in ok]),
        "slo": dataclasses.asdict(slo),
        "slo_attainment": len(meeting) / len(records) if records else 0.0,
        "effective_throughput": good_tokens / duration,  # output tok/s of SLO-meeting requests
        "num_devices": num_devices,
        "target_rate": target_rate,
        "achieved_rate": (len(sends) - 1) / send_span if send_span > 0 else None,
        "send_lag_ms": stats([r.send_lag for r in records], 1e3),
        # Successful requests only, like the latencies above; None without the header.
        "stage_breakdown": stages.summarize([r.stage_breakdown for r in ok]),
        "by_modality": by_modality(records, slo, duration),
    }
    summary["per_device"] = {
        "request_rate": None if target_rate is None else target_rate / num_devices,
        "request_throughput": summary["request_throughput"] / num_devices,
        "output_token_throughput": summary["output_token_throughput"] / num_devices,
        "effective_throughput": summary["effective_throughput"] / num_devices,
    }
    return summary


def latency_stats(ok: list[RequestRecord]) -> dict[str, dict]:
    """TTFT, TPOT, ITL and E2EL statistics (ms) of successful requests."""
    return {"ttft_ms": stats([r.ttft for r in ok], 1e3),
            "tpot_ms": stats([r.tpot for r in ok if r.tpot is not None], 1e3),
            "itl_ms": stats([g for r in ok for g in r.itls], 1e3),
            "e2el_ms": stats([r.e2el for r in ok], 1e3)}


def by_modality(records: list[RequestRecord], slo: SLO, duration: float) -> dict[str, dict]:
    """The run's summary per modality present, keyed as the run's own summary is
    (throughputs over the whole run's duration, so the kinds' rates add up)."""
    out = {}
    present = {r.modality for r in records}
    for modality in [m for m in MODALITIES if m in present] + sorted(present - set(MODALITIES)):
        mine = [r for r in records if r.modality == modality]
        ok = [r for r in mine if r.ok]
        meeting = [r for r in ok if r.meets_slo(slo.ttft_ms / 1e3, slo.tpot_ms / 1e3)]
        out[modality] = {
            "total_requests": len(mine), "success_requests": len(ok),
            "failed_requests": len(mine) - len(ok),
            "slo_attainment": len(meeting) / len(mine),
            "request_throughput": len(ok) / duration,
            "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
            "effective_throughput": sum(r.output_tokens for r in meeting) / duration,
            **latency_stats(ok),
        }
    return out


def slowest_over_median(ok: list[RequestRecord]) -> dict[str, float | None]:
    """The slowest request's E2EL over the median's, of all requests and per kind:
    how far the tail strays from the typical request (1.0: none does)."""
    def ratio(values: list[float]) -> float | None:
        return float(max(values) / np.median(values)) if values else None

    return {"all": ratio([r.e2el for r in ok]),
            "text": ratio([r.e2el for r in ok if not r.multimodal]),
            "multimodal": ratio([r.e2el for r in ok if r.multimodal])}


def _reason(error: str | None) -> str:
    return (error or "no response").split(":")[0]
