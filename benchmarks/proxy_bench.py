"""The proxy's own overhead, measured against instant fake instances.

Starts one fake instance process per role (E, P, D: `python -m epd_serve.testing.fake_server
--forget-requests`, which answers at once) and measures one fake directly; then
starts the proxy (`--proxy-cmd`, its own process) in front of the three fakes with the
"epd" KV hand-off and measures the same requests through it. The load client runs in
this process (aiohttp, on uvloop when installed).
Every request is a chat completion with max_tokens 4; "image" requests carry one 64x64
JPEG as a data URL. On a small host every process shares the same cores, so the
numbers include the proxy competing with the client and the fakes for CPU, as a
single-host deployment would.

Measured, in one run:

- direct: one fake served without the proxy, closed loop (N connections sending back
  to back) at each concurrency, text, not streamed; the highest achieved rate is the
  direct rate. Also at concurrency 1 for each body (text, image) and stream mode: the
  direct latency of one hop (median), which the added latency subtracts.
- proxied, closed loop: text (P -> D) and image (E -> P -> D), streamed and not, at
  each concurrency: achieved rate, latency and added latency percentiles.
- proxied, open loop: Poisson arrivals at `--open-rate` (200 req/s) for
  `--open-seconds`, text and image, not streamed; latency from the actual send (the
  client's send lag is reported beside it).
- the proxy process's CPU time per request in each cell (psutil).

Added latency of a proxied request = its latency at the client minus the sum of the
direct concurrency-1 median latencies of the hops it makes, each hop taken as the
pipeline sends it (same body; encode not streamed, prefill streamed, decode in the
client's stream mode): text = P + D, image = E + P + D. Prefill and decode partly
overlap in the epd hand-off, so this subtracts more than the hops' critical path; at
high concurrency it includes queueing behind the proxy (that is its cost too).

Rates relative to direct: the best non-streamed closed-loop rate over the
concurrencies, text and image, as a percentage of the direct (text) rate. Goals: p99
added latency under 5 ms at 200 req/s; routed text rate >= 30% of direct, image >= 20%.

Then the same proxied cells through benchmarks/floor_proxy.py (unless `--no-floor`): a
proxy on the same stack that only forwards, with none of the proxy's checks or records;
its numbers are what this host allows any proxy built this way, the floor under ours.

Writes results/proxy/proxy_bench.json and proxy_bench.png (proxy_bench-<label>.* for a
`--label` other than the default) and ends with one line:
  summary: p99_added_ms_at_200=<ms> text_rate_vs_direct=<pct> image_rate_vs_direct=<pct>
(p99 added latency of the open-loop text run, in ms), followed by the same three for the
floor (floor_p99_added_ms_at_200=... floor_text_rate_vs_direct=...
floor_image_rate_vs_direct=...).

    .venv/bin/python benchmarks/proxy_bench.py [--quick] [--label NAME]
        [--proxy-cmd "python -m epd_serve.proxy"] [--python PATH]

Another proxy, e.g. an older checkout whose package folder is on PYTHONPATH:
    .venv/bin/python benchmarks/proxy_bench.py --label before \
        --proxy-cmd "env PYTHONPATH=/path/to/pkg .venv/bin/python -m epd_serve.proxy"
Run it on an otherwise idle host: the cores are shared with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from epd_serve.bench.arrivals import poisson
from epd_serve.bench.client import SPIN_WINDOW_S
from epd_serve.bench.client import run as run_loop
from epd_serve.instances.payloads import chat_body, image_data_url, make_image

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "results" / "proxy"
FLOOR_PROXY = Path(__file__).resolve().with_name("floor_proxy.py")
DEFAULT_LABEL = "current"
MODEL = "fake"
MAX_TOKENS = 4
CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 30.0
GOAL_P99_ADDED_MS = 5.0
GOAL_TEXT_PCT = 30.0
GOAL_IMAGE_PCT = 20.0
# Hops each path makes, as the pipeline sends them: True/False = streamed or not,
# None = in the client's stream mode.
HOPS = {"text": (True, None), "image": (False, True, None)}

# Piped to a file, rich would wrap at 80 columns: the table is wider.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)


# -- processes ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Children:
    """The processes this bench starts, each in its own session (process group), all
    stopped on exit: SIGINT first (lets a profiler write its file), then SIGKILL. They
    run in the bench's temporary folder, not the repository, so that `-m` finds the
    packages the interpreter (and PYTHONPATH) would, not the checkout's folders."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=self.log_dir,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, name: str) -> None:
        """Stop one of them (SIGINT, then SIGKILL after 10 s) and forget it."""
        proc = self.procs.pop(name)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.procs.clear()


