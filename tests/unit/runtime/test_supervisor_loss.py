"""Losing the supervisor costs the deployment nothing: children do not die with it, and
their logs reach their files through relays of their own, so a supervisor stopped or
killed blocks no child; `epd-serve up` started again adopts what runs instead of
starting a second deployment, and stops it all when told."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import psutil

from epd_serve.deployment import schema
from epd_serve.instances.payloads import chat_body
from epd_serve.runtime.launcher import Launcher

from tests.waiting import wait_for
from .test_config_launcher import REPO, FakeEnginePlatform, make_dep, pid_alive

# `epd-serve up` in miniature: SIGTERM and Ctrl-C stop everything (cli/main.py).
SUPERVISOR = textwrap.dedent("""
    import json, signal, sys
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from epd_serve.deployment import schema
    from epd_serve.deployment.resolve import resolve
    from epd_serve.runtime.launcher import Launcher
    from tests.unit.runtime.test_config_launcher import FakeEnginePlatform
    dep = resolve(schema.Deployment(**json.loads(Path(sys.argv[1]).read_text())),
                  Path(sys.argv[2]))
    launcher = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
    def _terminate(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _terminate)  # before "up": the test may stop it at once
    try:
        launcher.start()
        launcher.wait_healthy()
        print("up", flush=True)
        launcher.run_forever(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        launcher.stop()
""")


def start_supervisor(tmp_path, dep) -> subprocess.Popen:
    (tmp_path / "dep.json").write_text(dep.config.model_dump_json())
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR.format(repo=str(REPO)))
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "dep.json"),
                                str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "up"
    return process


def answers(dep) -> bool:
    resp = httpx.post(dep.proxy_url + "/v1/chat/completions", json=chat_body("fake", "hi"),
                      timeout=10)
    return resp.status_code == 200


def test_a_killed_supervisor_leaves_the_deployment_serving_and_up_adopts_it(tmp_path):
    dep = make_dep(tmp_path, "P-D")
    supervisor = start_supervisor(tmp_path, dep)
    state = json.loads((dep.work_dir / "state.json").read_text())
    pids = state["children"]
    supervisor.kill()  # kill -9 of `epd-serve up`
    supervisor.wait(timeout=10)
    adopted = None
    try:
        time.sleep(0.5)  # a parent-death signal would have struck by now
        assert all(pid_alive(pid) for pid in pids.values())
        assert answers(dep)
        # `up` again: adopts, starts nothing new, and supervises from now on.
        started = time.monotonic()
        adopted = Launcher(dep, FakeEnginePlatform(), on_event=lambda msg: None)
        assert adopted.adopt()
        took = time.monotonic() - started
        assert {c.name: c.process.pid for c in adopted.children} == pids
        assert answers(dep) and took < 5.0
        # A child that dies now is restarted by the adopter.
        decode = next(name for name in pids if name.startswith("d"))
        os.killpg(pids[decode], signal.SIGKILL)

        def restarted() -> bool:
            adopted.supervise_once()
            return adopted._child_named(decode).process.pid != pids[decode]

        wait_for(restarted, "decode restarted by the adopting supervisor", timeout=30)
        adopted.wait_healthy()
        assert answers(dep)
    finally:
        (adopted or Launcher(dep, FakeEnginePlatform())).stop()
    assert not any(pid_alive(pid) for pid in pids.values())


def test_a_second_up_of_a_supervised_deployment_is_refused(tmp_path):
    dep = make_dep(tmp_path, "P-D")
    supervisor = start_supervisor(tmp_path, dep)
    pids = json.loads((dep.work_dir / "state.json").read_text())["children"]
    try:
        second = Launcher(dep, FakeEnginePlatform())
        try:
            second.adopt()
            raise AssertionError("a second supervisor was allowed")
        except schema.ConfigError:
            raise
        except Exception as err:  # LaunchError
            assert f"already supervised by `epd-serve up` (pid {supervisor.pid})" in str(err)
    finally:
        supervisor.terminate()  # SIGTERM: the supervisor stops everything
        supervisor.wait(timeout=60)
    assert not any(pid_alive(pid) for pid in pids.values())


def test_a_stopped_supervisor_blocks_no_childs_output(tmp_path):
    """A child that writes far more than a pipe holds, while its supervisor is stopped,
    finishes, and every line reaches its log."""
    script = tmp_path / "stopped.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from epd_serve.runtime.child import Child
        child = Child(name="chatty", env={{}}, log_path=Path(sys.argv[1]), health_url="",
                      command=[sys.executable, "-c",
                               "import time; time.sleep(1); "
                               "[print('line', i, 'x' * 200) for i in range(30000)]"])
        child.start()
        print(child.process.pid, flush=True)
        time.sleep(600)
    """))
    log = tmp_path / "chatty.log"
    supervisor = subprocess.Popen([sys.executable, str(script), str(log)],
                                  stdout=subprocess.PIPE, text=True)
    pid = int(supervisor.stdout.readline())
    supervisor.send_signal(signal.SIGSTOP)  # before the child writes its first line
    try:
        child = psutil.Process(pid)
        # 6 MB through a 1 MiB pipe: only a reader lets it end (a zombie then, its
        # parent being stopped).
        wait_for(lambda: child.status() == psutil.STATUS_ZOMBIE, "the child done", timeout=60)
        wait_for(lambda: log.is_file() and "line 29999 " in log.read_text(), "every line",
                 timeout=30)
        assert sum(1 for line in log.read_text().splitlines() if line.startswith("line ")) \
            == 30000
    finally:
        supervisor.send_signal(signal.SIGCONT)
        supervisor.kill()
        supervisor.wait(timeout=10)
