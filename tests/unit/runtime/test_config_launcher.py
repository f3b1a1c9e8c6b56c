"""Deployment files, preflight errors, and the launcher supervising fake instances."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from epd_serve.backends.cpu.platform import CpuPlatform
from epd_serve.deployment import schema
from epd_serve.deployment.resolve import resolve
from epd_serve.backends.hal import python_module_launcher
from epd_serve.instances.payloads import chat_body
from epd_serve.runtime.child import Child
from epd_serve.runtime.launcher import Launcher, preflight, stop_from_state
from epd_serve.runtime.shell import emit_shell
from epd_serve.runtime.supervision import LaunchError

from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[3]


class FakeEnginePlatform(CpuPlatform):
    """CPU command shapes, but each instance is the instant fake server."""

    def engine_launcher(self) -> list[str]:
        return [*python_module_launcher("epd_serve.testing.fake_server"), "--model"]

    def check_available(self) -> None:
        pass


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "configs" / "cpu" / "dep.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    return model


def make_dep(tmp_path: Path, notation: str = "E-P-D", **extra):
    base = free_port_block(40)
    fields = dict(name="fake", deployment=notation, model=str(fake_model(tmp_path)),
                  served_model_name="fake", proxy_port=base, base_port=base + 10,
                  kv_base_port=base + 30, work_dir=str(tmp_path / "work"),
                  mm_store={"capacity": "16MiB", "port": base + 20, "metrics_port": base + 21,
                            "prefetch_base_port": base + 24},
                  health_timeout_s=60, **extra)
    return resolve(schema.Deployment(**fields), tmp_path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd_serve.cli", *args],
                          capture_output=True, text=True, cwd=REPO)


# -- deployment files ------------------------------------------------------------
def test_unknown_key_is_a_one_line_error(tmp_path):
    path = write_config(tmp_path, "name: x\ndeployment: E-P-D\nmodel: m\nreplicas: 2\n")
    proc = run_cli("launch", str(path))
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and "unknown key 'replicas'" in line and "allowed keys" in line


def test_bad_notation_in_a_file_names_the_position(tmp_path):
    path = write_config(tmp_path, "name: x\ndeployment: E--D\nmodel: m\n")
    proc = run_cli("launch", str(path))
    assert proc.returncode == 2 and "position 2" in proc.stderr and "\n" not in proc.stderr.strip()


def test_missing_required_key_and_bad_yaml(tmp_path):
    proc = run_cli("launch", str(write_config(tmp_path, "name: x\nmodel: m\n")))
    assert "missing required key 'deployment'" in proc.stderr
    proc = run_cli("launch", str(write_config(tmp_path, "name: [x\n")))
    assert "not valid YAML" in proc.stderr and proc.returncode == 2


def test_relative_model_paths_resolve_against_the_project_root(tmp_path):
    path = write_config(tmp_path, "name: x\ndeployment: P-D\nmodel: .epd/models/m\n")
    cfg, root = schema.load(path)
    assert root == tmp_path.resolve()
    assert resolve(cfg, root).model_dir == tmp_path.resolve() / ".epd/models/m"


def test_a_missing_or_unusable_engine_interpreter_is_refused_by_name(tmp_path):
    path = write_config(tmp_path, "name: x\ndeployment: P-D\nmodel: m\n"
                                  "engine_python: .venv-other/bin/python\n")
    proc = run_cli("launch", str(path))
    assert proc.returncode == 2 and "\n" not in proc.stderr.strip()
    missing = tmp_path.resolve() / ".venv-other/bin/python"
    assert f"engine_python {missing} does not exist" in proc.stderr
    missing.parent.mkdir(parents=True)
    missing.write_text("")  # there, but not executable
    with pytest.raises(schema.ConfigError, match=f"engine_python {missing} is not executable"):
        resolve(*schema.load(path))


def test_plan_needing_more_devices_than_listed(tmp_path):
    with pytest.raises(schema.ConfigError, match="needs 3 devices but 'devices' lists 2"):
        make_dep(tmp_path, devices=[0, 1])


def test_missing_model_directory_says_how_to_build_one(tmp_path):
    path = write_config(tmp_path, f"name: x\ndeployment: P-D\nmodel: {tmp_path}/nothing\n"
                                  f"work_dir: {tmp_path}/w\nbase_port: {free_port_block(5)}\n")
    proc = run_cli("up", str(path))
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "epd-serve model tiny" in proc.stderr
    assert "\n" not in proc.stderr.strip()


def test_port_in_use_is_reported_with_its_user(tmp_path):
    dep = make_dep(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", dep.launches[1].port))
        holder.listen()
        # Worded as `epd-serve doctor` words its ports row (the same preflight check).
        with pytest.raises(schema.ConfigError, match=rf"ports in use: {dep.launches[1].port} "
                                                     r"\(instance p0\) on 127\.0\.0\.1"):
            Launcher(dep, FakeEnginePlatform()).start()


def test_shipped_configs_all_load():
    paths = sorted((REPO / "configs").glob("*/*.yaml"))
    assert {p.parent.name for p in paths} == {"cpu", "h800", "atlas-800i-a2"}
    for path in paths:
        cfg, root = schema.load(path)
        dep = resolve(cfg, root)
        # Wrong answers on purpose are for tests: no shipped file lets a client ask.
        assert not cfg.fault_injection, path
        assert all(("fault_injection", True) not in l.kv_config for l in dep.launches), path
        if cfg.platform != "cpu":  # one 8-device node, or 8 devices on each node
            nodes = len(cfg.cluster.nodes) if cfg.cluster else 1
            assert dep.plan.num_devices == 8 * nodes, path


# -- the launcher ----------------------------------------------------------------
def test_launcher_starts_supervises_restarts_and_stops(tmp_path):
    dep = make_dep(tmp_path)
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    launcher.start()
    try:
        launcher.wait_healthy()
        # The stages are the operator's: the bring-up's internal token shows them.
        resp = httpx.post(dep.proxy_url + "/v1/chat/completions", json=chat_body("fake", "hi"),
                          headers={"x-epd-internal-token": launcher.internal_token}, timeout=10)
        assert resp.status_code == 200 and resp.headers["x-epd-stages"].startswith("P=p0")
        assert (dep.work_dir / "state.json").is_file()

        victim = next(c for c in launcher.children if c.name == "d0")
        old_pid = victim.process.pid
        os.killpg(old_pid, signal.SIGKILL)
        victim.process.wait()
        events = launcher.supervise_once()
        assert events == ["d0 exited with code -9; restarting (restart 1)"]
        assert victim.process.pid != old_pid
        launcher.wait_healthy()
        pids = [c.process.pid for c in launcher.children]
    finally:
        launcher.stop()
    assert not any(pid_alive(p) for p in pids)
    assert not (dep.work_dir / "state.json").exists()


def test_engines_start_with_the_deployments_interpreter(tmp_path):
    """Each instance's engine runs under engine_python; the proxy stays on ours."""
    calls = tmp_path / "engine-python-calls"
    engine_python = tmp_path / "engine-env" / "bin" / "python"
    engine_python.parent.mkdir(parents=True)
    engine_python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    engine_python.chmod(0o755)
    dep = make_dep(tmp_path, "P-D", engine_python=str(engine_python))
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    launcher.start()
    try:
        launcher.wait_healthy()
    finally:
        launcher.stop()
    calls_made = calls.read_text().splitlines()
    # First the platform's check, in the engine environment (not in ours) ...
    assert calls_made[0].startswith("-c from epd_serve.backends import get_platform")
    # ... then the two engines.
    started = calls_made[1:]
    assert len(started) == 2
    assert all(line.startswith("-m epd_serve.testing.fake_server --model") for line in started)


