"""The proxy's settings: what the deployment file says about routing, limits and keys
(`ProxySettings`, the `proxy:` section), and the whole typed config the launcher writes
for the proxy process (`ProxyConfig`: settings plus the instances and hand-offs).

Pure data (pydantic), validated once at start-up; nothing here runs per request.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epd_serve.protocols.registry import ProtocolName
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.scores import PRESETS, resolve

# A stage's routing policy: a preset by name, or scorer weights such as
# {hash-affinity: 1, least-loaded: 0.5} (names and formulas: proxy/scores.py).
Preset = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
Policy = Preset | dict[str, float]
STAGE_LETTERS = frozenset("EPD")
# What prefill and decode are sent for an image whose feature the MM Store holds, in
# the dialect of the engine they run: "embeds", a metadata-only `image_embeds` part (the
# image grid) with the image's uuid (vLLM 0.32, which takes it with --enable-mm-embeds);
# "pixels", the image itself with its uuid (vLLM 0.23 needs the tensor in an
# `image_embeds` part), from which the engine still takes the stored feature by that key.
FeatureRefs = Literal["embeds", "pixels"]


class InstanceEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    roles: str = Field(description="Stages it runs, in pipeline order: E, P, D, EP, PD, EPD.")
    url: str = Field(pattern=r"^https?://")
    kv_endpoint: str | None = Field(None, description="Where the KV hand-off reaches this "
                                    "instance's connector: a bootstrap URL (mooncake) or a "
                                    "side channel host:port (epd).")
    prefetch_endpoint: str | None = Field(None, description="host:port where this prefill "
                                          "instance takes prefetch hints (MM Store).")
    switchable: bool = Field(False, description="A full engine with both ends of each "
                             "hand-off (kv_both, ec_both): the proxy may move it between "
                             "E, P and D while it serves (proxy/roles.py). `roles` is the "
                             "one it starts in.")

    @field_validator("roles")
    @classmethod
    def _known_stages(cls, value: str) -> str:
        if not value or not set(value) <= STAGE_LETTERS or len(set(value)) != len(value):
            raise ValueError(f"roles must be stage letters from E, P, D, e.g. 'PD'; got {value!r}")
        return "".join(s for s in "EPD" if s in value)  # pipeline order

    @functools.cached_property
    def stages(self) -> frozenset[str]:
        """The roles as a set (read on every routing decision, so made once)."""
        return frozenset(self.roles)

    @model_validator(mode="after")
    def _one_stage_switches(self) -> "InstanceEntry":
        if self.switchable and len(self.roles) != 1:
            raise ValueError(f"only a single-stage instance (E, P or D) may switch, "
                             f"not {self.roles!r}")
        return self


class RoutingSettings(BaseModel):
    """How the proxy picks an instance for each hop (proxy/routing.py): per stage a
    preset name or `{scorer: weight}` (proxy/scores.py)."""

    model_config = ConfigDict(extra="forbid")

    E: Policy = Field("hash-affinity", description="Encoders: the same image goes to the "
                      "same encoder (its encoder cache and the MM Store hit).")
    P: Policy = Field("least-loaded", description="Prefill instances.")
    D: Policy = Field("least-loaded", description="Decode (and merged prefill+decode) "
                      "instances.")
    encoder_batch: int = Field(4, ge=1, description="Images per encoder request: a request's "
                               "images are sent in batches of at most this.")
    fan_out: bool = Field(True, description="Spread a request's images over the encoders, "
                          "encoded at once; false: all go to the encoder picked for the first.")
    video_chunk_frames: int = Field(
        4, ge=2, multiple_of=2,
        description="Frames per chunk of a video: each chunk is encoded (on any encoder, "
        "at once) and stored as one feature, and prefill joins them. Even: Qwen-VL "
        "encoders take frames in pairs.")
    # A deployment that loses a whole stage keeps answering every request type by
    # default: slower (the stand-in does two stages' work), counted, and shown in
    # x-epd-stages as FALLBACK=..., rather than refused for the minute a restart takes.
    encode_fallback: Literal["refuse", "prefill"] = Field(
        "prefill", description="With no encoder able to take an image: 'prefill' sends the "
        "pixels to the instance that computes the prompt, which encodes them itself "
        "(FALLBACK=E>P); 'refuse' answers 503 (text keeps flowing).")
    handoff_fallback: Literal["refuse", "stand-in"] = Field(
        "stand-in", description="With every prefill (P) instance down, 'stand-in' sends "
        "the request whole to a decode instance, which computes the prompt itself "
        "(FALLBACK=P>D); with every decode (D) instance down, a prefill instance decodes "
        "it (FALLBACK=D>P). 'refuse' answers 503 until the stage is back.")
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="Prompts of at most this many tokens (estimated from their "
        "text and images) skip the KV hand-off: decode computes them itself (WHOLE=short "
        "in x-epd-stages), as conditional disaggregation does elsewhere (NVIDIA Dynamo's "
        "max_local_prefill_length). For a short prompt the hand-off (a second frontend, "
        "the transfer, decode's wait for it) can cost more than its prefill; the price is "
        "that decode's running requests share a step with that prefill. 0: every prompt "
        "is prefilled by P.")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often each engine's own "
                                      "/metrics (running, waiting, KV use) is read, of "
                                      "instances routing chooses among (a stage's only "
                                      "instance is read when /status asks).")

    @field_validator("E", "P", "D")
    @classmethod
    def _known_scorers(cls, value: Policy) -> Policy:
        resolve(value)  # raises, naming the unknown scorer or the bad weight
        return value

    @model_validator(mode="after")
    def _affinity_is_for_encoders(self) -> "RoutingSettings":
        # Only an encoder's work depends on the image alone.
        for stage in ("P", "D"):
            if resolve(getattr(self, stage)).affinity:
                raise ValueError(f"routing.{stage}: hash-affinity routes by image content and "
                                 "only applies to encoders (E)")
        return self


class FirstByteSeconds(BaseModel):
    """Per stage, how long a hop waits for its instance's first byte (the answer's
    headers) before the proxy asks whether the instance is alive at all. A merged
    prefill+decode instance counts as D; an instance standing in for another stage
    counts as its own (a prefill instance decoding: P)."""

    model_config = ConfigDict(extra="forbid")

    E: float = Field(10.0, gt=0, description="Encoder hops (headers come with the answer).")
    P: float = Field(10.0, gt=0, description="Prefill hops.")
    D: float = Field(10.0, gt=0, description="Decode hops (a streamed answer's headers "
                     "come once the request is parsed; a whole answer's at its end).")


class Deadlines(BaseModel):
    """When the proxy stops trusting an instance that is silent (upstream.py). Past a
    deadline it asks the instance's /health: an instance that answers is slow, not hung,
    and is waited for (request_timeout_s at most), asked again each deadline; one that
    does not answer within `alive_timeout_s` is hung (a stopped process): the hop fails
    as if its connection were refused (another instance, else a stand-in, else 504) and
    the instance is out of routing until a probe succeeds again. So a deadline need not
    cover a cold first request or a long answer: it bounds how long a hung instance
    holds a request, not how long an instance may compute."""

    model_config = ConfigDict(extra="forbid")

    first_byte_s: FirstByteSeconds = Field(default_factory=FirstByteSeconds)
    stream_idle_s: float = Field(5.0, gt=0, description="Silence inside an answer (between "
                                 "two chunks of a stream, or before the rest of a body) "
                                 "before the instance is asked whether it is alive.")
    alive_timeout_s: float = Field(5.0, gt=0, description="How long that /health may take: "
                                   "as long as a probe's, which a busy engine answers in.")
    core_timeout_s: float = Field(5.0, gt=0, description="How long the one-token request "
                                  "that follows a good /health may take: vLLM's /health is "
                                  "green while its engine core is stopped, the request is "
                                  "not (liveness.py). A busy engine answers it at its next "
                                  "step.")


class RoleControl(BaseModel):
    """The role controller (role_control.py): moves switchable (`~`) instances to the
    stage whose queue is longest, by the rule of role_policy.py. Off by default;
    `role_control: true` (or `enabled: true`) turns it on with these defaults."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Let the controller switch roles.")
    interval_s: float = Field(0.5, gt=0, description="How often the queues are looked at.")
    high_load: float = Field(2.0, gt=0, description="A stage is under pressure at this "
                             "much queued work (hops in flight) per instance ...")
    ratio: float = Field(3.0, ge=1, description="... and this many times the stage that "
                         "gives an instance up.")
    low_load: float = Field(0.5, ge=0, description="The encoder stage may be left with no "
                            "instance (prefill then encodes) only this idle.")
    sustain_s: float = Field(3.0, ge=0, description="The pressure must hold this long "
                             "before a switch (a burst moves nothing).")
    min_dwell_s: float = Field(10.0, ge=0, description="An instance keeps a role at least "
                               "this long (no flapping).")

    @model_validator(mode="before")
    @classmethod
    def _switch_alone(cls, data):
        return {"enabled": data} if isinstance(data, bool) else data


