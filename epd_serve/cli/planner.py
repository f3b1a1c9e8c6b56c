"""`epd-serve profile | simulate | plan`: argument parsing and the commands' flow."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from epd_serve.cli.bench import add_load_options, load_spec, rate_list

PROFILE_HELP = ("profile file, or a profile's name: this machine's (saved by `profile --quick` "
                "in .epd/profiles/) before the shipped one")


def _requests(args, spec):
    """The load tool's requests for these arguments (a simulated and a real run of the
    same arguments see the same requests), and the spec they came from. A request
    trace given as --trace is the workload and the arrivals at once."""
    from epd_serve.bench import workloads
    if args.trace and workloads.is_request_trace(Path(args.trace)):
        rows = sum(1 for line in Path(args.trace).read_text().splitlines() if line.strip())
        spec = dataclasses.replace(spec, workload=args.trace, process="trace", num_requests=rows)
    specs = workloads.load_workload(spec.workload, spec.num_requests, spec.output_tokens, spec.seed)
    return spec, specs


def _offsets(spec, n: int, rate: float | None):
    from epd_serve.bench import arrivals
    offsets = arrivals.schedule(spec.process, n, rate, burstiness=spec.burstiness,
                                end_rate=spec.end_rate, trace=spec.trace, speedup=spec.speedup,
                                seed=spec.seed)
    return offsets[:n]


def cmd_simulate(args) -> int:
    from epd_serve.bench.report import write_report
    from epd_serve.bench.runner import modality_lines
    from epd_serve.planner import profile as profiles
    from epd_serve.planner import simulator
    from epd_serve.topology import notation
    prof = profiles.load(args.profile)
    machine_line = _say_machine(prof)[1]
    plan = notation.parse(args.deployment)
    spec, specs = _requests(args, load_spec(args, url="simulated", model=prof.model,
                                        num_devices=plan.num_devices))
    results = []
    for rate in args.rates:
        offsets = _offsets(spec, len(specs), rate)
        run, _ = simulator.simulate(simulator.instances_of(plan), prof, specs[:len(offsets)],
                                    offsets, spec.slo, rate, plan.num_devices,
                                    f"{args.deployment} (simulated)")
        s = run.summary
        print(f"{args.deployment} @ {rate} req/s: TTFT p50 {s['ttft_ms']['median']:.1f} ms, "
              f"TPOT p50 {s['tpot_ms']['median'] or 0:.1f} ms, SLO attainment "
              f"{s['slo_attainment']:.0%}", file=sys.stderr)
        for line in modality_lines(s):
            print(line, file=sys.stderr)
        results.append(run)
    print(f"report: {write_report(results, Path(args.out), spec, notes=[machine_line])}")
    return 0


def cmd_plan(args) -> int:
    from rich.console import Console

    from epd_serve.planner import planner

    from epd_serve.planner import plan_output
    from epd_serve.planner import profile as profiles
    console = Console(stderr=True)
    prof = profiles.load(args.profile)
    machine_line = _say_machine(prof)[1]
    spec, specs = _requests(args, load_spec(args, url="simulated", model=prof.model,
                                        num_devices=args.devices))
    if spec.process != "trace" and args.rate is None:
        raise ValueError("give --rate (requests per second), or a --trace to replay")
    offsets = _offsets(spec, len(specs), args.rate)
    specs = specs[:len(offsets)]
    console.print(f"planning {args.devices} devices for {len(specs)} requests "
                  f"({spec.workload}, {spec.process}) with profile {prof.name}")
    with console.status("simulating candidates") as status:
        result = planner.plan(prof, specs, offsets, spec.slo, args.devices, args.all_splits,
                              progress=lambda c: status.update(f"simulated {c.notation}"),
                              rate=args.rate if spec.process != "trace" else None,
                              max_instances=args.max_instances)
    w = result.work
    console.print("stage work: " + ", ".join(
        f"{s} {w.work[s]:.0f} tokens / {w.throughput[s]:.0f} tok/s = {w.seconds[s]:.1f} s"
        for s in "EPD" if math.isfinite(w.throughput[s])))
    # Piped to a file, rich would squeeze the table into 80 columns.
    Console(width=None if sys.stdout.isatty() else 200).print(plan_output.table(result))
    for cand in result.skipped:
        print(f"left out {cand.notation}: {len(cand.instances)} engine processes > "
              f"--max-instances {args.max_instances}")
    print(plan_output.recommendation(result))
    out = plan_output.write(result, Path(args.out), dataclasses.replace(spec, num_devices=args.devices),
                            notes=[machine_line])
    print(f"plot: {out / 'plan.png'}\nreport: {out}")
    if args.verify:
        from epd_serve.planner.verify import verify

        agreed = verify(result, args.verify, spec, Path(args.out) / "verify", args.verify_top,
                        args.rate, console)
        return 0 if agreed else 3
    return 0


def cmd_profile(args) -> int:
    from epd_serve.bench.timings import SLO
    from epd_serve.planner import deployment_profile as measured
    from epd_serve.planner import profile as profiles
    from epd_serve.planner import profiler
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    base = profiles.load(args.base)
    effort = measured.Effort(args.repeats, args.max_tokens, args.handoff_requests,
                             args.handoff_runs)
    if args.quick:
        prof, path = measured.quick(base, slo, args.config or measured.QUICK_ENGINE_CONFIG,
                                    args.handoff_config, measured.QUICK)
        return _report_budgets(prof, path, args)
    if args.url:
        prober = profiler.Prober(args.url, args.model, args.repeats)
        prof = profiler.measure(prober, base, slo, args.max_tokens, videos=args.videos)
        return _save(prof.model_copy(update={"machine": _url_machine(args.url, prof.platform)}),
                     args)
    from epd_serve.runtime import bringup
    plan = bringup.load(args.config).plan
    if profiler.has_monolithic(plan):
        return _save(measured.engine_profile(args.config, base, slo, effort, args.name), args)
    if profiler.splits_prefill_decode(plan):
        from rich.console import Console

        _say_machine(base)
        return _save(measured.handoff_profile(args.config, base, slo, effort, args.name,
                                              Console(stderr=True)), args)
    raise ValueError(f"{args.config} has neither an instance that runs every stage "
                     "(profile its engine costs on e.g. configs/cpu/tp1.yaml) nor a "
                     "prefill -> decode hand-off (measure hand-offs on e.g. "
                     "configs/cpu/e-p-d.yaml with --base set to the engine profile)")


def _url_machine(url: str, platform: str):
    """This machine, when the engine at `url` runs on it; else none (unknown)."""
    from urllib.parse import urlparse

    from epd_serve.planner import machine
    if urlparse(url).hostname in ("127.0.0.1", "localhost", "::1"):
        return machine.this_machine(platform)
    print(f"note: {url} is not on this machine: the profile records no machine",
          file=sys.stderr)
    return None


def _say_machine(prof) -> tuple[bool, str]:
    """Print which machine `prof` describes (stderr); (whether it is another one, the
    line printed)."""
    from epd_serve.planner import profile as profiles
    other, line = profiles.machine_note(prof)
    print(line, file=sys.stderr)
    return other, line


def _save(prof, args) -> int:
    from epd_serve.planner import profile as profiles
    return _report_budgets(prof, profiles.save(prof, args.out), args)


def _report_budgets(prof, path: Path, args) -> int:
    b = prof.measured["budgets"]
    print(f"budgets for TTFT {args.slo_ttft_ms:.0f} ms / TPOT {args.slo_tpot_ms:.0f} ms: "
          f"E {b['E']['images']} images, P {b['P']['tokens']} tokens, PD {b['PD']['tokens']} "
          f"tokens, D {b['D']['seqs']} sequences")
    if "handoffs" in prof.measured:
        h = prof.measured["handoffs"]
        print(f"hand-offs of {h['deployment']} (medians): P -> D {h['kv_fixed_ms']} ms, "
              f"E -> P {h['feature_fixed_ms']} ms per request, decode +{h['consumer_step_ms']} "
              "ms per step")
    print(f"profile: {path}")
    return 0


def add_planner_parsers(sub) -> None:
    p = sub.add_parser("profile", help="measure stage costs and budgets of an engine into a profile")
    p.add_argument("config", nargs="?", help="deployment file, started, measured and stopped: "
                   "a monolithic (EPD) instance gives engine costs and budgets; a split one "
                   "(e.g. E-P-D) gives the hand-offs' costs on top of --base")
    p.add_argument("--quick", action="store_true",
                   help="profile this machine in a few minutes: engine costs on CONFIG "
                        "(default configs/cpu/tp1.yaml), hand-offs on --handoff-config; saved "
                        "under .epd/profiles/ (EPD_PROFILE_DIR), where plan, simulate and "
                        "sim_vs_real find it by name before the shipped profile")
    p.add_argument("--handoff-config", default="configs/cpu/e-p-d.yaml",
                   help="with --quick: the split deployment whose hand-offs are measured")
    p.add_argument("--url", help="measure this running engine instead (with --model)")
    p.add_argument("--model", help="model name of the engine at --url")
    p.add_argument("--base", default="cpu-tiny-qwen2-vl",
                   help="profile the unmeasured parts come from (transfers, sharing, memory)")
    p.add_argument("--name", help="profile name (default: <platform>-<model>)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--repeats", type=int, default=3, help="samples per probe (median)")
    p.add_argument("--videos", action="store_true",
                   help="with --url: also measure the encoder's cost per video frame (a "
                        "deployment file's engines are probed with videos when its "
                        "limit_mm_per_prompt allows them)")
    p.add_argument("--max-tokens", type=int, default=2048, help="largest prefill probe")
    p.add_argument("--handoff-requests", type=int, default=40,
                   help="requests per hand-off run (split deployments)")
    p.add_argument("--handoff-runs", type=int, default=3,
                   help="hand-off runs to pool, each with its own requests: on a shared host "
                        "one run's median can sit in either mode of the stalls")
    p.add_argument("--out", default="results/profile.yaml")
    p.set_defaults(func=_check_profile_args(cmd_profile))

    p = sub.add_parser("simulate", help="a load run against a simulated deployment")
    p.add_argument("--profile", required=True, help=PROFILE_HELP)
    p.add_argument("--deployment", required=True, help="notation, e.g. E-P-D or '(E-P)x2-D'")
    add_load_options(p, needs_url=False)
    p.add_argument("--rates", type=rate_list, required=True)
    p.set_defaults(func=cmd_simulate, out="results/simulated")

    p = sub.add_parser("plan", help="choose the deployment for a workload and an SLO")
    p.add_argument("--profile", required=True, help=PROFILE_HELP)
    p.add_argument("--devices", type=int, required=True, help="devices to split")
    p.add_argument("--rate", type=float, help="request rate (not needed with a trace)")
    p.add_argument("--all-splits", action="store_true",
                   help="simulate every split of the devices, not only the proportional one")
    p.add_argument("--verify", metavar="BASE_CONFIG",
                   help="also bring up the top launchable candidates from this deployment "
                        "file and run the load tool on them")
    p.add_argument("--verify-top", type=int, default=2)
    p.add_argument("--max-instances", type=int,
                   help="leave out candidates with more engine processes (host memory)")
    add_load_options(p, needs_url=False)
    p.set_defaults(func=cmd_plan, out="results/plan")


def _check_profile_args(func):
    def run(args):
        if args.quick and args.url:
            raise ValueError("--quick profiles deployments it starts itself, not --url")
        if not args.quick and bool(args.config) == bool(args.url):
            raise ValueError("give a deployment file, or --url and --model of a running engine")
        if args.url and not args.model:
            raise ValueError("--url needs --model")
        return func(args)
    return run

