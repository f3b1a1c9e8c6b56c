"""The proxy's Prometheus metrics, served on its /metrics.

Runs inside the proxy process; one registry per app (tests run several proxies in one
process). Hop latencies are observed where a hop's lease closes (upstream.py), request
outcomes where the route answers (routes_serving.py). The labelled series a request touches are
looked up through `child`, which keeps each one found: prometheus_client's own
`labels()` validates and locks on every call, a dozen times per request. What is in
flight (requests, body bytes, each instance's hops) is read from its owner when
/metrics is scraped, not set at each change: a request changes those counts a dozen
times, a scrape comes every few seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from epd_serve.proxy.state import InstanceState

# From a fast text prefill (ms) to a long decode (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# What a hop does, as the metric labels it.
HOP_STAGE = {"E": "encode", "P": "prefill", "D": "decode", "PD": "prefill_decode"}


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.hop_seconds = Histogram(
            "epd_proxy_stage_seconds", "Latency of one hop on one instance, by stage "
            "(encode, prefill, decode, prefill_decode), successful hops only.",
            ["stage", "instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_seconds = Histogram(
            "epd_proxy_kv_transfer_seconds", "KV transfer time prefill -> decode as the "
            "KV connector reports it.", ["instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token_seconds = Histogram(
            "epd_proxy_first_token_seconds", "From the request's arrival to the first byte "
            "of the answer relayed to the client.", ["instance"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.token_seconds = Histogram(
            "epd_proxy_token_seconds", "Mean time per streamed event after the first, per "
            "request.", ["instance"], buckets=TOKEN_BUCKETS, registry=r)
        self.requests_in_flight = Gauge("epd_proxy_requests_in_flight",
                                        "Client requests being served.", registry=r)
        self.requests = Counter("epd_proxy_requests_total", "Client requests answered, by "
                                "modality and HTTP status.", ["modality", "status"], registry=r)
        self.retries = Counter("epd_proxy_retries_total", "Hops sent again to another "
                               "instance, by stage.", ["stage"], registry=r)
        self.failures = Counter("epd_proxy_failures_total", "Requests that ended in an error, "
                                "by reason.", ["reason"], registry=r)
        self.hung = Counter("epd_proxy_instance_hung_total", "Times an instance was found "
                            "hung: silent past a deadline (proxy.deadlines) and to a /health "
                            "check; each time it was out of routing until a probe succeeded.",
                            ["instance"], registry=r)
        self.healthy = Gauge("epd_proxy_instance_healthy", "1 if routing may use the "
                             "instance.", ["instance"], registry=r)
        self.hung_seconds = Gauge("epd_proxy_instance_hung_seconds", "How long the instance "
                                  "has been there (its port open) but not answering: its "
                                  "/health, or its engine a one-token request; 0 while it "
                                  "answers or its port refuses. The supervisor restarts an "
                                  "instance hung too long.", ["instance"], registry=r)
        self.body_bytes_in_flight = Gauge(
            "epd_proxy_body_bytes_in_flight", "Bytes of request bodies the proxy holds "
            "(as admitted: Content-Length).", registry=r)
        self.refused = Counter("epd_proxy_refused_total", "Requests refused with 503 "
                               "before any work, by the proxy.limits setting they would "
                               "have passed.", ["limit"], registry=r)
        self.fallbacks = Counter(
            "epd_proxy_fallbacks_total", "Requests whose stage had no healthy instance and "
            "whose work another stage did instead, by the missing stage and the stand-in "
            "(P/D: decode computed the prompt; D/P: prefill decoded; E/P: prefill encoded).",
            ["missing", "standin"], registry=r)
        self.role = Gauge("epd_proxy_instance_role", "1 for the stage each instance serves "
                          "now (E, P, D, or merged roles like PD), 0 for the others it "
                          "served before a role switch.", ["instance", "role"], registry=r)
        self.switches = Counter(
            "epd_proxy_role_switches_total", "Role switches by instance, from, to and how "
            "they ended (done, abandoned: the drain outlasted role_drain_timeout_s, "
            "cancelled, failed: an error of the proxy's).", ["instance", "source", "target", "outcome"], registry=r)
        self.switch_seconds = Histogram(
            "epd_proxy_role_switch_seconds", "From a role switch's decision to the instance "
            "serving its new role (the drain of its hops in flight).",
            buckets=LATENCY_BUCKETS, registry=r)

        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """The series of `metric` with these label values (made on first use)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def hop_done(self, hop: str, instance: str, seconds: float) -> None:
        self.child(self.hop_seconds, HOP_STAGE.get(hop, hop), instance).observe(seconds)

    def count_in_flight(self, instances: Callable[[], Iterable[InstanceState]]) -> None:
        """Serve each instance's hops in flight, as `instances()` holds them when scraped."""
        self.registry.register(_InFlight(instances))

    def set_role(self, instance: str, roles: str) -> None:
        """The instance serves `roles` now; any role it served before reads 0."""
        for (metric, labels), child in self._children.items():
            if metric is self.role and labels[0] == instance:
                child.set(0)
        self.child(self.role, instance, roles).set(1)

    def forget(self, instance: str) -> None:
        """Drop the per-instance gauges of an instance that left the roster."""
        try:
            self.healthy.remove(instance)
        except KeyError:
            pass
        for (metric, labels) in list(self._children):
            if metric is self.role and labels[0] == instance:
                self.role.remove(*labels)
        self._children = {key: child for key, child in self._children.items()
                          if instance not in key[1]}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InFlight:
    """epd_proxy_instance_in_flight, a collector reading the live table (an instance
    that left the roster is no longer listed)."""

    def __init__(self, instances: Callable[[], Iterable[InstanceState]]):
        self.instances = instances

    def collect(self):
        family = GaugeMetricFamily("epd_proxy_instance_in_flight", "Hops in flight per "
                                   "instance (its queue as the proxy sees it).",
                                   labels=["instance"])
        for inst in self.instances():
            family.add_metric([inst.name], inst.in_flight)
        yield family
