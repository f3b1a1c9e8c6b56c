"""`epd-serve profile`: measure what each stage costs on a running engine, search its
stage budgets (Algorithm 1) probe by probe, and write a profile file.

The engine must run every stage (a monolithic instance: TP1, or an EPD member of a
deployment): prefill is timed with prompts of exact token ids and one output token,
the encoder with concurrent single-image requests (minus the prefill of their
tokens), decode with concurrent chat streams (the endpoint the load tool and clients
use: its per-token streaming costs the API server more than a bare completion's, and
on a small CPU host that is a large part of a token's time), and short text and image
streams (an image request's first decode steps run slow). A chat prompt's time to first token
beyond its tokens' prefill is what each request costs besides the engine's iterations.
Every probe uses fresh token ids and fresh images so that neither the prefix cache nor
the multimodal cache answers for the engine. Probes go through the deployment's proxy,
as clients' requests do.

The hand-offs of a split deployment (E -> P features, P -> D KV) are measured apart
(measure_handoffs): a slow load run through its proxy, replayed in the simulator with
the engine costs, leaves the hand-offs' fixed costs as the difference. Runs in the CLI
process (httpx, and the load tool).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable

import httpx
import numpy as np

from epd_serve.bench.timings import SLO
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.instances.videos import make_video, video_data_url
from epd_serve.planner import budgets
from epd_serve.planner.profile import EncoderCost, LLMCost, Profile

TOKEN_ID_RANGE = (20, 250)  # byte-level ids every Qwen-family vocabulary has


class Prober:
    """Timed requests against one OpenAI-compatible engine."""

    def __init__(self, url: str, model: str, repeats: int = 3, timeout_s: float = 300.0,
                 log: Callable[[str], None] = print):
        self.url = url.rstrip("/")
        self.model = model
        self.repeats = repeats
        self.timeout_s = timeout_s
        self.log = log
        self._rng = np.random.default_rng(0)
        self._image_seed = 10_000
        self._video_seed = 20_000

    def _ids(self, n: int) -> list[int]:
        return self._rng.integers(*TOKEN_ID_RANGE, size=n).tolist()

    async def _completion(self, client: httpx.AsyncClient, base: str, ids: list[int],
                          max_tokens: int) -> list[float]:
        """Streams a completion of exact token ids; returns the arrival time of every
        token chunk (seconds, monotonic)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "temperature": 0.0}
        times = []
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{base} answered {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data:") and "[DONE]" not in line and '"text"' in line:
                    times.append(time.monotonic())
        return times

    async def _chat_stream(self, client: httpx.AsyncClient, body: dict) -> tuple[list[float], int]:
        """Streams a chat request; returns the arrival time of every content chunk
        (monotonic s) and the prompt's tokens as the engine counted them."""
        times, prompt_tokens = [], 0
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{self.url} answered {resp.status_code}: "
                                   f"{(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or "[DONE]" in line:
                    continue
                if '"content"' in line:
                    times.append(time.monotonic())
                usage = json.loads(line[5:]).get("usage")
                if usage:
                    prompt_tokens = usage["prompt_tokens"]
        if not times:
            raise RuntimeError(f"{self.url} streamed no token")
        return times, prompt_tokens

    async def _chat_tokens(self, client: httpx.AsyncClient, body: dict) -> list[float]:
        return (await self._chat_stream(client, body))[0]

    async def _first_token(self, client: httpx.AsyncClient, body: dict) -> float:
        """Streams a chat request; returns when its first token arrived (monotonic s)."""
        return (await self._chat_tokens(client, body))[0]

    def _words(self, n: int) -> str:
        """A fresh text prompt of about `n` tokens (no prefix cache answers it)."""
        return " ".join(f"w{i}" for i in self._rng.integers(0, 10_000, size=n))

    def _run(self, coro_factory) -> list:
        async def main():
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                return await coro_factory(client)
        return asyncio.run(main())

    # -- the three probes -------------------------------------------------------------
    def prefill_ms(self, tokens: int) -> float:
        """One prompt of `tokens` token ids: time to its first token, streamed."""
        samples = []
        for _ in range(self.repeats):
            async def one(client, ids=self._ids(tokens)):
                start = time.monotonic()
                times = await self._completion(client, self.url, ids, 1)
                return (times[0] - start) * 1e3
            samples.append(self._run(one))
        ms = statistics.median(samples)
        self.log(f"  prefill {tokens:5d} tokens: {ms:7.1f} ms")
        return ms

    def chat_prefill_ms(self, words: int, pause_s: float = 0.5) -> tuple[float, int]:
        """A chat text prompt of about `words` tokens: time to its first token, streamed,
        and its prompt tokens. Beyond a prefill of as many token ids, this is what the
        API server spends on a chat request (template, tokenising). Requests `pause_s`
        apart, as clients' come at a low rate: one that finds the engine idle waits
        longer for its first token than one right behind another (TP1, 2 cores, 43
        tokens: 14.2 ms half a second apart, 7.9 ms back to back, in two profile runs)."""
        samples, tokens = [], 0
        for _ in range(self.repeats + 2):
            async def one(client, text=self._words(words)):
                start = time.monotonic()
                times, prompt_tokens = await self._chat_stream(
                    client, chat_body(self.model, text, max_tokens=1))
                return (times[0] - start) * 1e3, prompt_tokens
            time.sleep(pause_s)
            ms, tokens = self._run(one)
            samples.append(ms)
        ms = statistics.median(samples)
        self.log(f"  chat    {tokens:5d} tokens: {ms:7.1f} ms")
        return ms, tokens

    def decode_ms(self, seqs: int, steps: int = 49, image_size: int | None = None,
                  pause_s: float = 0.0) -> float:
        """`seqs` concurrent chat streams of short prompts (each with a fresh image of
        image_size x image_size, if given), `pause_s` apart: time per output token after
        the first ((last - first) / (tokens - 1), the load tool's TPOT), median over
        streams. By tokens, not chunk gaps: a server may flush several in one write."""
        def images() -> list[str]:
            if image_size is None:
                return []
            self._image_seed += 1
            return [image_data_url(make_image(image_size, image_size, self._image_seed))]

        async def batch(client):
            streams = [self._chat_tokens(client, chat_body(
                self.model, self._words(8), images(), max_tokens=steps)) for _ in range(seqs)]
            return await asyncio.gather(*streams)
        per_token = []
        for _ in range(self.repeats + 2):  # decode gaps are the noisiest probe on a busy host
            for times in self._run(batch):
                if len(times) > 1:
                    per_token.append((times[-1] - times[0]) / (steps - 1))
            time.sleep(pause_s)
        ms = float(np.median(per_token)) * 1e3 if per_token else float("nan")
        what = f", {steps} tokens" + ("" if image_size is None else f", a {image_size}px image")
        self.log(f"  decode  {seqs:5d} seqs:   {ms:7.1f} ms per token{what}")
        return ms

    def images_ms(self, count: int, size: int) -> float:
        """`count` concurrent single-image requests of size x size, streamed: time until
        every first token arrived."""
        samples = []
        for _ in range(self.repeats):
            urls = []
            for _ in range(count):
                self._image_seed += 1
                urls.append(image_data_url(make_image(size, size, self._image_seed)))

            async def burst(client, urls=urls):
                start = time.monotonic()
                firsts = await asyncio.gather(*(self._first_token(client, chat_body(
                    self.model, "describe", [u], max_tokens=1)) for u in urls))
                return (max(firsts) - start) * 1e3
            samples.append(self._run(burst))
        ms = statistics.median(samples)
        self.log(f"  images  {count:5d} x {size}px: {ms:7.1f} ms")
        return ms


    def video_ms(self, frames: int, size: int) -> float:
        """One request about a fresh video of `frames` frames of size x size, streamed:
        its time to first token (median of the repeats)."""
        samples = []
        for _ in range(self.repeats):
            self._video_seed += 1
            video = video_data_url(make_video(frames, size, size, self._video_seed))
            body = chat_body(self.model, "describe", video_urls=[video], max_tokens=1)

            async def one(client, body=body):
                start = time.monotonic()
                return (await self._first_token(client, body) - start) * 1e3
            samples.append(self._run(one))
        ms = statistics.median(samples)
        self.log(f"  video   {frames:5d} frames x {size}px: {ms:7.1f} ms")
        return ms


def per_frame_ms(prober: Prober, base: Profile, costs: dict[str, float],
                 frames: tuple[int, int] = (8, 32), size: int = 224) -> tuple[float, list]:
    """The encoder's cost per video frame beyond its visual tokens: two videos' times to
    first token, less what the rest of the profile says each costs (the request, the
    prompt's prefill, the encoder's visual tokens), apart by their frames. Also the
    measured points."""
    rest = []
    for n in frames:
        tokens = base.video_tokens(n, size, size)
        ms = prober.video_ms(n, size)
        beyond = ms - (costs["hop_ms"] + costs["fixed_d"]
                       + costs["per_token"] * (tokens + base.template_tokens)
                       + costs["per_vtoken"] * tokens)
        rest.append((n, ms, beyond))
    (n0, _, r0), (n1, _, r1) = rest
    return max(0.0, (r1 - r0) / (n1 - n0)), [[n, size, round(ms, 2)] for n, ms, _ in rest]


class _Probed:
    """A probe that measures each argument once: the budget search and the fits both
    read it, and `points` keeps every measurement for the fit and the profile."""

    def __init__(self, probe):
        self.probe = probe
        self.points: dict = {}

    def __call__(self, *args):
        key = args[0] if len(args) == 1 else args
        if key not in self.points:
            self.points[key] = self.probe(*args)
        return self.points[key]


def _fit(xs: list[list[float]], ys: list[float]) -> np.ndarray:
    """Least squares on relative error (a 20 ms probe counts as much as a 600 ms one),
    coefficients kept non-negative (a cost never shrinks with load): a coefficient that
    comes out negative is dropped and the rest refitted."""
    a, b = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    weight = 1.0 / np.maximum(np.abs(b), 1e-6)
    keep = np.ones(a.shape[1], dtype=bool)
    coef = np.zeros(a.shape[1])
    while keep.any():
        sol, *_ = np.linalg.lstsq(a[:, keep] * weight[:, None], b * weight, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep[np.flatnonzero(keep)[np.argmin(sol)]] = False
    return coef


def measure(prober: Prober, base: Profile, slo: SLO, max_tokens: int = 2048, max_images: int = 8,
            max_seqs: int = 32, image_size: int = 448, videos: bool = False) -> Profile:
    """Measure the engine behind `prober` (through its proxy, as clients reach it),
    search each role's budget against it, and return `base` with the measured costs and
    budgets. A request's own costs (the proxy, HTTP, the chat template, tokenising,
    scheduling) are a chat prompt's time to first token beyond one iteration and its
    tokens' prefill: the profile charges them per hop. E -> P and P -> D hand-offs stay
    as in `base` (see measure_handoffs). `videos`: also a video frame's encoder cost."""
    log = prober.log
    log("prefill: token budget under alpha x TTFT and under TBT (binary search)")
    prefill = _Probed(prober.prefill_ms)
    prefill_cache = prefill.points
    for n in (16, 128, 512):
        prefill(n)
    limits = {roles: budgets.latency_limit_ms(roles, slo, base.alpha) for roles in ("P", "PD")}
    p_budget = budgets.search_budget(prefill, limits["P"], max_tokens)
    pd_budget = budgets.search_budget(prefill, limits["PD"], max_tokens)
    pts = sorted(prefill_cache.items())
    per_token = _fit([[1, n] for n, _ in pts], [ms for _, ms in pts])[1]

    log("decode: sequence budget under TBT (binary search)")
    decode = _Probed(prober.decode_ms)
    decode_cache = decode.points
    for n in (1, 4):
        decode(n)
    d_budget = budgets.search_budget(decode, slo.tpot_ms, max_seqs)
    pts = sorted(decode_cache.items())
    fixed_d, per_seq = _fit([[1, n] for n, _ in pts], [ms for _, ms in pts])
    # An image request's first decode steps may run slow (2-3x a text request's on the
    # CPU backend while vLLM split the attention's KV over threads): an extra cost once
    # per request, from short streams of each kind. Apart, as clients' requests come at
    # a low rate: back to back that slowdown measured a third of what it was after half
    # a second's pause.
    small = image_size // 2
    short = 16
    decode_text = prober.decode_ms(1, steps=short, pause_s=0.5)
    decode_image = prober.decode_ms(1, steps=short, image_size=small, pause_s=0.5)
    mm_once = max(0.0, decode_image - decode_text) * (short - 1)

    log("request: a chat prompt's time to first token beyond its prefill")
    chat_ms, chat_tokens = prober.chat_prefill_ms(8)
    hop_ms = max(0.0, chat_ms - (fixed_d + per_token * chat_tokens))

    log("encode: image budget under alpha x TTFT (binary search)")
    tokens_per_image = base.image_tokens(image_size, image_size)
    probed_images = _Probed(prober.images_ms)
    encode_cache = probed_images.points

    def images(n: int, size: int = image_size) -> float:
        return probed_images(n, size)

    def encode_only(n: int, size: int = image_size) -> float:
        """Image requests minus the request's own costs and the prefill of their
        prompts (fitted)."""
        tokens = base.image_tokens(size, size) + base.template_tokens
        return max(0.0, images(n, size) - (hop_ms + fixed_d + per_token * n * tokens))

    images(1, small)
    for n in (1, 2):
        encode_only(n)
    e_budget = budgets.search_budget(encode_only, limits["P"], max_images)
    rows, ys = [], []
    for (n, size) in encode_cache:
        rows.append([1, n, n * base.image_tokens(size, size)])
        ys.append(encode_only(n, size))
    fixed_e, per_image, per_vtoken = _fit(rows, ys)

    costs = {"fixed_d": fixed_d, "per_token": per_token, "per_seq": per_seq, "mm_once": mm_once,
             "fixed_e": fixed_e, "per_image": per_image, "per_vtoken": per_vtoken,
             "hop_ms": hop_ms}
    budgets_found = {"E": e_budget, "P": p_budget, "PD": pd_budget, "D": d_budget}
    points = {
        "prefill": [[n, round(ms, 2)] for n, ms in sorted(prefill_cache.items())],
        "decode": [[n, round(ms, 2)] for n, ms in sorted(decode_cache.items())],
        "decode_short": [[short, round(decode_text, 2), round(decode_image, 2)]],
        "chat": [[chat_tokens, round(chat_ms, 2)]],
        "images": [[n, size, round(ms, 2)] for (n, size), ms in sorted(encode_cache.items())],
    }
    profile = _measured_profile(base, slo, costs, budgets_found, tokens_per_image, points)
    return _with_frame_cost(prober, profile, base, costs) if videos else profile


def _with_frame_cost(prober: Prober, profile: Profile, base: Profile,
                     costs: dict[str, float]) -> Profile:
    """`profile` with the encoder's cost per video frame measured, and its points."""
    prober.log("encode: a video's cost per frame (two videos, apart by their frames)")
    profile.encoder.per_frame_ms, profile.measured["points_ms"]["videos"] = per_frame_ms(
        prober, base, costs)
    return profile


def _measured_profile(base: Profile, slo: SLO, costs: dict[str, float],
                      found: dict[str, int], tokens_per_image: int,
                      points: dict[str, list]) -> Profile:
    """`base` with the measured costs, the budgets found and the engine flags they give,
    and the measured points kept for the report."""
    profile = base.model_copy(deep=True)
    profile.llm = LLMCost(fixed_ms=float(costs["fixed_d"]),
                          per_prefill_token_ms=float(costs["per_token"]),
                          per_decode_seq_ms=float(costs["per_seq"]),
                          per_context_token_ms=base.llm.per_context_token_ms,
                          mm_decode_once_ms=float(costs["mm_once"]))
    profile.encoder = EncoderCost(fixed_ms=float(costs["fixed_e"]),
                                  per_image_ms=float(costs["per_image"]),
                                  per_token_ms=float(costs["per_vtoken"]),
                                  per_frame_ms=base.encoder.per_frame_ms)
    profile.transfers = base.transfers.model_copy(update={"hop_ms": float(costs["hop_ms"])})
    e_budget, p_budget, pd_budget, d_budget = found["E"], found["P"], found["PD"], found["D"]
    profile.measured = {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "budgets": {"E": {"images": e_budget, "visual_tokens_per_image": tokens_per_image},
                    "P": {"tokens": p_budget}, "PD": {"tokens": pd_budget},
                    "D": {"seqs": d_budget}},
        "engine_flags": {
            role: budgets.engine_flags(role, budgets.Budget(
                images=e_budget if "E" in role else 0,
                tokens={"P": p_budget, "EP": p_budget, "E": 0}.get(role, max(pd_budget, d_budget)),
                seqs=d_budget if "D" in role else 0), tokens_per_image)
            for role in ("E", "P", "D", "PD", "EPD")},
        "points_ms": points,
    }
    return profile


def text_tokens(model_dir: str, texts: list[str]) -> tuple[float, int]:
    """(tokens per word, chat-template tokens) of a model's tokenizer, fitted over
    prompts of the load tool's presets."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    words, tokens = [], []
    for text in texts:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
        words.append(len(text.split()))
        tokens.append(len(tok(prompt)["input_ids"]))
    per_word, template = _fit([[w, 1] for w in words], tokens)
    return float(per_word), int(round(template))


def measure_handoffs(engine_profile: Profile, dep, slo: SLO, requests: int = 40,
                     rate: float = 0.25, seed: int = 99, runs: int = 1,
                     console=None) -> Profile:
    """What a split deployment's hand-offs cost on this machine: slow load runs (requests
    rarely overlap) through its proxy, the same requests simulated with free hand-offs.
    Decode's extra time per token is its KV connector's cost per step; text requests'
    extra TTFT is the P -> D cost, images' extra beyond that the E -> P cost. The costs
    vary a lot from request to request and from minute to minute on a shared CPU host,
    so the profile keeps their distribution (21 quantiles) besides the median, pooled
    over `runs` runs with their own seeds."""
    from epd_serve.bench import arrivals, runner
    from epd_serve.planner import simulator
    console = console or _quiet()
    instances = simulator.instances_of(dep.plan)
    measured = []  # (real records, requests, offsets) per run
    for k in range(runs):
        spec = runner.LoadSpec(url=dep.proxy_url, model=dep.launches[0].served_model_name,
                               workload="tiny-mm", num_requests=requests, output_tokens=16,
                               slo=slo, seed=seed + k, num_devices=dep.plan.num_devices,
                               headers=runner.deployment_headers(dep))
        bodies = runner.Bodies(spec, console)
        real = runner.run_once(spec, rate, bodies, f"hand-offs {k + 1}/{runs}", console)
        offsets = arrivals.schedule(spec.process, len(bodies.specs), rate, seed=spec.seed)
        measured.append((real.records, bodies.specs, offsets))

    def paired(profile: Profile):
        out = []
        for records, specs, offsets in measured:
            sim = simulator.simulate(instances, profile, specs, offsets, slo, rate)[0].records
            out += [(r, s) for r, s in zip(records, sim) if r.ok]
        return out

    free = engine_profile.model_copy(deep=True)
    free.transfers = free.transfers.model_copy(update={
        "kv_fixed_ms": 0.0, "feature_fixed_ms": 0.0, "kv_samples_ms": [], "feature_samples_ms": []})
    pairs = paired(free)
    step, kv = 0.0, []
    if splits_prefill_decode(dep.plan):
        step = max(0.0, float(np.median([r.tpot - s.tpot for r, s in pairs
                                         if r.tpot is not None and s.tpot is not None])) * 1e3)
        free.llm = free.llm.model_copy(update={"consumer_step_ms": step})
        pairs = paired(free)
        kv = [max(0.0, (r.ttft - s.ttft) * 1e3) for r, s in pairs if not r.multimodal]
    kv_median = float(np.median(kv)) if kv else 0.0
    feature = []
    if _has_encoders(dep.plan):
        feature = [max(0.0, (r.ttft - s.ttft) * 1e3 - kv_median) for r, s in pairs if r.multimodal]
    out = engine_profile.model_copy(deep=True)
    out.llm = out.llm.model_copy(update={"consumer_step_ms": step})
    out.transfers = out.transfers.model_copy(update={
        # On a CPU host the hand-offs' work competes for the cores the engines use: it
        # holds up the receiving engine rather than only the request.
        "blocking": engine_profile.sharing.scope == "host",
        "kv_fixed_ms": kv_median, "kv_samples_ms": _quantiles(kv),
        "feature_fixed_ms": float(np.median(feature)) if feature else 0.0,
        "feature_samples_ms": _quantiles(feature)})
    out.measured = {**(engine_profile.measured or {}), "handoffs": {
        "deployment": dep.plan.to_notation(), "requests": requests, "runs": runs,
        "rate": rate, "seed": seed,
        "consumer_step_ms": round(step, 2), "kv_fixed_ms": round(kv_median, 2),
        "feature_fixed_ms": round(out.transfers.feature_fixed_ms, 2)}}
    return out


def _quantiles(samples: list[float]) -> list[float]:
    if not samples:
        return []
    return [round(float(q), 2) for q in np.percentile(samples, np.linspace(0, 100, 21))]


def has_monolithic(plan) -> bool:
    """Whether an instance of the plan runs every stage (where engine costs are measured)."""
    return any(set(i.roles) == set("EPD") for i in plan.instances)


def splits_prefill_decode(plan) -> bool:
    return any("P" in i.roles and "D" not in i.roles for i in plan.instances)


def _has_encoders(plan) -> bool:
    return any(i.roles == "E" for i in plan.instances)


def _quiet():
    from rich.console import Console

    return Console(stderr=True, quiet=True)