def wait_healthy(url: str, proc: subprocess.Popen, children: Children, name: str,
                 timeout_s: float = 60.0, want_ok: bool = False) -> None:
    """Until GET url/health answers 200 (and, with want_ok, says status ok: the proxy
    answers 200 'degraded' while an encoder is not yet known healthy)."""
    deadline = time.monotonic() + timeout_s
    ok_grace = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{children.log_tail(name)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                body = resp.read()
                if resp.status == 200:
                    if not want_ok or time.monotonic() > ok_grace:
                        return
                    with contextlib.suppress(ValueError):
                        if json.loads(body).get("status") == "ok":
                            return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s:\n{children.log_tail(name)}")


class CpuMeter:
    """CPU seconds (user + system) of a process and its descendants."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)

    def seconds(self) -> float:
        total = 0.0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total


# -- the load client ------------------------------------------------------------------
def new_session(limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


HEADERS = {"content-type": "application/json"}


async def one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> str | None:
    """Send one request and read its whole answer; an error's description, else None."""
    try:
        async with session.post(url, data=body, headers=HEADERS) as resp:
            data = await resp.read()
            if resp.status != 200:
                return f"HTTP {resp.status}: {data[:120].decode(errors='replace')}"
            if stream:
                if not data.rstrip().endswith(b"data: [DONE]"):
                    return "stream ended without [DONE]"
            elif b'"choices"' not in data:
                return "answer without choices"
            return None
    except asyncio.TimeoutError:
        return "timeout"
    except (aiohttp.ClientError, OSError) as err:
        return f"{type(err).__name__}: {err}"[:160]


class Outcome:
    """What the client saw of one cell: per-request latencies (s) and errors."""

    def __init__(self):
        self.latencies: list[float] = []
        self.errors: collections.Counter = collections.Counter()
        self.send_lags: list[float] = []
        self.completed_all = 0  # warm-up included (for CPU per request)
        self.rate = 0.0


async def closed_loop(url: str, body: bytes, stream: bool, concurrency: int,
                      warmup_s: float, seconds: float) -> Outcome:
    """`concurrency` connections, each sending its next request when the last one is
    answered. Counts requests sent after the warm-up; the rate is those answered
    before the end over the measured time."""
    out = Outcome()
    now = time.perf_counter
    in_window = 0
    async with new_session(concurrency) as session:
        t_warm = now() + warmup_s
        t_end = t_warm + seconds

        async def worker() -> None:
            nonlocal in_window
            while True:
                t0 = now()
                if t0 >= t_end:
                    return
                err = await one(session, url, body, stream)
                t1 = now()
                out.completed_all += 1
                if t0 < t_warm:
                    continue
                if err is None:
                    out.latencies.append(t1 - t0)
                    if t1 <= t_end:
                        in_window += 1
                else:
                    out.errors[err] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    out.rate = in_window / seconds
    return out


async def open_loop(url: str, body: bytes, stream: bool, rate: float, warmup_s: float,
                    seconds: float, seed: int = 0) -> Outcome:
    """Poisson arrivals at `rate`, each request on its own (no cap on connections);
    requests scheduled in the warm-up are not counted."""
    out = Outcome()
    now = time.perf_counter
    n = int(rate * (warmup_s + seconds))
    offsets = poisson(n, rate, seed)
    ok_in_window = 0

    async with new_session(0) as session:
        t0 = now() + 0.05

        async def send(scheduled: float) -> None:
            nonlocal ok_in_window
            sent = now()
            err = await one(session, url, body, stream)
            end = now()
            out.completed_all += 1
            if scheduled < warmup_s:
                return
            out.send_lags.append(sent - (t0 + scheduled))
            if err is None:
                out.latencies.append(end - sent)
                if end - t0 <= warmup_s + seconds:
                    ok_in_window += 1
            else:
                out.errors[err] += 1

        tasks = []
        for offset in offsets:
            due = t0 + offset
            wait = due - now()
            if wait > SPIN_WINDOW_S:
                await asyncio.sleep(wait - SPIN_WINDOW_S)
            while now() < due:
                await asyncio.sleep(0)
            tasks.append(asyncio.create_task(send(float(offset))))
        await asyncio.gather(*tasks)
    out.rate = ok_in_window / seconds
    return out


# -- figures --------------------------------------------------------------------------
def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def describe(out: Outcome, subtract_s: float = 0.0) -> dict:
    lat = np.asarray(out.latencies)
    added = lat - subtract_s
    return {
        "rate": round(out.rate, 1),
        "ok": len(out.latencies),
        "errors": sum(out.errors.values()),
        "error_kinds": dict(out.errors.most_common(3)),
        "latency_ms": {"p50": ms(pct(lat, 50)), "p99": ms(pct(lat, 99)),
                       "mean": ms(float(lat.mean())) if len(lat) else None},
        "added_ms": {"p50": ms(pct(added, 50)), "p99": ms(pct(added, 99))},
    }


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    direct = [c for c in result["direct"]["closed_loop"]]
    ax_rate.plot([c["concurrency"] for c in direct], [c["rate"] for c in direct], "k--o",
                 label="direct (one fake, text)")
    for path_name in ("text", "image"):
        for stream in (False, True):
            cells = [c for c in result["proxied"]
                     if c["path"] == path_name and c["stream"] == stream]
            if not cells:
                continue
            label = f"{path_name}{' stream' if stream else ''}"
            style = "-o" if not stream else ":s"
            conc = [c["concurrency"] for c in cells]
            ax_rate.plot(conc, [c["rate"] for c in cells], style, label=label)
            ax_lat.plot(conc, [c["added_ms"]["p99"] or np.nan for c in cells], style,
                        label=f"{label} p99")
    if result["floor"] is not None:  # what the stack allows: plain answers only
        for path_name, color in (("text", "0.45"), ("image", "0.7")):
            cells = [c for c in result["floor"]["proxied"]
                     if c["path"] == path_name and not c["stream"]]
            conc = [c["concurrency"] for c in cells]
            ax_rate.plot(conc, [c["rate"] for c in cells], "--^", color=color, lw=0.9,
                         label=f"floor {path_name}")
            ax_lat.plot(conc, [c["added_ms"]["p99"] or np.nan for c in cells], "--^",
                        color=color, lw=0.9, label=f"floor {path_name} p99")
    for o in result["open_loop"]:
        if o["added_ms"]["p99"] is not None:
            ax_lat.axhline(o["added_ms"]["p99"], lw=0.8, ls="-.",
                           color="tab:red" if o["path"] == "text" else "tab:purple",
                           label=f"{o['path']} open loop {o['target_rate']:.0f}/s p99")
    ax_lat.axhline(GOAL_P99_ADDED_MS, color="grey", lw=0.8, label="goal (5 ms)")
    ticks = sorted({c["concurrency"] for c in direct + result["proxied"]})
    for ax in (ax_rate, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (closed loop)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_rate.set_ylabel("achieved rate (req/s)")
    ax_rate.set_title("rate")
    ax_lat.set_ylabel("added latency p99 (ms)")
    ax_lat.set_title("added latency (proxied - direct hops)")
    fig.suptitle(f"proxy overhead vs instant fakes: {result['label']} "
                 f"({os.cpu_count()} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run --------------------------------------------------------------------------
def build_bodies() -> dict[tuple[str, bool], bytes]:
    image = image_data_url(make_image(64, 64))
    bodies = {}
    for stream in (False, True):
        bodies["text", stream] = json.dumps(chat_body(
            MODEL, "Hello! Please say something short.", max_tokens=MAX_TOKENS,
            stream=stream)).encode()
        bodies["image", stream] = json.dumps(chat_body(
            MODEL, "Describe the image.", [image], max_tokens=MAX_TOKENS,
            stream=stream)).encode()
    return bodies


def proxy_config(port: int, fakes: dict[str, int]) -> dict:
    """A plain dict: the proxy's JSON config (ProxyConfig's field names)."""
    instances = []
    for role, fport in fakes.items():
        entry = {"name": f"fake-{role.lower()}", "roles": role,
                 "url": f"http://127.0.0.1:{fport}"}
        if role == "P":
            entry["kv_endpoint"] = f"127.0.0.1:{free_port()}"  # fakes ignore it
        instances.append(entry)
    return {"model": MODEL, "host": "127.0.0.1", "port": port, "kv_protocol": "epd",
            "instances": instances, "health_interval_s": 2.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short cells (about 1 min)")
    parser.add_argument("--seconds", type=float, help="measured time per closed-loop cell "
                        "(default 4, quick 1.5)")
    parser.add_argument("--warmup", type=float, help="warm-up per cell (default 0.5, quick 0.3)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--open-rate", type=float, default=200.0)
    parser.add_argument("--open-seconds", type=float, help="open-loop run (default 10, quick 4)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for the fakes (and the default proxy command)")
    parser.add_argument("--proxy-cmd", default=None,
                        help="command that runs the proxy, given --config PATH after it "
                             "(default: '<python> -m epd_serve.proxy')")
    parser.add_argument("--label", default=DEFAULT_LABEL, help="names this proxy in the "
                        "output; files get a -<label> suffix unless it is the default")
    parser.add_argument("--fake-cmd", default=None,
                        help="command that runs one fake instance, given --port N --name X "
                             "after it (default: '<python> -m epd_serve.testing.fake_server "
                             "--forget-requests')")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the floor: the same cells through benchmarks/floor_proxy.py")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5)
    open_seconds = args.open_seconds or (4.0 if args.quick else 10.0)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    proxy_argv = (shlex.split(args.proxy_cmd) if args.proxy_cmd
                  else [args.python, "-m", "epd_serve.proxy"])

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # Also when started in the background of a script, which ignores SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "proxy_bench" if args.label == DEFAULT_LABEL else f"proxy_bench-{args.label}"
    work = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    children = Children(work)
    try:
        result = measure(args, children, work, proxy_argv, seconds, warmup, open_seconds,
                         concurrencies)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the fakes and the proxy")
        return 130
    except RuntimeError as err:  # a fake or the proxy did not come up
        console.print(str(err), style="red", markup=False)
        return 1
    finally:
        children.stop_all()
    json_path = args.out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2))
    png_path = args.out_dir / f"{stem}.png"
    plot(result, png_path)
    report(result)
    console.print(f"wrote {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}"
                  f" and {png_path.name}")
    s = result["summary"]
    line = (f"summary: p99_added_ms_at_200={fmt(s['p99_added_ms_at_200'], 1)} "
            f"text_rate_vs_direct={fmt(s['text_rate_vs_direct'], 1)} "
            f"image_rate_vs_direct={fmt(s['image_rate_vs_direct'], 1)}")
    if result["floor"] is not None:
        f = result["floor"]["summary"]
        line += (f" floor_p99_added_ms_at_200={fmt(f['p99_added_ms_at_200'], 1)} "
                 f"floor_text_rate_vs_direct={fmt(f['text_rate_vs_direct'], 1)} "
                 f"floor_image_rate_vs_direct={fmt(f['image_rate_vs_direct'], 1)}")
    print(line)
    return 0


def measure(args, children: Children, work: Path, proxy_argv: list[str], seconds: float,
            warmup: float, open_seconds: float, concurrencies: list[int]) -> dict:
    load_start = os.getloadavg()[0]
    if load_start > 0.5 * (os.cpu_count() or 1):
        console.print(f"warning: load average {load_start:.1f} on {os.cpu_count()} CPUs before "
                      "the start: other work shares the cores, the numbers will be noisy")
    bodies = build_bodies()
    fakes = {role: free_port() for role in ("E", "P", "D")}
    fake_argv = (shlex.split(args.fake_cmd) if args.fake_cmd else
                 [args.python, "-m", "epd_serve.testing.fake_server", "--forget-requests"])
    for role, port in fakes.items():
        name = f"fake-{role.lower()}"
        children.start(name, [*fake_argv, "--port", str(port), "--name", name])
    for role, port in fakes.items():
        name = f"fake-{role.lower()}"
        wait_healthy(f"http://127.0.0.1:{port}", children.procs[name], children, name)
    console.print(f"fakes up: {', '.join(f'{r}:{p}' for r, p in fakes.items())} "
                  f"(logs in {work})")

    # direct: one fake, no proxy running yet
    direct_url = f"http://127.0.0.1:{fakes['P']}{CHAT}"
    direct_cells = []
    for c in concurrencies:
        out = run_loop(closed_loop(direct_url, bodies["text", False], False, c, warmup, seconds))
        cell = {"concurrency": c, **describe(out)}
        direct_cells.append(cell)
        console.print(f"direct text c={c:<3} {cell['rate']:8.1f} req/s  "
                      f"p50 {fmt(cell['latency_ms']['p50'])} ms  p99 "
                      f"{fmt(cell['latency_ms']['p99'])} ms  errors {cell['errors']}")
    hop_ms: dict[str, dict[str, float | None]] = {"text": {}, "image": {}}
    for kind in ("text", "image"):
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            if kind == "text" and not stream and 1 in concurrencies:
                cell = next(c for c in direct_cells if c["concurrency"] == 1)
            else:
                out = run_loop(closed_loop(direct_url, bodies[kind, stream], stream, 1,
                                           warmup, max(1.0, seconds / 2)))
                cell = describe(out)
            hop_ms[kind][mode] = cell["latency_ms"]["p50"]
            console.print(f"direct hop {kind:5} {mode:6} c=1  p50 {fmt(hop_ms[kind][mode])} ms"
                          f"  errors {cell['errors']}")
    direct_rate = max((c["rate"] for c in direct_cells), default=0.0)

    def hop_sum_s(kind: str, stream: bool) -> float:
        total = 0.0
        for hop in HOPS[kind]:
            mode = "stream" if (stream if hop is None else hop) else "plain"
            total += (hop_ms[kind][mode] or 0.0) / 1e3
        return total

    def run_proxy(name: str, argv: list[str]) -> dict:
        port = free_port()
        config = proxy_config(port, fakes)
        config_path = work / f"{name}.json"
        config_path.write_text(json.dumps(config, indent=2))
        proc = children.start(name, [*argv, "--config", str(config_path)])
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, children, name, want_ok=True)
        console.print(f"{name} up on {port}: {' '.join(argv)}")
        try:
            return {"proxy_config": config, **measure_proxy(
                name, url, CpuMeter(proc.pid), bodies, hop_sum_s, args, warmup, seconds,
                open_seconds, concurrencies, direct_rate)}
        finally:
            children.stop(name)

    ours = run_proxy("proxy", proxy_argv)
    floor = (run_proxy("floor", [args.python, str(FLOOR_PROXY)])
             if args.floor else None)
    return {
        "label": args.label,
        "proxy_cmd": proxy_argv,
        "fake_cmd": fake_argv,
        "cpus": os.cpu_count(),
        "load_avg_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "settings": {"seconds": seconds, "warmup_s": warmup, "open_seconds": open_seconds,
                     "open_rate": args.open_rate, "concurrency": concurrencies,
                     "max_tokens": MAX_TOKENS, "image": "64x64 JPEG data URL"},
        "direct": {"rate": direct_rate, "closed_loop": direct_cells, "hop_p50_ms": hop_ms},
        **ours,
        "floor": floor,
    }


