"""The start-up plan is what every launcher starts: for each shipped deployment file,
the local launcher (`epd-serve up`), the shell script (`launch --emit-shell`) and the Ray
launcher start exactly the plan's processes, in its order, with its command lines and
environments, each after the processes it waits on serve. Nothing is started here: the
launchers' process spawning is replaced by a recorder."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from epd_serve.runtime import deploy
from epd_serve.runtime import launcher as local
from epd_serve.runtime import plan as plan_mod
from epd_serve.runtime.child import Child
from epd_serve.runtime.plan import RUN_DIR, fill_run_dir, startup_plan
from epd_serve.runtime.shell import emit_shell

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(REPO.glob("configs/*/*.yaml"))
ONE_HOST = [p for p in SHIPPED if "cluster:" not in p.read_text()]
CLUSTER = [p for p in SHIPPED if "cluster:" in p.read_text()]


def load(path: Path, tmp_path: Path):
    return deploy.load(path, work_dir=str(tmp_path / "work"))


def name_of(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def test_every_shipped_file_is_covered():
    assert len(ONE_HOST) >= 10 and len(CLUSTER) == 3


@pytest.mark.parametrize("path", SHIPPED, ids=name_of)
def test_the_plan_starts_the_store_then_the_instances_in_plan_order_then_the_proxy(
        path, tmp_path):
    dep = load(path, tmp_path)
    steps = startup_plan(dep)
    stores = [s.name for s in steps if s.kind == "store"]
    assert [s.name for s in steps] == [*stores, *(l.name for l in dep.launches), "proxy"]
    assert bool(stores) == (dep.mm_store is not None)
    for position, step in enumerate(steps):
        # A store's server waits on the one before it; everything else on all of them.
        expected = stores[:position] if step.kind == "store" else stores
        assert list(step.waits_on) == expected, step.name
    for step, launch in zip(steps[len(stores):], dep.launches):
        assert step.command == tuple(dep.platform.command(launch))
        assert step.env == dep.platform.environment(launch)
        assert (step.node, step.devices, step.address) == (launch.node, launch.devices,
                                                            launch.host)
    proxy = steps[-1]
    assert proxy.health_url == f"{dep.proxy_url}/ready"
    assert "--config" in proxy.command and RUN_DIR in proxy.command[-1]
    assert set(proxy.files) == {plan_mod.PROXY_CONFIG_FILE}


@pytest.mark.parametrize("path", ONE_HOST, ids=name_of)
def test_the_local_launcher_starts_the_plan(path, tmp_path, monkeypatch):
    dep = load(path, tmp_path)
    started: list[Child] = []
    waited: list[tuple[str, int]] = []  # (step waited on, how many had started by then)
    monkeypatch.setattr(local, "preflight", lambda dep: None)
    monkeypatch.setattr(Child, "start", lambda child: started.append(child))
    monkeypatch.setattr(local, "wait_serving",
                        lambda child, refresh: waited.append((child.name, len(started))))
    launcher = local.Launcher(dep, on_event=lambda msg: None)
    monkeypatch.setattr(launcher, "_write_state", lambda: None)
    launcher.start()

    work = str(dep.work_dir)
    steps = startup_plan(dep)
    assert [(c.name, c.command, c.env, c.health_url) for c in started] == [
        (s.name, [fill_run_dir(w, work) for w in s.command], s.env, s.health_url) for s in steps]
    # Each waited-on step is waited for once, before the first step that needs it starts.
    first_needing = {}
    for index, step in enumerate(steps):
        for name in step.waits_on:
            first_needing.setdefault(name, index)
    assert waited == sorted(first_needing.items(), key=lambda item: item[1])
    proxy_json = dep.work_dir / plan_mod.PROXY_CONFIG_FILE
    assert f'"roster_path": "{work}/{plan_mod.ROSTER_FILE}"' in proxy_json.read_text()


@pytest.mark.parametrize("path", ONE_HOST, ids=name_of)
def test_the_shell_script_starts_the_plan(path, tmp_path):
    dep = load(path, tmp_path)
    script = emit_shell(dep)
    steps = startup_plan(dep)
    started = re.findall(r'>"\$WORK/logs/([\w.-]+)\.log" 2>&1 &', script)
    assert started == [s.name for s in steps]
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    for step in steps:
        expected = ["$PYTHON" if w == sys.executable else fill_run_dir(w, "$WORK")
                    for w in step.command]
        at = next(i for i, w in enumerate(words) if words[i:i + len(expected)] == expected)
        env = words[at - len(step.env):at]
        assert dict(w.split("=", 1) for w in env) == step.env, step.name
    # Waits: each waited-on step before the first step that needs it; then every step.
    lines = script.splitlines()
    for step in steps:
        start = next(i for i, line in enumerate(lines) if f'logs/{step.name}.log"' in line)
        for name in step.waits_on:
            wait = lines.index(f"wait_serving {name} {shlex.quote(_url(steps, name))}")
            assert wait < start
        assert f"wait_serving {step.name} {shlex.quote(step.health_url)}" in lines


def _url(steps, name):
    return next(s.health_url for s in steps if s.name == name)


@pytest.mark.parametrize("path", CLUSTER, ids=name_of)
def test_the_ray_launcher_starts_the_plan(path, tmp_path, monkeypatch):
    pytest.importorskip("ray")  # the cluster extra, installed with the dev setup
    from epd_serve.runtime import ray_launcher

    dep = load(path, tmp_path)
    launcher = ray_launcher.RayLauncher(dep, on_event=lambda msg: None)
    started = []  # (spec, node, health url, has its device group)
    events = []
    monkeypatch.setattr(launcher, "_connect", lambda: None)
    monkeypatch.setattr(launcher, "_forward_logs", lambda: None)
    monkeypatch.setattr(launcher, "_write_state", lambda: None)
    monkeypatch.setattr(launcher, "_reserve_devices", lambda: events.append("reserve") or {
        l.name: ("group", 1.0) for l in dep.launches})
    monkeypatch.setattr(ray_launcher, "PlacementGroupSchedulingStrategy", lambda g, i: g)

    def add_child(spec, node, health_url, options):
        started.append((spec, node, health_url, options.get("scheduling_strategy")))
        events.append(spec.name)
        child = ray_launcher.RayChild(name=spec.name, node=node, health_url=health_url,
                                      log_path=tmp_path / spec.name)
        launcher.children.append(child)
        return child

    monkeypatch.setattr(launcher, "_add_child", add_child)
    monkeypatch.setattr(ray_launcher, "wait_serving",
                        lambda child, refresh: events.append(f"wait {child.name}"))
    launcher.start()

    steps = startup_plan(dep)
    assert [(s.name, s.command, s.env, s.address, s.ports, s.files) for s, *_ in started] == [
        (st.name, list(st.command), st.env, st.address, st.ports, st.files) for st in steps]
    assert [(node, url) for _, node, url, _ in started] == [(s.node, s.health_url)
                                                            for s in steps]
    # Devices are reserved once, before the first instance; only instances take a group.
    assert events.index("reserve") == events.index(dep.launches[0].name) - 1
    assert [group is not None for *_, group in started] == [s.launch is not None for s in steps]
    for step in steps:
        for name in step.waits_on:
            assert events.index(f"wait {name}") < events.index(step.name)