class ProxySettings(BaseModel):
    """The `proxy:` section of a deployment file."""

    model_config = ConfigDict(extra="forbid")

    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    limits: Limits = Field(default_factory=Limits)
    deadlines: Deadlines = Field(default_factory=Deadlines)
    api_key_env: str | None = Field(None, description="Environment variable holding the key "
                                    "clients must send (Authorization: Bearer), or several "
                                    "separated by commas, one per tenant; none: open.")
    tenant_isolation: bool | None = Field(
        None, description="Requests of different API keys share no prefix-cache block and "
        "no MM Store entry (each key's cache salt and media keys differ); default: on where "
        "api_key_env is set. Costs what sharing would save: a prompt prefix or image two "
        "tenants both send is computed once per tenant.")
    admin_key_env: str = Field("EPD_ADMIN_KEY", description="Environment variable holding the "
                               "key for /instances changes; unset: registration is off.")
    stage_headers: Literal["operator", "clients"] = Field(
        "operator", description="Who is shown each answer's x-epd-stages header and request "
        "timelines (which stages ran and how long, whether an image's feature was stored "
        "already, decode's prefix-cache hit): the operator (a request carrying the admin "
        "key, or the deployment's own tools with its internal token), or every client. "
        "Shown to clients, they tell one what others sharing its caches sent.")
    request_timeout_s: float = Field(600.0, gt=0, description="The longest wait on an "
                                     "instance that is alive but silent (deadlines).")
    health_interval_s: float = Field(2.0, gt=0)
    role_control: RoleControl = Field(default_factory=RoleControl, description="Switching "
                                      "switchable instances' roles by the stages' queues.")
    role_drain_timeout_s: float = Field(
        600.0, gt=0, description="A role switch waits this long at most for the hops in "
        "flight on the instance to finish; past it the switch is abandoned and the "
        "instance keeps its old role.")
    unhealthy_after: int = Field(3, ge=1, description="Failed probes in a row before an "
                                 "instance that still accepts connections is taken out.")


class ProxyConfig(ProxySettings):
    """Everything the proxy process needs, written by the launcher as JSON."""

    model: str = Field(description="Served model name, answered on /v1/models.")
    host: str = "127.0.0.1"
    port: int = 8000
    kv_protocol: ProtocolName = Field("epd", description="KV hand-off between prefill and "
                                      "decode: a protocol of protocols/registry.py (epd | "
                                      "mooncake | ascend-layerwise).")
    mm_store: str | None = Field(None, description="The MM Store's StoreSpec as JSON; None: "
                                 "features go through vLLM's file connector.")
    feature_refs: FeatureRefs = Field(
        "embeds", description="How prefill and decode are sent an image whose feature the "
        "MM Store holds: 'embeds' (a metadata-only image_embeds part with the uuid) or "
        "'pixels' (the image with its uuid); resolved from the platform's engine.")
    fault_injection: bool = Field(False, description="Honour the x-epd-fault request header "
                                  "(tests only).")
    instances: list[InstanceEntry]
    roster_path: str | None = Field(None, description="Where the live roster (instances "
                                    "registered at run time included) is kept across proxy "
                                    "restarts; None: not kept.")

    @classmethod
    def from_file(cls, path: str | Path) -> "ProxyConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))
