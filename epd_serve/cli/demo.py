"""`epd-serve demo`: the main job on a fresh machine.

Checks the machine first (`epd-serve doctor`), then brings up a CPU deployment (E-P-D
by default), sends text and image requests through the proxy and prints, per request,
what every instance's own counters say it did; then runs a short load and writes its
report; then shuts everything down. A request that fails is explained (which
instance, its log) and the demo exits 1.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from epd_serve.cli.doctor import run_doctor
from epd_serve.instances.counters import Counters, snapshot
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.proxy.upstream import error_message
from epd_serve.runtime.progress import explain_failure, instance_status
from epd_serve.runtime.supervision import log_dir

COUNTERS_WAIT_S = 10.0


def describe(delta: Counters | str) -> str:
    """Human summary of what one instance did for one request (or why nobody knows)."""
    if isinstance(delta, str):
        return f"[red]{delta}"
    parts = []
    if delta.ec_saved:
        parts.append(f"encoded {delta.ec_saved} image(s)")
    if delta.ec_loaded:
        prefetched = f" ({delta.ec_prefetched:.0f} prefetched)" if delta.ec_prefetched else ""
        parts.append(f"got {delta.ec_loaded} feature(s) from the MM Store{prefetched}")
    if delta.ec_encoded_locally:
        parts.append(f"encoded {delta.ec_encoded_locally:.0f} missing feature(s) itself")
    if delta.prompt_local:
        parts.append(f"computed {delta.prompt_local:.0f} prompt tok")
    if delta.prompt_external_kv:
        parts.append(f"received KV of {delta.prompt_external_kv:.0f} tok")
    if delta.generated:
        parts.append(f"generated {delta.generated:.0f} tok")
    return ", ".join(parts) or "-"


def read_counters(client: httpx.Client, dep) -> dict[str, Counters | str]:
    """Each instance's counters, or why they could not be read (it is down or restarting)."""
    counters: dict[str, Counters | str] = {}
    for launch in dep.launches:
        try:
            counters[launch.name] = snapshot(launch.url, log_dir(dep) / f"{launch.name}.log",
                                             client)
        except httpx.HTTPError as err:
            counters[launch.name] = f"down or restarting ({type(err).__name__})"
    return counters


def traced_request(client: httpx.Client, dep, body: dict, path: str = "/v1/chat/completions",
                   ) -> tuple[httpx.Response, float, dict[str, Counters | str]]:
    """Send one request through the proxy; return it, its latency and per-instance deltas
    (an instance that could not be read before or after gives why, not a delta). The
    engines publish their counters a moment after they answer: the deltas are read
    once they hold the tokens the answer says were generated (at most COUNTERS_WAIT_S)."""
    before = read_counters(client, dep)
    start = time.perf_counter()
    resp = client.post(dep.proxy_url + path, json=body)
    latency = (time.perf_counter() - start) * 1e3
    generated = _completion_tokens(resp)
    deadline = time.monotonic() + COUNTERS_WAIT_S
    while True:
        after = read_counters(client, dep)
        deltas = {name: _delta(after[name], before[name]) for name in after}
        counted = sum(d.generated for d in deltas.values() if not isinstance(d, str))
        if counted >= generated or time.monotonic() > deadline:
            return resp, latency, deltas
        time.sleep(0.05)


def _completion_tokens(resp: httpx.Response) -> int:
    """Tokens a JSON answer says it generated (0 for an error or a stream)."""
    try:
        return int(resp.json()["usage"]["completion_tokens"]) if resp.status_code == 200 else 0
    except (ValueError, KeyError, TypeError):
        return 0


def _delta(after: Counters | str, before: Counters | str) -> Counters | str:
    if isinstance(after, str):
        return after
    return before if isinstance(before, str) else after - before


def show_requests(dep, console: Console) -> list[str]:
    """Send the demo's requests and show what each instance did; returns what failed
    (each failure explained, with the logs of the instances it involved)."""
    model = dep.launches[0].served_model_name
    requests = [
        ("text", chat_body(model, "What is disaggregated serving?", max_tokens=16)),
        ("image 448x448", chat_body(model, "Describe the image.",
                                    [image_data_url(make_image(448, 448, seed=1))], max_tokens=16)),
        ("text", chat_body(model, "Count to ten.", max_tokens=16)),
        ("image 802x652", chat_body(model, "What is in it?",
                                    [image_data_url(make_image(802, 652, seed=2))], max_tokens=16)),
    ]
    table = Table(title=f"Requests through the proxy ({dep.plan.to_notation()}): "
                        "what each instance's own counters and log say it did")
    for column in ("request", "status", "latency", "instance", "did"):
        table.add_column(column)
    failures = []
    with httpx.Client(timeout=300.0) as client:
        for kind, body in requests:
            status_before = instance_status(client, dep.proxy_url)
            try:
                resp, latency, deltas = traced_request(client, dep, body)
            except httpx.HTTPError as err:  # the proxy itself did not answer
                failures.append(explain_failure(dep, f"{kind} request", f"{type(err).__name__}: "
                                                f"{err}", status_before, {}))
                table.add_row(kind, "[red]no answer", "-", "proxy", f"[red]{type(err).__name__}",
                              end_section=True)
                continue
            status = str(resp.status_code) if resp.status_code == 200 \
                else f"[red]{resp.status_code}"
            for i, launch in enumerate(dep.launches):
                first = i == 0
                table.add_row(
                    kind if first else "",
                    status if first else "",
                    f"{latency:.0f} ms" if first else "",
                    f"{launch.name} [{launch.instance.roles}]",
                    describe(deltas[launch.name]),
                    end_section=i == len(dep.launches) - 1,
                )
            if resp.status_code == 200:
                console.print(f"{kind}: proxy stages {resp.headers.get('x-epd-stages', '-')}")
            else:
                failures.append(explain_failure(
                    dep, f"{kind} request", f"HTTP {resp.status_code}: "
                    f"{error_message(resp.text)}", status_before,
                    instance_status(client, dep.proxy_url)))
    console.print(table)
    return failures


def run_demo(config_path: str, load_requests: int, out_dir: str) -> int:
    from epd_serve.runtime import bringup
    console = Console()
    if not run_doctor(config_path, console):
        console.print("[bold red]the doctor found errors that would stop the deployment[/]; "
                      "fix them first (each line says how)")
        return 1
    dep = bringup.load(config_path)
    started = time.monotonic()
    launcher = bringup.bring_up(dep)
    console.print(f"[bold]{dep.config.name}[/] up and warmed in {time.monotonic() - started:.1f}s")
    try:
        failures = show_requests(dep, console)
        if failures:
            for failure in failures:
                console.print(f"[red]{escape(failure)}")
            console.print(f"[bold red]{len(failures)} of the demo's requests failed[/]; "
                          "no load run")
            return 1
        if load_requests > 0:
            from epd_serve.bench.runner import quick_report

            report_dir, failed = quick_report(dep, requests=load_requests, out_dir=Path(out_dir))
            console.print(f"load report: {report_dir}")
            if failed:
                console.print(f"[bold red]{failed} request(s) of the load run failed[/] "
                              f"(their errors are in {report_dir})")
                return 1
    finally:
        console.print("stopping the deployment ...")
        launcher.stop()
    console.print("done", style="green")
    return 0