def test_an_engine_environment_without_the_platforms_packages_is_refused(tmp_path):
    broken = tmp_path / "engine-env" / "bin" / "python"
    broken.parent.mkdir(parents=True)
    broken.write_text("#!/bin/sh\necho 'RuntimeError: the CPU backend needs vllm' >&2\nexit 1\n")
    broken.chmod(0o755)
    dep = make_dep(tmp_path, "P-D", engine_python=str(broken))
    with pytest.raises(LaunchError, match=f"engine environment {broken} is not ready for "
                                          "cpu: RuntimeError: the CPU backend needs vllm"):
        preflight(dep)


class FakeDevicePlatform(FakeEnginePlatform):
    """The fake engines, on a platform with devices (so co-located ones share one)."""

    device_type = "cuda"
    device_visibility_env = "CUDA_VISIBLE_DEVICES"


def test_instances_sharing_a_device_start_one_after_another(tmp_path, monkeypatch):
    dep = make_dep(tmp_path, "(E-P)-D")
    # When p0 starts: does e0, which it shares device 0 with, answer /health?
    e0_serving: list[bool] = []
    start = Child.start

    def recording_start(child):
        if child.name == "p0":
            try:
                e0_serving.append(httpx.get(f"{dep.launches[0].url}/health",
                                            timeout=1).status_code == 200)
            except httpx.HTTPError:
                e0_serving.append(False)
        start(child)

    monkeypatch.setattr(Child, "start", recording_start)
    notes: list[str] = []
    launcher = Launcher(dep, FakeDevicePlatform(), on_event=notes.append)
    launcher.start()
    try:
        # d0, on a device of its own, starts with e0; p0 once e0 serves.
        assert [c.name for c in launcher.children] == ["mmstore", "e0", "d0", "p0", "proxy"]
        assert e0_serving == [True]
        assert "p0 waits for e0's health: they share cuda:0" in notes
        launcher.wait_healthy()
    finally:
        launcher.stop()


