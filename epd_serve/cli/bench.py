"""`epd-serve bench run | sweep | compare`: argument parsing for the load tool.

The load options (`add_load_options`, `rate_list`, `load_spec`) are shared with the
planner's commands (cli/planner.py), which describe their requests the same way.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from epd_serve.bench import arrivals, workloads
from epd_serve.bench.timings import SLO


def rate_list(text: str) -> list[float]:
    """`--rates 1,2,4`: positive numbers separated by commas."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"rates must be numbers separated by commas: {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive")
    return rates


def _range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH, got {text!r}") from None
    if not 0 < low < high:
        raise argparse.ArgumentTypeError("need 0 < LOW < HIGH")
    return low, high


def add_load_options(p: argparse.ArgumentParser, needs_url: bool) -> None:
    """The workload, arrival process and SLO options every load command takes."""
    if needs_url:
        p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
        p.add_argument("--model", required=True, help="model name the server answers to")
        p.add_argument("--num-devices", type=int, default=1,
                       help="devices of the deployment, to normalise per device")
        # Keys are named by their variables, never given on the command line (which
        # any user of the machine can read).
        p.add_argument("--api-key-env", metavar="VAR",
                       help="environment variable holding the API key to send")
        p.add_argument("--admin-key-env", metavar="VAR",
                       help="environment variable holding the proxy's admin key: its "
                            "per-stage report needs it where the proxy shows stages to "
                            "the operator only (proxy.stage_headers)")
    p.add_argument("--workload", default="sharegpt4o",
                   help=f"preset ({', '.join(workloads.PRESETS)}), AISBench .jsonl, "
                        "ShareGPT .json, a request trace .jsonl or a folder of images")
    p.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    p.add_argument("--output-tokens", type=int, default=64,
                   help="fixed output length (0: take it from the dataset or preset; the "
                        "video presets answer in a few tokens)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let the model stop early (default: exactly --output-tokens)")
    p.add_argument("--process", default="poisson", choices=arrivals.PROCESSES)
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    p.add_argument("--end-rate", type=float, help="final rate of a ramp")
    p.add_argument("--trace", help="timestamps to replay (JSONL or CSV)")
    p.add_argument("--speedup", type=float, default=1.0, help="trace replay speed")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--out", default="results/bench", help="report folder")


def key_headers(args) -> dict[str, str]:
    """The headers --api-key-env and --admin-key-env ask for; a named variable that
    is unset is an error (the run would only collect 401s, or no per-stage report)."""
    from epd_serve.proxy.tenancy import ADMIN_KEY_HEADER

    headers = {}
    for option, header, form in (("api_key_env", "authorization", "Bearer {}"),
                                 ("admin_key_env", ADMIN_KEY_HEADER, "{}")):
        variable = getattr(args, option, None)
        if variable is None:
            continue
        value = os.environ.get(variable)
        if not value:
            raise ValueError(f"--{option.replace('_', '-')} names {variable}, which is "
                             "not set (or empty) in this environment")
        headers[header] = form.format(value)
    return headers


def load_spec(args, url: str = "", model: str = "", num_devices: int = 1):
    """The LoadSpec the parsed options describe."""
    from epd_serve.bench.runner import LoadSpec

    if args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    return LoadSpec(
        url=getattr(args, "url", url) or url, model=getattr(args, "model", model) or model,
        workload=args.workload, num_requests=args.num_requests,
        output_tokens=args.output_tokens or None, process=args.process,
        burstiness=args.burstiness, end_rate=args.end_rate, trace=args.trace,
        speedup=args.speedup, max_concurrency=args.max_concurrency,
        ignore_eos=not args.no_ignore_eos, seed=args.seed, timeout_s=args.timeout_s,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        num_devices=getattr(args, "num_devices", num_devices) or num_devices,
        headers=key_headers(args))


def cmd_run(args) -> int:
    from epd_serve.bench.report import write_report
    from epd_serve.bench.runner import Bodies, run_once

    spec = load_spec(args)
    if args.rate is None and args.process not in ("burst", "trace"):
        raise ValueError(f"--rate is required for the {args.process} process")
    from rich.console import Console

    console = Console(stderr=True)
    result = run_once(spec, args.rate, Bodies(spec, console), args.label, console)
    print(f"report: {write_report([result], Path(args.out), spec)}")
    return 0


def cmd_sweep(args) -> int:
    from rich.console import Console

    from epd_serve.bench.report import write_report
    from epd_serve.bench.runner import Bodies, find_goodput, sweep

    spec = load_spec(args)
    console = Console(stderr=True)
    bodies = Bodies(spec, console)
    results = sweep(spec, args.rates, args.label, console, bodies)
    goodputs = {}
    if args.goodput:
        value, runs = find_goodput(spec, *args.goodput, label=args.label, console=console,
                                   bodies=bodies)
        results += runs
        goodputs[args.label] = value
        console.print(f"goodput: {value if value is not None else 'below the lowest rate'} req/s")
    print(f"report: {write_report(results, Path(args.out), spec, goodputs)}")
    return 0


def cmd_compare(args) -> int:
    from epd_serve.bench.runner import compare_deployments

    spec = load_spec(args)
    out = compare_deployments(args.configs, spec, args.rates, Path(args.out), args.goodput)
    print(f"report: {out}")
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="load tool: runs, sweeps, goodput, comparisons")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("run", help="one load run against an OpenAI-compatible endpoint")
    add_load_options(p, needs_url=True)
    p.add_argument("--rate", type=float, help="requests per second")
    p.add_argument("--label", default="", help="name in the report")
    p.set_defaults(func=cmd_run)

    p = bsub.add_parser("sweep", help="several rates (and optionally a goodput search)")
    add_load_options(p, needs_url=True)
    p.add_argument("--rates", type=rate_list, required=True, help="e.g. 1,2,4,8")
    p.add_argument("--goodput", type=_range, metavar="LOW:HIGH",
                   help="also binary-search the highest rate with >=90%% attainment")
    p.add_argument("--label", default="", help="name in the report")
    p.set_defaults(func=cmd_sweep)

    p = bsub.add_parser("compare", help="bring up each deployment, run the same sweep, one report")
    p.add_argument("configs", nargs="+", help="deployment files")
    add_load_options(p, needs_url=False)
    p.add_argument("--rates", type=rate_list, required=True)
    p.add_argument("--goodput", type=_range, metavar="LOW:HIGH")
    p.set_defaults(func=cmd_compare)
