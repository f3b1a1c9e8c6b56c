"""A discrete-event simulator of a deployment serving a load run.

It sees what the load tool sends (the same workloads and arrival schedules, bench/)
and answers with what the load tool records (bench.metrics.RequestRecord, with an
x-epd-stages header like the proxy's), so a simulated run is summarised, compared and
plotted by the load tool's own code.

The model, per request:
- the proxy routes it by modality as proxy/routing.py does: images and videos to
  encoder-only instances when there are any (each image, and each chunk of
  `video_chunk_frames` frames of a video, to the least-loaded one, so one video's
  chunks spread over the encoders), then to a prefill instance; text straight to
  prefill. An instance that encodes for itself (no encoders) takes a video whole.
  With separate decode instances the prefill hop is followed by a decode hop. Each hop
  costs the profile's hop_ms; the least-loaded instance (fewest hops in flight, ties
  rotating) takes it;
- between stages the E -> P feature copy and the P -> D KV copy cost what the
  profile's transfers say is not hidden: a delay, or, where the profile says hand-offs
  block (a CPU host, where the copy competes for the cores), time the receiving
  engine spends in its next iteration, holding up its whole batch;
- every instance runs iterations back to back while it has work, filled as paper
  001's Algorithm 1 does: all decoding sequences, then prefill chunks up to the token
  budget, then images up to the image budget. An iteration costs the profile's
  encoder and language-model cost, stretched by contention when instances sharing
  its device (or, on a CPU host, the host) are busy at its start;
- a merged prefill+decode instance emits the first token with the prefill's last
  chunk; a decode instance emits it after its first iteration on the request. The
  iteration after an image request's first token costs the profile's
  mm_decode_once_ms more (where its first decode steps run slow);
- with a role-control setting (switching.py), switchable ("~") instances change
  between E, P and D while the run goes on, as the proxy's controller moves them.

Pure Python (heapq); no engines, no network.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

import numpy as np

from epd_serve.bench.timings import SLO, RequestRecord, summarize
from epd_serve.bench.workloads import RequestSpec
from epd_serve.planner.budgets import Budget, engine_flags, role_budget
from epd_serve.planner.profile import EncodeItem, Profile
from epd_serve.planner.switching import RoleControl, RoleController, Switch


VIDEO_CHUNK_FRAMES = 4  # the proxy's default routing.video_chunk_frames


@dataclasses.dataclass(frozen=True)
class SimInstance:
    """One engine process of the simulated deployment."""

    name: str
    roles: str  # "E", "P", "D", "EP", "PD", "ED", "EPD"
    device: int
    # May change between E, P and D while serving ("~"): a full engine whatever it
    # serves, so its E hops also run the language model's prefill of their tokens.
    switchable: bool = False


@dataclasses.dataclass
class _Request:
    spec: RequestSpec
    arrival: float
    text_tokens: int
    image_tokens: list[int]  # visual tokens per image and per video
    record: RequestRecord
    items: list[EncodeItem] = dataclasses.field(default_factory=list)  # sent to encoders
    whole_items: list[EncodeItem] = dataclasses.field(default_factory=list)  # encoded by P
    images_left: int = 0
    features_ready: bool = False
    prefill_left: int = 0
    generated: int = 0
    stage_ms: dict = dataclasses.field(default_factory=dict)  # stage -> (instance, ms)
    stage_start: dict = dataclasses.field(default_factory=dict)
    kv: tuple[int, float] | None = None  # bytes, exposed ms
    # Work the request's next iteration pays on top, holding up its whole batch: a
    # blocking hand-off's cost, an image request's slow first decode steps.
    owed_ms: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + sum(self.image_tokens)


class _Engine:
    """The state of one simulated instance."""

    def __init__(self, spec: SimInstance, budget: Budget, kv_capacity: int):
        self.spec = spec
        self.roles = spec.roles  # the stages it serves now (a switch changes them)
        self.draining_to: str | None = None  # switching: routing no longer picks it
        self.role_since = -float("inf")  # when it began serving its roles (switching)
        self.budget = budget
        self.kv_capacity = kv_capacity
        self.encode_queue: collections.deque = collections.deque()  # (request, EncodeItem)
        self.prefill_queue: collections.deque = collections.deque()
        self.decoding: list[_Request] = []
        self.waiting_decode: collections.deque = collections.deque()  # admitted by KV room
        self.busy_until: float | None = None
        self.in_flight = 0  # hops the proxy has sent here and not seen finish
        self.flags: dict[str, int] = {}  # the engine flags that enforce the budget
        self.receives_kv = False  # set with its budget (Simulation.set_budget)
        # Work done, for the conservation checks and the report.
        self.busy_ms = 0.0
        self.iterations = 0
        self.encoded_images = 0
        self.prefilled_tokens = 0
        self.decoded_tokens = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def has_work(self) -> bool:
        return bool(self.encode_queue or self.prefill_queue or self.decoding
                    or self.waiting_decode)

    @property
    def full_engine_encoder(self) -> bool:
        """A switchable instance serving E: its encode hops run the language model's
        prefill of their tokens too (an E~ loads the whole model, notation.py)."""
        return self.spec.switchable and self.roles == "E"


@dataclasses.dataclass
class SimResult:
    records: list[RequestRecord]
    instances: dict[str, dict]  # name -> work done and busy time
    end_s: float
    switches: list[Switch] = dataclasses.field(default_factory=list)  # in decision order


class Simulation:
    """One simulated load run of one deployment."""

    def __init__(self, instances: list[SimInstance], profile: Profile, slo: SLO, seed: int = 0,
                 role_control: RoleControl | None = None,
                 video_chunk_frames: int = VIDEO_CHUNK_FRAMES):
        """`role_control`: the controller's settings, to move switchable instances
        between stages while the run goes on; None keeps every role fixed.
        `video_chunk_frames`: frames per chunk of a video sent to the encoders (the
        proxy's routing option of that name)."""
        if video_chunk_frames < 1:
            raise ValueError("video_chunk_frames must be at least 1")
        self.video_chunk_frames = video_chunk_frames
        if not instances:
            raise ValueError("a deployment needs at least one instance")
        self.profile = profile
        self.slo = slo
        self.instances = instances
        self._events: list = []
        self._seq = itertools.count()
        self._turns: dict[str, itertools.count] = collections.defaultdict(itertools.count)
        self._engines: list[_Engine] = []
        self._rng = np.random.default_rng(seed)  # draws of measured hand-off costs
        self._sharers: dict[int, list[_Engine]] = collections.defaultdict(list)
        self.pools = _pools(instances)
        self.role_control = role_control
        self.controller: RoleController | None = None  # built with the engines
        self.open_requests = 0
        if "PD" not in self.pools and ("P" not in self.pools or "D" not in self.pools):
            raise ValueError("the deployment cannot serve a request: it needs an instance "
                             "that prefills and decodes, or prefill and decode instances")

    # -- set-up -------------------------------------------------------------------------
    def _build(self, requests: list[_Request]) -> None:
        # A typical encoder item: an image, or a video (a chunk of one, where encoders
        # take them).
        items = [i for r in requests for i in (r.items if "E" in self.pools else r.whole_items)]
        typical_image = int(_mean([i.tokens for i in items]) or 256)
        typical_context = int(_mean([r.prompt_tokens + r.spec.max_tokens / 2 for r in requests]) or 512)
        typical_frames = round(_mean([i.frames for i in items]))
        self._typical = (typical_image, typical_context, typical_frames)
        per_device = collections.Counter(inst.device for inst in self.instances)
        for inst in self.instances:
            capacity = self.profile.memory.kv_capacity_tokens // per_device[inst.device]
            engine = _Engine(inst, Budget(0, 0, 0), capacity)
            self.set_budget(engine)
            self._engines.append(engine)
        for engine in self._engines:
            self._sharers[self._sharing_key(engine)].append(engine)
        self._by_name = {e.name: e for e in self._engines}
        if self.role_control is not None:
            self.controller = RoleController(self.role_control, self)
            self._push(self.role_control.interval_s, self.controller.tick)

    def set_budget(self, engine: _Engine) -> None:
        """The budget and engine flags of the roles it serves (a switched instance is
        assumed to be given its new role's budget, as a fresh one of that role would)."""
        roles = self.working_roles(engine)
        engine.budget = role_budget(roles, self.slo, self.profile, *self._typical)
        engine.flags = engine_flags(roles, engine.budget, self._typical[0])
        engine.receives_kv = "D" in engine.roles and "P" not in engine.roles

    def refresh_pools(self) -> None:
        """Routing's pools from the roles served now, less any instance draining."""
        self.pools = _pools([e for e in self._engines if e.draining_to is None])

    @property
    def engines(self) -> list[_Engine]:
        return self._engines

    def _sharing_key(self, engine: _Engine) -> int:
        """Who an instance contends with: its device's other instances, or on a CPU
        host every instance."""
        return 0 if self.profile.sharing.scope == "host" else engine.spec.device

    def working_roles(self, inst) -> str:
        """The stages an instance runs: a prefill instance encodes its requests' images
        itself when the deployment has no encoders."""
        encodes = "E" in inst.roles or ("P" in inst.roles and "E" not in self.pools)
        return "".join(r for r in "EPD" if r in inst.roles or (r == "E" and encodes))

    # -- the event loop -------------------------------------------------------------------
    def run(self, specs: list[RequestSpec], offsets) -> SimResult:
        requests = []
        for spec, offset in zip(specs, offsets):
            text, images = self.profile.request_tokens(spec)
            record = RequestRecord(index=spec.index, multimodal=spec.multimodal,
                                   scheduled=float(offset), sent=float(offset),
                                   modality=spec.modality)
            requests.append(_Request(
                spec, float(offset), text, images, record,
                items=self.profile.encode_items(spec, self.video_chunk_frames),
                whole_items=self.profile.encode_items(spec)))
        self._build(requests)
        self.open_requests = len(requests)
        for req in requests:
            self._push(req.arrival, self._arrive, req)
        now = 0.0
        while self._events:
            now, _, action, args = heapq.heappop(self._events)
            action(now, *args)
        for req in requests:
            req.record.stages_header = _header(req)
        stats = {e.name: {"roles": e.spec.roles, "final_roles": e.roles, "device": e.spec.device,
                          "busy_s": e.busy_ms / 1e3, "iterations": e.iterations,
                          "images": e.encoded_images, "prefill_tokens": e.prefilled_tokens,
                          "decode_tokens": e.decoded_tokens,
                          "budget": dataclasses.asdict(e.budget), "engine_flags": e.flags}
                 for e in self._engines}
        switches = self.controller.switches if self.controller else []
        return SimResult([r.record for r in requests], stats, now, switches)

    def _push(self, at: float, action, *args) -> None:
        heapq.heappush(self._events, (at, next(self._seq), action, args))

    # -- the proxy ------------------------------------------------------------------------
    def _choose(self, hop: str) -> _Engine:
        """Least-loaded with rotating ties, as proxy/routing.py's least-loaded policy."""
        pool = [self._by_name[i.name] for i in self.pools[hop]]
        start = next(self._turns[hop]) % len(pool)
        rotated = pool[start:] + pool[:start]
        return min(rotated, key=lambda e: e.in_flight)

    def _hop(self, now: float, hop: str, req: _Request, enqueue) -> None:
        engine = self._choose(hop)
        engine.in_flight += 1
        self._push(now + self.profile.transfers.hop_ms / 1e3, enqueue, engine, req)

    def _arrive(self, now: float, req: _Request) -> None:
        if req.image_tokens and "E" in self.pools:
            req.images_left = len(req.items)
            for item in req.items:  # each image and video chunk: a hop of its own
                engine = self._choose("E")
                engine.in_flight += 1
                self._push(now + self.profile.transfers.hop_ms / 1e3, self._enqueue_image,
                           engine, req, item)
        else:
            req.features_ready = not req.image_tokens
            self._to_prefill(now, req)

    def _to_prefill(self, now: float, req: _Request) -> None:
        self._hop(now, "P" if "P" in self.pools else "PD", req, self._enqueue_prefill)

    def _enqueue_image(self, now: float, engine: _Engine, req: _Request, item: EncodeItem) -> None:
        req.stage_start.setdefault("E", now)
        req.stage_ms.setdefault("E", (set(), 0.0))[0].add(engine.name)
        engine.encode_queue.append((req, item))
        self._kick(now, engine)

    def _enqueue_prefill(self, now: float, engine: _Engine, req: _Request) -> None:
        stage = "P" if "P" in self.pools else "PD"
        req.stage_start[stage] = now
        req.prefill_left = req.prompt_tokens
        if not req.features_ready:  # no encoders: prefill encodes the media itself, whole
            req.images_left = len(req.whole_items)
            for item in req.whole_items:
                engine.encode_queue.append((req, item))
        elif frames := sum(i.frames for i in req.whole_items):
            # A video reaches prefill as its frames (the proxy sends no reference for
            # one): prefill's API server prepares them again before the engine sees it.
            self._push(now + frames * self.profile.encoder.frame_ms / 1e3,
                       self._prepared_for_prefill, engine, req)
            return
        else:
            engine.prefill_queue.append(req)
        self._kick(now, engine)

    def _prepared_for_prefill(self, now: float, engine: _Engine, req: _Request) -> None:
        engine.prefill_queue.append(req)
        self._kick(now, engine)

    def _enqueue_decode(self, now: float, engine: _Engine, req: _Request) -> None:
        req.stage_start["D"] = now
        engine.waiting_decode.append(req)
        self._kick(now, engine)

    # -- an instance's iterations -------------------------------------------------------
    def _kick(self, now: float, engine: _Engine) -> None:
        if engine.busy_until is not None or not engine.has_work():
            return
        batch = self._form_batch(engine)
        images, prefill, decode = batch
        lm_prefill = sum(n for _, n in prefill)
        if engine.full_engine_encoder:  # its encode hops prefill the image and template
            lm_prefill += sum(i.tokens + self.profile.template_tokens for _, i in images)
        cost = self._owed(prefill, decode) + (self.profile.items_ms([i for _, i in images])
                + self.profile.iteration_ms(lm_prefill, len(decode),
                                            sum(r.prompt_tokens + r.generated for r in decode)))
        if decode and engine.receives_kv:
            cost += self.profile.llm.consumer_step_ms
        sharing = self.profile.sharing
        slowdown = 1.0 + sum(sharing.between(engine.roles, e.roles)
                             for e in self._sharers[self._sharing_key(engine)]
                             if e is not engine and e.busy_until is not None)
        duration = cost * slowdown / 1e3
        engine.busy_until = now + duration
        engine.busy_ms += duration * 1e3
        engine.iterations += 1
        self._push(now + duration, self._iteration_done, engine, batch)

    @staticmethod
    def _owed(prefill, decode) -> float:
        """What the batch's requests still owe (once each)."""
        owed = 0.0
        for req in [r for r, _ in prefill] + decode:
            owed, req.owed_ms = owed + req.owed_ms, 0.0
        return owed

    def _form_batch(self, engine: _Engine):
        """Algorithm 1: decoding sequences, then prefill chunks, then images."""
        budget = engine.budget
        room = engine.kv_capacity - sum(r.prompt_tokens + r.spec.max_tokens for r in engine.decoding)
        while engine.waiting_decode and len(engine.decoding) < max(1, budget.seqs):
            nxt = engine.waiting_decode[0]
            if engine.decoding and nxt.prompt_tokens + nxt.spec.max_tokens > room:
                break  # no KV room: it waits for a sequence to finish
            room -= nxt.prompt_tokens + nxt.spec.max_tokens
            engine.decoding.append(engine.waiting_decode.popleft())
        decode = list(engine.decoding)
        used = len(decode)
        prefill = []
        for req in engine.prefill_queue:
            if used >= budget.tokens and (prefill or decode):
                break
            chunk = min(req.prefill_left, max(1, budget.tokens - used))
            prefill.append((req, chunk))
            used += chunk
        images = []
        while engine.encode_queue and (len(images) < max(1, budget.images)):
            images.append(engine.encode_queue.popleft())
        return images, prefill, decode

    def _iteration_done(self, now: float, engine: _Engine, batch) -> None:
        images, prefill, decode = batch
        engine.busy_until = None
        for req, _ in images:
            engine.encoded_images += 1
            req.images_left -= 1
            if "P" not in engine.roles:
                engine.in_flight -= 1  # the proxy sends each image to an encoder as a hop
            if req.images_left == 0:
                self._images_done(now, engine, req)
        for req, chunk in prefill:
            engine.prefilled_tokens += chunk
            req.prefill_left -= chunk
            if req.prefill_left == 0:
                engine.prefill_queue.remove(req)
                self._prefill_done(now, engine, req)
        for req in decode:
            engine.decoded_tokens += 1
            self._token(now, req)
            if req.generated >= req.spec.max_tokens:
                engine.decoding.remove(req)
                self._finish(now, engine, req, "D" if "P" not in engine.roles else "PD")
        if engine.draining_to is not None:
            self.controller.check_drained(now, engine)
        self._kick(now, engine)

    def _images_done(self, now: float, engine: _Engine, req: _Request) -> None:
        if "P" in engine.roles:  # encoded by the prefill instance itself
            req.features_ready = True
            engine.prefill_queue.append(req)
            return
        self._stage_end(now, req, "E", engine)
        req.features_ready = True
        cost = self.profile.transfers.feature_ms(sum(req.image_tokens), self._rng.random())
        if self.profile.transfers.blocking:
            req.owed_ms += cost
            cost = 0.0
        self._push(now + cost / 1e3, self._to_prefill, req)

    def _prefill_done(self, now: float, engine: _Engine, req: _Request) -> None:
        if "D" in engine.roles:  # merged: the first token comes with the last chunk
            self._token(now, req)
            if req.generated >= req.spec.max_tokens:
                self._finish(now, engine, req, "PD")
            else:
                engine.decoding.append(req)
            return
        engine.in_flight -= 1
        self._stage_end(now, req, "P", engine)
        transfers = self.profile.transfers
        exposed = transfers.kv_ms(req.prompt_tokens, self._rng.random())
        req.kv = (transfers.kv_bytes(req.prompt_tokens), exposed)
        if transfers.blocking:
            req.owed_ms += exposed
            exposed = 0.0
        self._push(now + exposed / 1e3, lambda t, r: self._hop(t, "D", r, self._enqueue_decode), req)

    def _token(self, now: float, req: _Request) -> None:
        req.generated += 1
        req.record.token_times.append(now)
        if req.record.first_token is None:
            req.record.first_token = now
            if req.image_tokens:  # its first decode steps run slow (the profile measures it)
                req.owed_ms += self.profile.llm.mm_decode_once_ms

    def _finish(self, now: float, engine: _Engine, req: _Request, stage: str) -> None:
        engine.in_flight -= 1
        self.open_requests -= 1
        self._stage_end(now, req, stage, engine)
        req.record.end = now
        req.record.input_tokens = req.prompt_tokens
        req.record.output_tokens = req.generated

    def _stage_end(self, now: float, req: _Request, stage: str, engine: _Engine) -> None:
        start = req.stage_start.get(stage, now)
        names = req.stage_ms.get(stage, (set(), 0.0))[0] | {engine.name}
        req.stage_ms[stage] = (names, (now - start) * 1e3)


def _pools(instances) -> dict[str, list]:
    """Which instances (anything with a name and roles) take which hop: encoders are
    instances that encode but do not prefill; P and D are the two ends of a hand-off;
    PD instances prefill and decode."""
    pools: dict[str, list] = collections.defaultdict(list)
    for inst in instances:
        roles = set(inst.roles)
        if "E" in roles and "P" not in roles:
            pools["E"].append(inst)
        if "P" in roles and "D" not in roles:
            pools["P"].append(inst)
        if "D" in roles and "P" not in roles:
            pools["D"].append(inst)
        if {"P", "D"} <= roles:
            pools["PD"].append(inst)
    return dict(pools)


def _header(req: _Request) -> str | None:
    parts = [f"{stage}={'+'.join(sorted(names))}:{ms:.3f}ms"
             for stage, (names, ms) in sorted(req.stage_ms.items(), key=lambda kv: "EPD".find(kv[0][0]))]
    if req.kv is not None:
        parts.append(f"KV=done:bytes={req.kv[0]}B:exposed={req.kv[1]:.3f}ms")
    return ";".join(parts) or None


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def instances_of(plan) -> list[SimInstance]:
    """The simulated instances of a topology plan (tensor parallelism is not modelled)."""
    out = []
    for inst in plan.instances:
        if inst.tensor_parallel != 1:
            raise ValueError(f"{inst.name} runs on {inst.tensor_parallel} devices; the "
                             "simulator models one device per instance")
        out.append(SimInstance(inst.name, inst.roles, inst.devices[0], inst.switchable))
    return out


def simulate(instances: list[SimInstance], profile: Profile, specs: list[RequestSpec],
             offsets, slo: SLO, rate: float | None = None, num_devices: int | None = None,
             label: str = "", seed: int = 0, role_control: RoleControl | None = None,
             video_chunk_frames: int = VIDEO_CHUNK_FRAMES):
    """One simulated load run: (the load tool's RunResult, the SimResult: per-instance
    work and any role switches)."""
    from epd_serve.bench.runner import RunResult

    result = Simulation(instances, profile, slo, seed, role_control,
                        video_chunk_frames).run(specs, offsets)
    devices = num_devices or len({i.device for i in instances})
    summary = summarize(result.records, slo, devices, rate)
    summary.update({"label": label, "rate": rate, "simulated": True,
                    "instances": result.instances})
    return RunResult(label, rate, summary, result.records), result
