"""The start-up plan is what every launcher starts: for each shipped deployment file,
the local launcher (`epd-serve up`), the shell script (`launch --emit-shell`) and the Ray
launcher start exactly the plan's processes, in its order, with its command lines and
environments, each after the processes it waits on serve. Instances that share a device
start one after another; those on devices of their own start together. Nothing is
started here: the launchers' process spawning is replaced by a recorder."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from epd_serve.runtime import bringup
from epd_serve.runtime import launcher as local
from epd_serve.runtime import plan as plan_mod
from epd_serve.runtime.child import Child
from epd_serve.proxy.tenancy import INTERNAL_TOKEN_ENV
from epd_serve.runtime.plan import (
    RUN_DIR,
    fill_run_dir,
    span_export_env,
    startup_plan,
    with_internal_token,
)
from epd_serve.runtime.shell import emit_shell

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted(REPO.glob("configs/*/*.yaml"))
ONE_HOST = [p for p in SHIPPED if "cluster:" not in p.read_text()]
CLUSTER = [p for p in SHIPPED if "cluster:" in p.read_text()]


def load(path: Path, tmp_path: Path):
    return bringup.load(path, work_dir=str(tmp_path / "work"))


def name_of(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


# Shipped files whose instances share devices: instance -> (the instance before it on
# its device, which it waits for, and the device). Every other shipped file: no
# instance waits for another (cpu/e+p-d.yaml co-locates logical slots, not devices).
DEVICE_WAITS = {
    **{f"{platform}/e+pd.yaml": {f"pd{i}": (f"e{i}", f"{device}:{i}") for i in range(8)}
       for platform, device in (("h800", "cuda"), ("atlas-800i-a2", "npu"))},
    **{f"{platform}/e+p-d.yaml": {f"p{i}": (f"e{i}", f"{device}:{i}") for i in range(4)}
       for platform, device in (("h800", "cuda"), ("atlas-800i-a2", "npu"))},
    **{f"{platform}/e+d-p.yaml": {f"d{i}": (f"e{i}", f"{device}:{i}") for i in range(4)}
       for platform, device in (("h800", "cuda"), ("atlas-800i-a2", "npu"))},
}
CO_LOCATED = [p for p in SHIPPED if name_of(p) in DEVICE_WAITS]


def device_waits_of(steps) -> dict[str, dict[str, str]]:
    """Instance -> the instances it waits for, with why."""
    instances = {s.name for s in steps if s.kind == "instance"}
    return {s.name: {n: why for n, why in s.waits_on.items() if n in instances}
            for s in steps if s.kind == "instance"}


def expected_events(dep, waits: dict[str, tuple[str, str]]) -> list[str]:
    """How a launcher walks the plan, given which instance waits for which (`waits`, as
    in DEVICE_WAITS): the stores, each waited for; every instance that waits for none
    at once, in plan order; then each that shares a device, after the health of the one
    before it there; then the proxy."""
    stores = [s.name for s in startup_plan(dep) if s.kind == "store"]
    events = []
    for index, name in enumerate(stores):
        events += [f"wait {stores[index - 1]}"] if index else []
        events.append(f"start {name}")
    events += [f"wait {stores[-1]}"] if stores else []
    events += [f"start {l.name}" for l in dep.launches if l.name not in waits]
    for launch in dep.launches:
        if launch.name in waits:
            events += [f"wait {waits[launch.name][0]}", f"start {launch.name}"]
    return events + ["start proxy"]


def test_every_shipped_file_is_covered():
    assert len(ONE_HOST) >= 10 and len(CLUSTER) == 3
    assert len(CO_LOCATED) == len(DEVICE_WAITS) == 6


@pytest.mark.parametrize("path", SHIPPED, ids=name_of)
def test_the_plan_starts_the_store_then_the_instances_then_the_proxy(
        path, tmp_path):
    dep = load(path, tmp_path)
    steps = startup_plan(dep)
    stores = [s.name for s in steps if s.kind == "store"]
    # The instances that wait for a neighbour's health come after those that do not.
    waiting = DEVICE_WAITS.get(name_of(path), {})
    first = [l.name for l in dep.launches if l.name not in waiting]
    assert [s.name for s in steps] == [*stores, *first, *waiting, "proxy"]
    assert bool(stores) == (dep.mm_store is not None)
    for position, step in enumerate(steps):
        # A store's server waits on the one before it; everything else on all of them,
        # and an instance also on the instance before it on its device.
        expected = stores[:position] if step.kind == "store" else stores
        assert list(step.waits_on)[:len(expected)] == expected, step.name
        assert all(why for why in step.waits_on.values()), step.name
    assert device_waits_of(steps) == {
        l.name: ({waiting[l.name][0]: f"they share {waiting[l.name][1]}"}
                 if l.name in waiting else {}) for l in dep.launches}
    launches = {l.name: l for l in dep.launches}
    for step in steps[len(stores):-1]:
        launch = launches[step.name]
        assert step.command == tuple(dep.platform.command(launch))
        assert step.env == {**dep.platform.environment(launch), **span_export_env(launch)}
        # An engine exporting spans sends them with the bring-up's internal token.
        assert ("OTEL_EXPORTER_OTLP_TRACES_HEADERS" in step.env) == bool(launch.traces_endpoint)
        assert (step.node, step.devices, step.address) == (launch.node, launch.devices,
                                                            launch.host)
        assert step.start_timeout_s == dep.config.health_timeout_s  # loads a model
    proxy = steps[-1]
    assert proxy.health_url == f"{dep.proxy_url}/ready"
    assert "--config" in proxy.command and RUN_DIR in proxy.command[-1]
    assert set(proxy.files) == {plan_mod.PROXY_CONFIG_FILE}


@pytest.mark.parametrize("path", ONE_HOST, ids=name_of)
def test_the_local_launcher_starts_the_plan(path, tmp_path, monkeypatch):
    dep = load(path, tmp_path)
    started: list[Child] = []
    events: list[str] = []
    timeouts: dict[str, float] = {}
    notes: list[str] = []
    monkeypatch.setattr(local, "preflight", lambda dep: None)
    monkeypatch.setattr(Child, "start",
                        lambda child: started.append(child) or events.append(f"start {child.name}"))

    def wait_serving(child, refresh, timeout_s):
        events.append(f"wait {child.name}")
        timeouts[child.name] = timeout_s

    monkeypatch.setattr(local, "wait_serving", wait_serving)
    launcher = local.Launcher(dep, on_event=notes.append)
    monkeypatch.setattr(launcher, "_write_state", lambda: None)
    launcher.start()

    work = str(dep.work_dir)
    steps = startup_plan(dep)
    token = launcher._internal_token
    assert [(c.name, c.command, c.env, c.health_url) for c in started] == [
        (s.name, [fill_run_dir(w, work) for w in s.command], with_internal_token(s.env, token),
         s.health_url) for s in steps]
    # The proxy and every engine that exports spans share one token, new each bring-up.
    proxy_child = next(c for c in started if c.name == "proxy")
    assert proxy_child.env[INTERNAL_TOKEN_ENV] == token and len(token) == 32
    assert all(c.env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == f"x-epd-internal-token={token}"
               for c in started if "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in c.env)
    # Each waited-on step is waited for once, before the first step that needs it starts;
    # an instance that shares a device only after the one before it there serves.
    waits = DEVICE_WAITS.get(name_of(path), {})
    assert events == expected_events(dep, waits)
    assert notes == [f"{step.name} waits for {name}'s health: {why}"
                     for step, name, why in first_waits(steps)]
    for instance, (earlier, device) in waits.items():
        assert f"{instance} waits for {earlier}'s health: they share {device}" in notes
        assert timeouts[earlier] == dep.config.health_timeout_s  # a vLLM start, not a store's
    assert all(timeouts[s.name] == plan_mod.STORE_START_TIMEOUT_S
               for s in steps if s.kind == "store" and s.name in timeouts)
    proxy_json = dep.work_dir / plan_mod.PROXY_CONFIG_FILE
    assert f'"roster_path": "{work}/{plan_mod.ROSTER_FILE}"' in proxy_json.read_text()


def first_waits(steps):
    """(step, the step it waits on, why) for each wait a launcher carries out: the first
    step that needs a given one."""
    seen: set[str] = set()
    for step in steps:
        for name, why in step.waits_on.items():
            if name not in seen:
                seen.add(name)
                yield step, name, why


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
        assert dict(w.split("=", 1) for w in env) == with_internal_token(
            step.env, "$EPD_INTERNAL_TOKEN"), step.name
    # Up to the proxy's start: the waits of the plan, each said why, where they belong;
    # then every step is waited for.
    lines = script.splitlines()
    events = []
    for index, line in enumerate(lines):
        if match := re.match(r"wait_serving ([\w.-]+) ", line):
            events.append(f"wait {match[1]}")
            assert lines[index - 1].startswith("echo "), line
        elif match := re.search(r'>"\$WORK/logs/([\w.-]+)\.log" 2>&1 &', line):
            events.append(f"start {match[1]}")
            if match[1] == "proxy":
                break
    assert events == expected_events(dep, DEVICE_WAITS.get(name_of(path), {}))
    for step, name, why in first_waits(steps):
        assert f'echo "{step.name} waits for {name}\'s health: {why}"' in lines
    for step in steps:
        assert f"wait_serving {step.name} {shlex.quote(step.health_url)}" in lines
    for instance, (earlier, device) in DEVICE_WAITS.get(name_of(path), {}).items():
        wait = lines.index(f'echo "{instance} waits for {earlier}\'s health: they share {device}"')
        assert lines[wait + 1].startswith(f"wait_serving {earlier} ")
        assert lines[wait + 2].startswith(f"# {instance}: ")


def ray_recorder(dep, tmp_path, monkeypatch, ray_launcher):
    """A Ray launcher for `dep` whose actors, placement groups and health waits are
    recorded in `events` instead; returns (launcher, started, events, notes)."""
    notes: list[str] = []
    launcher = ray_launcher.RayLauncher(dep, on_event=notes.append)
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
        events.append(f"start {spec.name}")
        child = ray_launcher.RayChild(name=spec.name, node=node, health_url=health_url,
                                      log_path=tmp_path / spec.name)
        launcher.children.append(child)
        return child

    monkeypatch.setattr(launcher, "_add_child", add_child)
    monkeypatch.setattr(ray_launcher, "wait_serving",
                        lambda child, refresh, timeout_s: events.append(f"wait {child.name}"))
    return launcher, started, events, notes


@pytest.mark.parametrize("path", CLUSTER, ids=name_of)
def test_the_ray_launcher_starts_the_plan(path, tmp_path, monkeypatch):
    pytest.importorskip("ray")  # the cluster extra, installed with the dev setup
    from epd_serve.runtime import ray_launcher

    dep = load(path, tmp_path)
    launcher, started, events, notes = ray_recorder(dep, tmp_path, monkeypatch, ray_launcher)
    launcher.start()

    steps = startup_plan(dep)
    token = launcher._internal_token
    assert [(s.name, s.command, s.env, s.address, s.ports, s.files) for s, *_ in started] == [
        (st.name, list(st.command), with_internal_token(st.env, token), st.address, st.ports,
         st.files) for st in steps]
    assert [(node, url) for _, node, url, _ in started] == [(s.node, s.health_url)
                                                            for s in steps]
    # Devices are reserved once, before the first instance; only instances take a group.
    assert events.index("reserve") == events.index(f"start {dep.launches[0].name}") - 1
    assert [group is not None for *_, group in started] == [s.launch is not None for s in steps]
    events.remove("reserve")
    assert events == expected_events(dep, {})  # no file here co-locates instances
    assert notes == [f"{step.name} waits for {name}'s health: {why}"
                     for step, name, why in first_waits(steps)]


def test_the_ray_launcher_starts_instances_sharing_a_device_one_after_another(
        tmp_path, monkeypatch):
    """Co-located groups spread over two nodes: cuda:0 of node0 and cuda:0 of node1 are
    different devices, so p1 waits for e1 (on node1), not for p0 or e0."""
    pytest.importorskip("ray")
    from epd_serve.runtime import ray_launcher

    nodes = [{"name": f"node{i}", "address": f"10.0.0.{i + 1}", "devices": list(range(8))}
             for i in range(2)]
    dep = bringup.load(REPO / "configs/h800/two-node.yaml", work_dir=str(tmp_path / "work"),
                      deployment="(E-P)x4-(E-D)x4-4P-4D",
                      cluster={"address": "auto", "head": "node0", "nodes": nodes})
    assert [(l.name, l.node, l.devices) for l in dep.launches[:4]] == [
        ("e0", "node0", (0,)), ("p0", "node0", (0,)), ("e1", "node1", (0,)),
        ("p1", "node1", (0,))]
    waits = {f"p{i}": (f"e{i}", f"cuda:{i // 2} on node{i % 2}") for i in range(4)}
    waits |= {f"d{i}": (f"e{i + 4}", f"cuda:{i // 2 + 2} on node{i % 2}") for i in range(4)}
    assert device_waits_of(startup_plan(dep)) == {
        l.name: ({waits[l.name][0]: f"they share {waits[l.name][1]}"}
                 if l.name in waits else {}) for l in dep.launches}

    launcher, started, events, notes = ray_recorder(dep, tmp_path, monkeypatch, ray_launcher)
    launcher.start()
    events.remove("reserve")
    assert events == expected_events(dep, waits)
    assert "p1 waits for e1's health: they share cuda:0 on node1" in notes


def test_cpu_instances_on_one_slot_start_together(tmp_path):
    """The cpu platform's devices are logical slots: (E-P) there starts both at once."""
    dep = load(REPO / "configs/cpu/e+p-d.yaml", tmp_path)
    assert dep.launches[0].devices == dep.launches[1].devices == (0,)
    steps = startup_plan(dep)
    assert [s.name for s in steps] == ["mmstore", "e0", "p0", "d0", "proxy"]
    assert all(list(s.waits_on) == ["mmstore"] for s in steps[1:])


def test_a_proxy_override_keeps_the_files_other_proxy_keys(tmp_path):
    """Tests and benchmarks override a key or two of `proxy:`; the shipped CPU files'
    stage_headers (their clients are their operator) must survive that."""
    dep = bringup.load(REPO / "configs/cpu/2e-pd.yaml", work_dir=str(tmp_path / "work"),
                       proxy={"routing": {"E": "least-loaded"}, "role_control": True})
    proxy = dep.config.proxy
    assert proxy.stage_headers == "clients" and proxy.role_control.enabled
    assert proxy.routing.E == "least-loaded"
    assert proxy.routing.encoder_batch != 2  # routing itself replaced, as named
    shared = bringup.load(REPO / "configs/h800/e-p-d.yaml", work_dir=str(tmp_path / "w2"))
    assert shared.config.proxy.stage_headers == "operator"
