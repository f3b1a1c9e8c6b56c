"""What one request's trip through the stages looked like; the proxy sends it back
in the x-epd-stages header and writes it in its request log, e.g.
`E=e0:18.3ms;P=p1:31.8ms;D=d2;KV=done:bytes=393216B:transfer=1.6ms:exposed=0.0ms:groups=2;IMG=ref`
or, with every prefill instance down, `E=e0:18.3ms;D=d2:250.1ms;IMG=ref;FALLBACK=P>D`.
Parts: `<stage>=<instance>[!][:<ms>ms]` per hop, `KV=` (the hand-off's report), `IMG=`
(ref | keyed | pixels | recompute), `FALLBACK=<missing>><stand-in>[,...]` for stages whose
work another stage did because none of their instances was healthy, and
`SWITCHED=<instance>:<started as>><serves now>[,...]` for hops on instances a role switch
moved (roles.py), e.g. `D=e0;SWITCHED=e0:E>D`, and `WHOLE=<parameter>` where decode
computed the prompt itself because the request asked for what only the instance that
computes the prompt can give (prompt_logprobs, echo) (see `Trip.header`).

Pure data, filled in by upstream.py (each hop), encoding.py and the KV hand-offs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epd_serve.proxy.routing import RouteRequest


def _pipeline_order(record: "StageRecord") -> int:
    return "EPD".find(record.stage[0])


@dataclasses.dataclass
class StageRecord:
    stage: str  # the hop: E, P, D or PD
    instance: str  # several joined by '+' (images encoded on several encoders at once)
    ms: float | None = None  # None while the stage is still streaming
    failed: bool = False  # an attempt that failed and was retried elsewhere
    # For the request's timeline (timeline.py): the hop's span id, which its engine's
    # spans name as their parent, and wall-clock ns of send, first byte and end.
    span_id: str = ""
    sent_ns: int = 0
    first_byte_ns: int = 0
    done_ns: int = 0


@dataclasses.dataclass
class Trip:
    request_id: str
    multimodal: bool
    route: RouteRequest = RouteRequest()  # the request's size, for the P and D hops
    stages: list[StageRecord] = dataclasses.field(default_factory=list)
    kv: dict[str, Any] | None = None  # the KV hand-off's own report, where it gives one
    # How prefill and decode got the images: "ref" (feature references, no pixels),
    # "keyed" (the pixels tagged with their stored features' keys: feature_refs pixels),
    # "pixels", or "recompute" (references failed, then pixels); None for text.
    images: str | None = None
    retries: int = 0
    # Stages that had no healthy instance, each with the stage that did its work.
    stand_ins: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    final_hop: str | None = None  # the hop whose instance answers the client (D, PD, P)
    trace_id: str = ""  # W3C trace id: every hop's traceparent names it
    # Each image batch's encoder hop, for the timeline (`stages` holds one E record for
    # all of them, timed from the first send to the last answer).
    encodes: list[StageRecord] = dataclasses.field(default_factory=list)
    # Wall-clock ns at which the proxy relayed each streamed chunk to the client.
    relayed_ns: list[int] = dataclasses.field(default_factory=list)
    # Instance -> "E>D": hops ran on instances serving another role than they started as.
    switched: dict[str, str] = dataclasses.field(default_factory=dict)
    # The parameter for which decode computed the prompt itself, skipping prefill.
    whole_prompt: str | None = None

    def header(self) -> str:
        """Stages in pipeline order (prefill and decode may run at the same time);
        a failed attempt is marked with '!' after the instance. A stage done by another
        for want of a healthy instance is listed last, missing>stand-in, comma-separated:
        `FALLBACK=P>D` (decode computed the prompt), `FALLBACK=D>P` (prefill decoded),
        `FALLBACK=E>P` (prefill encoded the images; `E>D` when decode stood in for both)."""
        parts = [f"{rec.stage}={rec.instance}{'!' if rec.failed else ''}"
                 + (f":{rec.ms:.1f}ms" if rec.ms is not None else "")
                 for rec in sorted(self.stages, key=_pipeline_order)]
        if self.kv:
            kv = self.kv
            fields = [str(kv.get("outcome", "?"))]
            for key, unit in (("bytes", "B"), ("transfer_ms", "ms"), ("exposed_ms", "ms"),
                              ("groups", "")):
                if key in kv:
                    fields.append(f"{key.removesuffix('_ms')}={kv[key]}{unit}")
            parts.append("KV=" + ":".join(fields))
        if self.images:
            parts.append(f"IMG={self.images}")
        if self.whole_prompt:
            parts.append(f"WHOLE={self.whole_prompt}")
        if self.stand_ins:
            parts.append("FALLBACK=" + ",".join(
                f"{m}>{s}" for m, s in sorted(self.stand_ins, key=lambda p: "EPD".find(p[0]))))
        if self.switched:
            parts.append("SWITCHED=" + ",".join(f"{name}:{moved}" for name, moved
                                                in sorted(self.switched.items())))
        return ";".join(parts)
