"""`epd-serve demo`: the main job on a fresh machine.

Brings up a CPU deployment (E-P-D by default), sends text and image requests through
the proxy and prints, per request, what every instance's own counters say it did;
then runs a short load and writes its report; then shuts everything down.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from epd_serve.instance_metrics import Counters, snapshot
from epd_serve.payloads import chat_body, image_data_url, make_image


def describe(delta: Counters) -> str:
    """Human summary of what one instance did for one request."""
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


def traced_request(client: httpx.Client, dep, body: dict, path: str = "/v1/chat/completions",
                   ) -> tuple[httpx.Response, float, dict]:
    """Send one request through the proxy; return it, its latency and per-instance deltas."""
    logs = {launch.name: dep.work_dir / "logs" / f"{launch.name}.log" for launch in dep.launches}
    before = {l.name: snapshot(l.url, logs[l.name], client) for l in dep.launches}
    start = time.perf_counter()
    resp = client.post(dep.proxy_url + path, json=body)
    latency = (time.perf_counter() - start) * 1e3
    time.sleep(0.3)  # counters are published by the engine a moment after the reply
    after = {l.name: snapshot(l.url, logs[l.name], client) for l in dep.launches}
    return resp, latency, {name: after[name] - before[name] for name in after}


def show_requests(dep, console: Console) -> None:
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
    with httpx.Client(timeout=300.0) as client:
        for kind, body in requests:
            resp, latency, deltas = traced_request(client, dep, body)
            for i, launch in enumerate(dep.launches):
                first = i == 0
                table.add_row(
                    kind if first else "",
                    str(resp.status_code) if first else "",
                    f"{latency:.0f} ms" if first else "",
                    f"{launch.name} [{launch.instance.roles}]",
                    describe(deltas[launch.name]),
                    end_section=i == len(dep.launches) - 1,
                )
            console.print(f"{kind}: proxy stages {resp.headers.get('x-epd-stages', '-')}")
    console.print(table)


def run_demo(config_path: str, load_requests: int, out_dir: str) -> int:
    from epd_serve import deploy

    console = Console()
    dep = deploy.load(config_path)
    started = time.monotonic()
    launcher = deploy.bring_up(dep)
    console.print(f"[bold]{dep.config.name}[/] up and warmed in {time.monotonic() - started:.1f}s")
    try:
        show_requests(dep, console)
        if load_requests > 0:
            from epd_serve.bench.runner import quick_report

            report_dir = quick_report(dep, requests=load_requests, out_dir=Path(out_dir))
            console.print(f"load report: {report_dir}")
    finally:
        console.print("stopping the deployment ...")
        launcher.stop()
    console.print("done", style="green")
    return 0