def measure_proxy(name: str, url: str, cpu: CpuMeter, bodies: dict, hop_sum_s, args,
                  warmup: float, seconds: float, open_seconds: float,
                  concurrencies: list[int], direct_rate: float) -> dict:
    """Every proxied cell through the proxy at `url`: closed loop per path, stream mode
    and concurrency, then the open loop per path; and the summary of them."""
    proxied = []
    for kind in ("text", "image"):
        for stream in (False, True):
            for c in concurrencies:
                cpu0 = cpu.seconds()
                out = run_loop(closed_loop(url + CHAT, bodies[kind, stream], stream, c,
                                           warmup, seconds))
                cpu_s = cpu.seconds() - cpu0
                cell = {"path": kind, "stream": stream, "concurrency": c,
                        "hops": len(HOPS[kind]),
                        "hop_sum_ms": round(hop_sum_s(kind, stream) * 1e3, 3),
                        **describe(out, hop_sum_s(kind, stream)),
                        "proxy_cpu_ms_per_req": (round(cpu_s * 1e3 / out.completed_all, 3)
                                                 if out.completed_all else None),
                        "proxy_cpu_util": round(cpu_s / (warmup + seconds), 2)}
                proxied.append(cell)
                console.print(
                    f"{name} {kind:5} {'stream' if stream else 'plain':6} c={c:<3} "
                    f"{cell['rate']:8.1f} req/s  added p50 {fmt(cell['added_ms']['p50'])} "
                    f"p99 {fmt(cell['added_ms']['p99'])} ms  cpu "
                    f"{fmt(cell['proxy_cpu_ms_per_req'])} ms/req  errors {cell['errors']}")

    open_cells = []
    for kind in ("text", "image"):
        cpu0 = cpu.seconds()
        out = run_loop(open_loop(url + CHAT, bodies[kind, False], False, args.open_rate,
                                 warmup, open_seconds))
        cpu_s = cpu.seconds() - cpu0
        lags = np.asarray(out.send_lags)
        cell = {"path": kind, "stream": False, "target_rate": args.open_rate,
                "seconds": open_seconds, "hop_sum_ms": round(hop_sum_s(kind, False) * 1e3, 3),
                **describe(out, hop_sum_s(kind, False)),
                "send_lag_ms_p99": ms(pct(lags, 99)),
                "proxy_cpu_ms_per_req": (round(cpu_s * 1e3 / out.completed_all, 3)
                                         if out.completed_all else None)}
        open_cells.append(cell)
        console.print(f"{name} open loop {kind:5} {args.open_rate:.0f}/s  "
                      f"{cell['rate']:8.1f} req/s  added p50 {fmt(cell['added_ms']['p50'])} "
                      f"p99 {fmt(cell['added_ms']['p99'])} ms  send lag p99 "
                      f"{fmt(cell['send_lag_ms_p99'])} ms  errors {cell['errors']}")

    def best_rate(kind: str) -> float:
        return max((c["rate"] for c in proxied if c["path"] == kind and not c["stream"]),
                   default=0.0)

    def vs_direct(kind: str) -> float | None:
        return round(best_rate(kind) / direct_rate * 100, 1) if direct_rate else None

    text_open = next(c for c in open_cells if c["path"] == "text")
    return {
        "proxied": proxied,
        "open_loop": open_cells,
        "summary": {
            "p99_added_ms_at_200": text_open["added_ms"]["p99"],
            "text_rate_vs_direct": vs_direct("text"),
            "image_rate_vs_direct": vs_direct("image"),
            "best_text_rate": best_rate("text"),
            "best_image_rate": best_rate("image"),
            "direct_rate": direct_rate,
            "goals": {"p99_added_ms_at_200": GOAL_P99_ADDED_MS,
                      "text_rate_vs_direct": GOAL_TEXT_PCT,
                      "image_rate_vs_direct": GOAL_IMAGE_PCT},
        },
    }


