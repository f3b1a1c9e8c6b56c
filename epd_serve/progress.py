"""Start-up feedback for people: a live table of every process, and the warm-up.

Runs in the CLI process (rich + httpx).
"""

from __future__ import annotations

import sys

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from epd_serve.payloads import chat_body, image_data_url, make_image


class StartupProgress:
    """`with StartupProgress(dep) as p: launcher.wait_healthy(p.update)`"""

    def __init__(self, dep):
        self.dep = dep
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=2, transient=False)
        self.roles = {launch.name: launch.instance.roles for launch in dep.launches}
        cluster = dep.config.cluster
        # With a cluster, which node each process runs on (the proxy and store: the head).
        self.nodes = ({launch.name: launch.node for launch in dep.launches} if cluster else None)
        self.head = cluster.head_node.name if cluster else None

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        return self.live.__exit__(*exc)

    def update(self, children, elapsed: float) -> None:
        ready = sum(1 for c in children if c.healthy)
        table = Table(title=f"{self.dep.config.name}: {self.dep.plan.to_notation()}, "
                            f"{ready}/{len(children)} healthy after {elapsed:.0f}s")
        columns = ["process", "stages", *(["node"] if self.nodes else []), "state", "log"]
        for column in columns:
            table.add_column(column)
        for child in children:
            code = child.exit_code()
            state = ("[green]healthy" if child.healthy
                     else f"[red]exited ({code})" if code is not None else "[yellow]starting")
            stages = self.roles.get(child.name, "router" if child.name == "proxy" else "store")
            node = [self.nodes.get(child.name, self.head)] if self.nodes else []
            table.add_row(child.name, stages, *node, state, str(child.log_path))
        self.live.update(table)


def warm_up(dep, timeout: float = 300.0) -> None:
    """One text and one image request through the proxy: the first request of an
    instance pays one-off costs (kernel set-up, the KV transfer handshake) that should
    not land on a user's or a benchmark's first request."""
    model = dep.launches[0].served_model_name
    image = image_data_url(make_image(448, 448, seed=12345))
    with httpx.Client(base_url=dep.proxy_url, timeout=timeout) as client:
        for body in (chat_body(model, "warm up", max_tokens=2),
                     chat_body(model, "warm up", [image], max_tokens=2)):
            resp = client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                print(f"warm-up request failed: {resp.status_code} {resp.text[:200]}",
                      file=sys.stderr)
