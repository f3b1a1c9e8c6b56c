"""Start-up never claims success it did not have: a deployment whose instance dies on
its first request fails bring-up, naming the instance and showing its log, and is
stopped; one whose warm-up is answered only because another stage stood in for a dead
one fails too, naming the stage; one that answers is warmed up. The demo, too, says
what failed when an instance dies under it, and shows the instance as down instead of
a traceback."""

from __future__ import annotations

import contextlib
import io
import sys
from urllib.parse import urlparse

import httpx
import pytest
from rich.console import Console

from epd_serve.cli.demo import show_requests
from epd_serve.proxy import ProxyConfig, create_app
from epd_serve.runtime import bringup
from epd_serve.runtime.launcher import Launcher
from epd_serve.runtime.progress import allows_videos, warm_up
from epd_serve.runtime.supervision import LaunchError
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

from tests.unit.proxy.harness import ProxyThread
from tests.waiting import wait_for
from .test_config_launcher import FakeEnginePlatform, make_dep, pid_alive

# An instance that starts and answers probes, then dies on a request (the first unless
# told otherwise), as a decode worker killed by SIGILL does (its engine exits, -4).
DIES_ON_A_REQUEST = """
import os, sys
from aiohttp import web
port = int(sys.argv[sys.argv.index("--port") + 1])
left = int(sys.argv[sys.argv.index("--answer") + 1])
async def ok(request):
    return web.Response(text="")
async def generate(request):
    global left
    if left:
        left -= 1
        return web.json_response({"choices": [{"message": {"content": "ok"}}], "usage": {}})
    print("Worker proc VllmWorker-0 died unexpectedly (exit code: -4)", flush=True)
    os._exit(4)
app = web.Application()
app.router.add_get("/health", ok)
app.router.add_get("/metrics", ok)
app.router.add_post("/v1/chat/completions", generate)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


# E-PD: the merged instance pd0 is the only one that can answer (with P or D of a split
# deployment gone, the proxy lets the other stage stand in).
NOTATION = "E-PD"


class MergedDiesOnFirstRequest(FakeEnginePlatform):
    answers = 0  # requests pd0 answers before it dies

    def command(self, launch):
        if launch.name != "pd0":
            return super().command(launch)
        return [sys.executable, "-c", DIES_ON_A_REQUEST, "--port", str(launch.port),
                "--answer", str(self.answers)]


class MergedDiesAfterTheWarmUp(MergedDiesOnFirstRequest):
    answers = 3  # the warm-up's two and the demo's first


def test_a_failed_warm_up_names_the_instance_and_shows_its_log(tmp_path):
    dep = make_dep(tmp_path, NOTATION)
    launcher = Launcher(dep, MergedDiesOnFirstRequest(), on_event=lambda msg: None)
    launcher.start()
    try:
        launcher.wait_healthy()
        with pytest.raises(LaunchError) as info:
            warm_up(dep, timeout=30)
    finally:
        launcher.stop()
    message = str(info.value)
    assert message.startswith("the text warm-up request")
    assert "pd0 [PD]:" in message and "e0 [E]" not in message
    assert "died unexpectedly (exit code: -4)" in message  # the tail of pd0's log


def test_bring_up_fails_and_stops_everything_when_the_warm_up_fails(tmp_path, monkeypatch):
    dep = make_dep(tmp_path, NOTATION)
    started = []

    def fake_launcher(dep):
        started.append(Launcher(dep, MergedDiesOnFirstRequest(), on_event=lambda msg: None))
        return started[0]

    monkeypatch.setattr(bringup, "launcher_for", fake_launcher)
    with pytest.raises(LaunchError, match="pd0"):
        bringup.bring_up(dep)
    pids = [child.process.pid for child in started[0].children]
    assert pids and not any(pid_alive(pid) for pid in pids)


def test_a_warm_up_answered_by_a_stand_in_fails_naming_the_stage(tmp_path, monkeypatch):
    # The deployment's proxy with fake E and D instances and its prefill instance gone:
    # the proxy answers 200, decode having computed the prompt (FALLBACK=P>D).
    dep = make_dep(tmp_path, "E-P-D")
    port = urlparse(dep.proxy_url).port
    with contextlib.ExitStack() as stack:
        entries = []
        for launch in dep.launches:
            roles = launch.instance.roles
            url = ("http://127.0.0.1:9" if roles == "P"  # nothing listens: refused
                   else stack.enter_context(ThreadedServer(create_fake_app(launch.name))).url)
            entries.append({"name": launch.name, "roles": roles, "url": url,
                            **({"kv_endpoint": "127.0.0.1:30100"} if roles == "P" else {})})
        # The stages are the operator's (the default): the warm-up is shown them with
        # the bring-up's internal token, and fails where it is not.
        monkeypatch.setenv("EPD_INTERNAL_TOKEN", "bring-up")
        config = ProxyConfig(model="fake", instances=entries, port=port, health_interval_s=0.05)
        stack.enter_context(ProxyThread(create_app(config), port=port))
        wait_for(lambda: httpx.get(dep.proxy_url + "/health").json().get("stand_ins")
                 == ["P>D"], "the proxy to see prefill down")
        with pytest.raises(LaunchError, match="did not show which stages"):
            warm_up(dep, timeout=30, operator_token="wrong")
        with pytest.raises(LaunchError) as info:
            warm_up(dep, timeout=30, operator_token="bring-up")
    message = str(info.value)
    assert message.startswith("the text warm-up request")
    assert "stage P (prefill) has no healthy instance, D did its work" in message
    assert "FALLBACK=P>D" in message
    assert "p0 [P]: down" in message  # the instance to look at, with its log


def test_a_deployment_that_answers_is_warmed_up(tmp_path):
    dep = make_dep(tmp_path, "E-P-D")
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    launcher.start()
    try:
        launcher.wait_healthy()
        # text and image through E, P and D, shown their stages: no error
        warm_up(dep, timeout=30, operator_token=launcher.internal_token)
    finally:
        launcher.stop()


def test_the_demo_shows_an_instance_that_died_and_says_what_failed(tmp_path):
    dep = make_dep(tmp_path, NOTATION)
    launcher = Launcher(dep, MergedDiesAfterTheWarmUp(), on_event=lambda msg: None)
    launcher.start()
    console = Console(file=io.StringIO(), width=200)
    try:
        launcher.wait_healthy()
        warm_up(dep, timeout=30, operator_token=launcher.internal_token)
        failures = show_requests(dep, console)
    finally:
        launcher.stop()
    shown = console.file.getvalue()
    assert "down or restarting" in shown  # pd0's row, once it died
    assert len(failures) == 3  # the first request was answered, the next three not
    assert all("pd0 [PD]" in f and "exit code: -4" in f for f in failures)


def test_a_deployment_that_takes_videos_is_warmed_up_with_one_too(tmp_path):
    dep = make_dep(tmp_path, "E-P-D",
                   engine_args={"limit_mm_per_prompt": '{"image":4,"video":{"count":4}}'})
    assert allows_videos(dep.config.engine_args)
    assert not allows_videos({"limit_mm_per_prompt": '{"image":4,"video":0}'})
    assert not allows_videos({})  # the model may take no video at all
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    launcher.start()
    try:
        launcher.wait_healthy()
        warm_up(dep, timeout=30, operator_token=launcher.internal_token)
        e0 = next(l.url for l in dep.launches if l.name == "e0")
        seen = httpx.get(e0 + "/_requests").json()
    finally:
        launcher.stop()
    parts = [part for request in seen for part in request["body"]["messages"][0]["content"]]
    assert any(part["type"] == "video_url" for part in parts), parts
