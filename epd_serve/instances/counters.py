"""Reads what a vLLM instance says it did: Prometheus counters and its log.

Runs in the CLI, the demo and the tests (client side, httpx). Used to show and check,
per stage, where encoding, prefill and decoding really happened.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

EC_LOG_RE = re.compile(r"epd-ec (saved|loaded) mm_hash=(\S+)")


@dataclasses.dataclass(frozen=True)
class Counters:
    """Cumulative counters of one instance."""

    prompt_local: float = 0.0  # prompt tokens this instance computed itself
    prompt_external_kv: float = 0.0  # prompt tokens whose KV arrived from another instance
    prompt_cache_hit: float = 0.0
    generated: float = 0.0
    requests: float = 0.0
    ec_saved: int = 0  # encoder features this instance produced for others
    ec_loaded: int = 0  # encoder features it took from another instance
    kv_transfers: float = 0.0  # KV hand-offs our connector finished (sent or received)
    kv_failures: float = 0.0  # ... that failed (a decode instance then recomputed)
    ec_prefetched: float = 0.0  # features a prefetch hint brought before they were needed
    ec_encoded_locally: float = 0.0  # features missing from the MM Store, encoded here
    ec_unavailable: float = 0.0  # requests failed: feature missing and no image sent

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(**{
            f.name: getattr(self, f.name) - getattr(other, f.name)
            for f in dataclasses.fields(self)
        })


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum the samples we use across labels (engines), keyed by name[/source]."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if key == "vllm:prompt_tokens_by_source_total":
                key = f"{key}/{sample.labels.get('source')}"
            elif key == "epd_ec_features_total":
                key = f"{key}/{sample.labels.get('event')}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def ec_log_counts(log_path: Path | None) -> tuple[int, int]:
    if log_path is None or not log_path.is_file():
        return 0, 0
    saved = loaded = 0
    for match in EC_LOG_RE.finditer(log_path.read_text(errors="replace")):
        if match.group(1) == "saved":
            saved += 1
        else:
            loaded += 1
    return saved, loaded


def snapshot(url: str, log_path: Path | None = None, client: httpx.Client | None = None) -> Counters:
    client = client or httpx.Client(timeout=10.0)
    values = parse_prometheus(client.get(url + "/metrics").text)
    saved, loaded = ec_log_counts(log_path)
    source = "vllm:prompt_tokens_by_source_total/"
    return Counters(
        prompt_local=values.get(source + "local_compute", 0.0),
        prompt_external_kv=values.get(source + "external_kv_transfer", 0.0),
        prompt_cache_hit=values.get(source + "local_cache_hit", 0.0),
        generated=values.get("vllm:generation_tokens_total", 0.0),
        requests=values.get("vllm:request_success_total", 0.0),
        ec_saved=saved,
        ec_loaded=loaded,
        kv_transfers=values.get("epd_kv_transfers_total", 0.0),
        kv_failures=values.get("epd_kv_failures_total", 0.0),
        ec_prefetched=values.get("epd_ec_features_total/prefetched", 0.0),
        ec_encoded_locally=values.get("epd_ec_features_total/encoded_locally", 0.0),
        ec_unavailable=values.get("epd_ec_features_total/unavailable", 0.0),
    )