def test_launcher_backs_off_once_the_restarts_made_at_once_are_spent(tmp_path):
    dep = make_dep(tmp_path, max_restarts=0)  # the older name of rapid_restarts
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    launcher.start()
    try:
        launcher.wait_healthy()
        child = next(c for c in launcher.children if c.name == "e0")
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()
        (event,) = launcher.supervise_once()
        assert event == "e0 exited with code -9; 1 crash in a row, backing off: next try in 1 s"
        assert launcher.supervise_once() == []  # waiting out the back-off, not given up
    finally:
        launcher.stop()


def test_down_stops_a_deployment_from_its_state_file(tmp_path):
    dep = make_dep(tmp_path, "P-D")
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    launcher.start()
    launcher.wait_healthy()
    pids = [c.process.pid for c in launcher.children]
    stopped = stop_from_state(dep.work_dir / "state.json", grace_s=5)
    assert sorted(stopped) == ["d0", "p0", "proxy"]
    for child in launcher.children:
        child.process.wait(timeout=10)
    assert not any(pid_alive(p) for p in pids)


def test_instance_dying_during_startup_fails_with_its_log(tmp_path):
    class Crashing(FakeEnginePlatform):
        def engine_launcher(self):
            return [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)",
                    "--model"]

    dep = make_dep(tmp_path, "P-D")
    launcher = Launcher(dep, Crashing(), on_event=lambda msg: None)
    launcher.start()
    try:
        with pytest.raises(LaunchError, match="exited with code 3") as info:
            launcher.wait_healthy()
        assert "boom: bad flag" in str(info.value)
    finally:
        launcher.stop()


def test_emitted_shell_script_is_valid_bash_with_every_instance(tmp_path):
    cfg, root = schema.load(REPO / "configs/atlas-800i-a2/e+p-d.yaml")
    dep = resolve(cfg, root)
    script = emit_shell(dep)
    path = tmp_path / "launch.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert script.count("ASCEND_RT_VISIBLE_DEVICES=") == len(dep.launches) == 12
    for launch in dep.launches:  # every instance, waited on before the proxy is
        assert f"wait_serving {launch.name} {launch.url}/health" in script
    assert "wait_serving proxy http://127.0.0.1:8000/ready" in script  # then the proxy, ready
    assert "EPDKVConnector" in script and "trap cleanup EXIT INT TERM" in script