def report(result: dict) -> None:
    table = Table(title=f"proxy overhead ({result['label']}): direct rate "
                        f"{result['direct']['rate']:.0f} req/s; added = latency - "
                        "direct c=1 hop medians; floor = benchmarks/floor_proxy.py")
    for col in ("via", "path", "stream", "conc", "req/s", "% direct", "lat p50", "lat p99",
                "added p50", "added p99", "proxy CPU ms/req", "errors"):
        table.add_column(col, justify="left" if col in ("via", "path", "stream") else "right")
    direct_rate = result["direct"]["rate"] or float("nan")
    for c in result["direct"]["closed_loop"]:
        table.add_row("direct", "text", "no", str(c["concurrency"]), f"{c['rate']:.1f}",
                      f"{c['rate'] / direct_rate * 100:.1f}", fmt(c["latency_ms"]["p50"]),
                      fmt(c["latency_ms"]["p99"]), "", "", "", str(c["errors"]))
    runs = [("proxy", result)] + ([("floor", result["floor"])] if result["floor"] else [])
    for via, run in runs:
        for c in run["proxied"] + run["open_loop"]:
            conc = (f"open {c['target_rate']:.0f}/s" if "target_rate" in c
                    else str(c["concurrency"]))
            table.add_row(via, c["path"], "yes" if c["stream"] else "no", conc,
                          f"{c['rate']:.1f}", f"{c['rate'] / direct_rate * 100:.1f}",
                          fmt(c["latency_ms"]["p50"]), fmt(c["latency_ms"]["p99"]),
                          fmt(c["added_ms"]["p50"]), fmt(c["added_ms"]["p99"]),
                          fmt(c["proxy_cpu_ms_per_req"]), str(c["errors"]))
    console.print(table)
    hop = result["direct"]["hop_p50_ms"]
    console.print("direct hop medians (ms): " + ", ".join(
        f"{k} {m} {fmt(v, 3)}" for k, modes in hop.items() for m, v in modes.items()))
    for via, run in runs:
        for c in run["proxied"] + run["open_loop"]:
            if c["errors"]:
                console.print(f"errors via {via} in {c['path']} "
                              f"{'stream' if c['stream'] else 'plain'} "
                              f"{c.get('concurrency', 'open')}: {c['error_kinds']}")
    goals = result["summary"]["goals"]
    for via, run in runs:
        s = run["summary"]
        console.print(
            f"{'goals' if via == 'proxy' else 'floor'}: p99 added at 200/s "
            f"{fmt(s['p99_added_ms_at_200'], 1)} ms (< {goals['p99_added_ms_at_200']:.0f}), "
            f"text {fmt(s['text_rate_vs_direct'], 1)}% (>= {goals['text_rate_vs_direct']:.0f}), "
            f"image {fmt(s['image_rate_vs_direct'], 1)}% "
            f"(>= {goals['image_rate_vs_direct']:.0f}) of direct")


if __name__ == "__main__":
    sys.exit(main())
