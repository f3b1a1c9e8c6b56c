"""Paper 004's Table 5 in the simulator: openPangu-7B-VL on Atlas 800I A2 NPUs,
ShareGPT-4o-like requests (one 802x652 image on average, 64 output tokens), Poisson
arrivals at 10 req/s, 512 requests, SLO TTFT < 2000 ms and TPOT < 50 ms (the
abstract's; the table's own thresholds are missing from the text). Prints the
simulated row beside the published one and whether the order of SLO attainment
matches.

    .venv/bin/python benchmarks/table5.py [--profile atlas-800i-a2-openpangu-7b-vl]
"""

from __future__ import annotations

import argparse

import itertools

from epd_serve.topology import notation
from epd_serve.bench import arrivals, workloads
from epd_serve.bench.timings import SLO
from epd_serve.planner import profile as profiles, simulator

# Table 5: deployment (ours), paper's name, NPUs, TTFT ms, TPOT ms, SLO attainment,
# per-NPU effective throughput (tokens/s).
TABLE5 = [
    ("2EPD", "TP1 x2", 2, 658.27, 95.56, 0.0215, 13.38),
    ("(E-PD)x2", "(E-PD) x2", 2, 548.32, 62.22, 0.0313, 19.70),
    ("EP-D", "EP-D", 2, 5523.82, 27.31, 0.0820, 21.54),
    ("(E-P)-D", "(E-P)-D", 2, 2386.85, 28.40, 0.2617, 77.36),
    ("(E-D)-P", "(E-D)-P", 2, 651.86, 50.71, 0.2266, 69.18),
    ("E-P-D", "E-P-D", 3, 557.89, 28.92, 0.9434, 192.70),
]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Agreement of two orderings: 1 the same, -1 reversed (pairs tied in either count 0)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum(((a[i] > a[j]) - (a[i] < a[j])) * ((b[i] > b[j]) - (b[i] < b[j])) for i, j in pairs)
    return score / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="atlas-800i-a2-openpangu-7b-vl")
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--seeds", type=int, default=3, help="arrival/workload seeds averaged")
    args = ap.parse_args()
    prof = profiles.load(args.profile)
    slo = SLO(ttft_ms=2000, tpot_ms=50)
    print(f"{'deployment':10s} {'NPUs':>4s} | {'TTFT ms':>16s} | {'TPOT ms':>14s} | "
          f"{'SLO attainment':>16s} | {'eff tok/s/NPU':>16s}")
    print(f"{'':10s} {'':>4s} | {'paper':>7s} {'sim':>8s} | {'paper':>6s} {'sim':>7s} | "
          f"{'paper':>7s} {'sim':>8s} | {'paper':>7s} {'sim':>8s}")
    paper_att, sim_att = [], []
    for deployment, name, npus, ttft, tpot, att, eff in TABLE5:
        plan = notation.parse(deployment)
        assert plan.num_devices == npus, deployment
        rows = []
        for seed in range(args.seeds):
            specs = workloads.load_workload("sharegpt4o", args.num_requests, 64, seed=seed)
            offsets = arrivals.poisson(len(specs), args.rate, seed=seed)
            run, _ = simulator.simulate(simulator.instances_of(plan), prof, specs, offsets, slo,
                                        args.rate, npus, deployment)
            rows.append(run.summary)
        mean = lambda f: sum(f(s) for s in rows) / len(rows)  # noqa: E731
        s_ttft, s_tpot = mean(lambda s: s["ttft_ms"]["avg"]), mean(lambda s: s["tpot_ms"]["avg"])
        s_att = mean(lambda s: s["slo_attainment"])
        s_eff = mean(lambda s: s["per_device"]["effective_throughput"])
        paper_att.append(att)
        sim_att.append(s_att)
        print(f"{name:10s} {npus:4d} | {ttft:7.0f} {s_ttft:8.0f} | {tpot:6.1f} {s_tpot:7.1f} | "
              f"{att:7.1%} {s_att:8.1%} | {eff:7.1f} {s_eff:8.1f}")
    order = lambda xs: [TABLE5[i][1] for i in sorted(range(len(xs)), key=lambda i: -xs[i])]  # noqa: E731
    print(f"paper order:     {' > '.join(order(paper_att))}")
    print(f"simulated order: {' > '.join(order(sim_att))}")
    tau = kendall_tau(paper_att, sim_att)
    same = order(paper_att) == order(sim_att)
    print(f"summary: same_order={same} kendall_tau={tau:.2f} "
          f"best_matches={order(paper_att)[0] == order(sim_att)[0]}")


if __name__ == "__main__":
    main()
