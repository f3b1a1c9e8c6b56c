"""Video question answering on the CPU backend: E-P-D against one monolithic instance
(TP1), and a video's chunks on one encoder against two.

Single requests, one at a time (latency, not throughput), each about a fresh generated
H.264 video (224x224, nothing stored before), shaped like NextQA (8 frames, 8-token
answers) and Video-MME (64 frames, multiple choice, 4-token answers); streamed, so
TTFT and E2EL are both read. Three comparisons, each on one host in one run:
- E-P-D vs TP1, runs ordered A B A B (E-P-D, TP1, E-P-D, TP1: each a fresh start of
  its deployment, since both together exceed the three instances this host runs);
  within each E-P-D run, requests alternate between its proxy, which sends prefill and
  decode a reference to the video's stored chunks (`video_embeds`: the grid under the
  chunks' joined key), and a second proxy sending them the frames tagged with that key
  (`feature_refs: pixels`, how every video went before references): "E-P-D frames";
- one encoder vs two: 2E-PD (two encoders, one merged prefill+decode instance) behind
  two proxies, one spreading a video's chunks over both encoders, one sending them all
  to one (`fan_out: false`), A B A B on the same engines.
Then, per video length, where a request's time goes in each deployment: the median
of each part from the requests' timelines (request_latency.py's parts; the encoder
stage of a video's chunks counts from its first hop to its last), as a table and a
plot (`--out`, default results/video_latency/parts.png). The engines send their spans
to the deployment's own proxy, so requests through a second proxy show its hops only.
The summary line gives `ratio_8` and `ratio_64` (mean E2EL of E-P-D over TP1),
`frames_ratio_8` and `frames_ratio_64` (the same with the frames sent to prefill) and
`split_gain_64` (mean E2EL with one encoder over two, 64 frames).

Run it in a loopback-only network namespace (Mooncake listens everywhere):
    scripts/in-netns.sh .venv/bin/python benchmarks/video_latency.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from epd_serve.bench import waterfall
from epd_serve.instances.videos import make_video, video_data_url, video_part

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # frames -> (question, answer tokens)
    8: ("What is the person doing at the end of the video?", 8),
    64: ("Which event happens first? (A) a square enters (B) the colours fade (C) the "
         "square stops (D) nothing moves. Answer with the option's letter.", 4),
}


def ask(client: httpx.Client, url: str, model: str, frames: int, seed: int) -> dict:
    """One streamed request about a fresh video: its TTFT and E2EL (ms), and stages."""
    question, tokens = SHAPES[frames]
    video = video_data_url(make_video(frames, 224, 224, seed=seed))
    body = {"model": model, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": [
                video_part(video), {"type": "text", "text": question}]}]}
    start = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                if json.loads(line[6:])["choices"]:
                    first = time.perf_counter()
        stages = resp.headers.get("x-epd-stages", "")
        trace_id = resp.headers.get("x-epd-trace-id", "")
    end = time.perf_counter()
    return {"ttft_ms": ((first or end) - start) * 1e3, "e2el_ms": (end - start) * 1e3,
            "stages": stages, "trace_id": trace_id}


def runs(url: str, model: str, per_shape: int, seed: int, label: str) -> dict[int, list]:
    out: dict[int, list] = {}
    with httpx.Client(timeout=600) as client:
        ask(client, url, model, 8, seed=seed - 1)  # the first request pays one-off costs
        for frames in SHAPES:
            out[frames] = []
            for i in range(per_shape):
                result = ask(client, url, model, frames, seed=seed + 100 * frames + i)
                out[frames].append(result)
                print(f"  {label}: {frames} frames #{i}: E2EL {result['e2el_ms']:.0f} ms "
                      f"TTFT {result['ttft_ms']:.0f} ms  {result['stages'][:60]}", flush=True)
        time.sleep(waterfall.SPANS_SETTLE_S)  # the engines' last spans
        for result in (r for rows in out.values() for r in rows):
            found = client.get(f"{url}/v1/traces/{result['trace_id']}") \
                if result["trace_id"] else None
            result["timeline"] = found.json() \
                if found is not None and found.status_code == 200 else None
    return out


def print_breakdown(results: dict[str, dict[int, list]], out: Path) -> None:
    """Per video length, the median of each part of a request (ms) in each deployment,
    from the requests' timelines (request_latency.py's table), and the same as a plot."""
    medians = {(label, frames): waterfall.median_parts(
        [r["timeline"] for r in rows if r.get("timeline")])
        for label, shapes in results.items() for frames, rows in shapes.items()}
    medians = {key: parts for key, parts in medians.items() if parts}
    for frames in SHAPES:
        columns = [(label, medians[label, frames]) for label in results
                   if (label, frames) in medians]
        if columns:
            print(f"\nwhere a {frames}-frame request's time goes (ms, median of each part):")
            print("\n".join(waterfall.parts_table(columns)))
    # The engines export their spans to the deployment's own proxy: requests through a
    # second proxy have only its hops, which the plot, drawing engine phases, leaves out.
    drawn = [(f"{label} {frames}f", parts) for (label, frames), parts in medians.items()
             if any(part.endswith(" preprocess") for part in parts)]
    if drawn:
        out.mkdir(parents=True, exist_ok=True)
        print(f"plot: {waterfall.plot_parts(drawn, out / 'parts.png')}")


def deployed(config: str, work: Path, model: Path, **overrides):
    from epd_serve.runtime import bringup

    dep = bringup.load(REPO / "configs/cpu" / config, model=str(model), tiny_model=None,
                       work_dir=str(work / f"{config}-{time.monotonic_ns()}"), **overrides)
    return dep, bringup.bring_up(dep)


def mean(results: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="requests per shape and run")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "video_latency",
                    help="where parts.png goes")
    args = ap.parse_args()
    from epd_serve.models.tinymodel import build_tiny_model
    from epd_serve.testing.second_proxy import second_proxy

    work = Path(tempfile.mkdtemp(prefix="video-latency-"))
    model = build_tiny_model("qwen2_vl", work / "tiny-qwen2-vl")
    results: dict[str, dict[int, list]] = {}

    def add(label: str, got: dict[int, list]) -> None:
        for frames, rows in got.items():
            results.setdefault(label, {}).setdefault(frames, []).extend(rows)

    for turn, config in enumerate(["e-p-d.yaml", "tp1.yaml", "e-p-d.yaml", "tp1.yaml"]):
        label = "E-P-D" if config == "e-p-d.yaml" else "TP1"
        print(f"== run {turn + 1}/4: {label}", flush=True)
        dep, launcher = deployed(config, work, model)
        served = dep.launches[0].served_model_name
        seed = 10_000 * (turn // 2 + 1)
        try:
            if label == "TP1":
                add(label, runs(dep.proxy_url, served, args.requests, seed, label))
                continue
            with second_proxy(dep, "frames", 1, feature_refs="pixels") as frames_url:
                for half in range(2):  # references and frames, alternated
                    add(label, runs(dep.proxy_url, served, args.requests // 2,
                                    seed + 100 * half, label))
                    add("E-P-D frames", runs(frames_url, served, args.requests // 2,
                                             seed + 100 * half + 50, "frames"))
        finally:
            launcher.stop()
    print("== 2E-PD: one encoder against two, behind two proxies", flush=True)
    dep, launcher = deployed("2e-pd.yaml", work, model,
                             proxy={"routing": {"E": "least-loaded", "encoder_batch": 1}})
    try:
        served = dep.launches[0].served_model_name
        with second_proxy(dep, "one-encoder", 1,
                          routing={**dep.config.proxy.routing.model_dump(),
                                   "fan_out": False}) as one_url:
            for turn in range(2):
                add("2E-PD two encoders", runs(dep.proxy_url, served, args.requests,
                                               50_000 + 1000 * turn, "two encoders"))
                add("2E-PD one encoder", runs(one_url, served, args.requests,
                                              60_000 + 1000 * turn, "one encoder"))
    finally:
        launcher.stop()

    print(f"\n{'deployment':<22} {'frames':>6} {'n':>3} {'TTFT mean':>10} {'E2EL mean':>10} "
          f"{'E2EL p50':>9}  (ms)")
    for label, shapes in results.items():
        for frames, rows in shapes.items():
            e2el = [r["e2el_ms"] for r in rows]
            print(f"{label:<22} {frames:>6} {len(rows):>3} {mean(rows, 'ttft_ms'):>10.0f} "
                  f"{statistics.fmean(e2el):>10.0f} {statistics.median(e2el):>9.0f}")
    ratio = {f: mean(results["E-P-D"][f], "e2el_ms") / mean(results["TP1"][f], "e2el_ms")
             for f in SHAPES}
    frames_ratio = {f: mean(results["E-P-D frames"][f], "e2el_ms")
                    / mean(results["TP1"][f], "e2el_ms") for f in SHAPES}
    split = (mean(results["2E-PD one encoder"][64], "e2el_ms")
             / mean(results["2E-PD two encoders"][64], "e2el_ms"))
    print_breakdown(results, args.out)
    print(f"summary: ratio_8={ratio[8]:.2f} ratio_64={ratio[64]:.2f} "
          f"frames_ratio_8={frames_ratio[8]:.2f} frames_ratio_64={frames_ratio[64]:.2f} "
          f"split_gain_64={split:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
