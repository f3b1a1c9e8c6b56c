"""Predicted latency of one video request, per shipped profile, in the simulator.

Video-MME-like requests (a multiple-choice question, answers of a few tokens) with one
224x224 video of 8 or of 64 frames, sent one at a time (each after the previous has
finished: no queueing), on three deployments:
  TP1        one instance that encodes, prefills and decodes (the video encoded whole);
  E-P-D      one encoder: the video's chunks of 4 frames all on it;
  2E-1P-1D   two encoders: the proxy spreads the chunks over both.
Prints TTFT and E2EL (mean, p50) per profile, frame count and deployment, then one
line per profile, the ratios of mean E2EL:

    summary: profile=<name> ratio_8=<E-P-D/TP1> ratio_64=<E-P-D/TP1> split_gain_64=<E-P-D/2E-1P-1D>

    .venv/bin/python benchmarks/video_latency_sim.py [--profile NAME ...] [--requests 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from epd_serve.bench.timings import SLO
from epd_serve.bench.workloads import PRESETS
from epd_serve.planner import profile as profiles
from epd_serve.planner import simulator
from epd_serve.topology import notation

DEPLOYMENTS = {"tp1": "TP1", "epd1": "E-P-D", "epd2": "2E-1P-1D"}
FRAMES = (8, 64)
# Far longer than any one request takes: each request arrives to an idle deployment.
GAP_S = 600.0


def run_one(profile, deployment: str, frames: int, requests: int, chunk_frames: int,
            seed: int = 0) -> dict:
    """Single video requests, one at a time: TTFT and E2EL (ms) mean and p50."""
    workload = dataclasses.replace(PRESETS["video-mme"], frames=frames)
    specs = workload.requests(requests, seed)
    offsets = np.arange(requests) * GAP_S
    instances = simulator.instances_of(notation.parse(deployment))
    run, _ = simulator.simulate(instances, profile, specs, offsets, SLO(), label=deployment,
                                seed=seed, video_chunk_frames=chunk_frames)
    s = run.summary
    if s["success_requests"] != requests:
        raise RuntimeError(f"{deployment}: {s['failed_requests']} requests did not finish")
    return {"ttft_mean": s["ttft_ms"]["avg"], "ttft_p50": s["ttft_ms"]["median"],
            "e2el_mean": s["e2el_ms"]["avg"], "e2el_p50": s["e2el_ms"]["median"],
            "visual_tokens": profile.video_tokens(frames, *workload.resolution)}


def predict(profile_name: str, requests: int = 10, chunk_frames: int = 4,
            seed: int = 0) -> dict:
    """{frames: {deployment key: run_one's numbers}} and the summary ratios."""
    profile = profiles.load(profile_name)
    runs = {frames: {key: run_one(profile, deployment, frames, requests, chunk_frames, seed)
                     for key, deployment in DEPLOYMENTS.items()}
            for frames in FRAMES}
    e2el = {frames: {key: r["e2el_mean"] for key, r in per.items()}
            for frames, per in runs.items()}
    ratios = {"ratio_8": e2el[8]["epd1"] / e2el[8]["tp1"],
              "ratio_64": e2el[64]["epd1"] / e2el[64]["tp1"],
              "split_gain_64": e2el[64]["epd1"] / e2el[64]["epd2"]}
    return {"profile": profile_name, "runs": runs, "ratios": ratios}


def summary_line(result: dict) -> str:
    r = result["ratios"]
    return (f"summary: profile={result['profile']} ratio_8={r['ratio_8']:.3f} "
            f"ratio_64={r['ratio_64']:.3f} split_gain_64={r['split_gain_64']:.3f}")


def print_table(result: dict) -> None:
    print(f"\n== {result['profile']}")
    print(f"  {'frames':>6} {'tokens':>6} {'deployment':<10} {'TTFT mean':>10} {'TTFT p50':>10} "
          f"{'E2EL mean':>10} {'E2EL p50':>10}  (ms)")
    for frames, per in result["runs"].items():
        for key, r in per.items():
            print(f"  {frames:>6} {r['visual_tokens']:>6} {DEPLOYMENTS[key]:<10} "
                  f"{r['ttft_mean']:>10.1f} {r['ttft_p50']:>10.1f} "
                  f"{r['e2el_mean']:>10.1f} {r['e2el_p50']:>10.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="append", choices=profiles.shipped(),
                        help="profiles to run (default: every shipped one)")
    parser.add_argument("--requests", type=int, default=10, help="requests per case")
    parser.add_argument("--chunk-frames", type=int, default=simulator.VIDEO_CHUNK_FRAMES,
                        help="frames per chunk sent to an encoder (the proxy's "
                             "routing.video_chunk_frames)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = [predict(name, args.requests, args.chunk_frames, args.seed)
               for name in args.profile or profiles.shipped()]
    for result in results:
        print_table(result)
    print()
    for result in results:
        print(summary_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
