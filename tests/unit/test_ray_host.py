"""The per-process actor of multi-node deployments, driven directly (no Ray): it
starts its process with the given environment, restarts it, keeps its log, refuses
to start where the node lacks a port or the model, and kills the whole tree on stop."""

from __future__ import annotations

import socket
import sys
import time

import psutil

from epd_serve.runtime.ray_host import ProcessHost, ProcessSpec

from ..ports import free_port_block


def spec(code: str, **extra) -> ProcessSpec:
    fields = {"name": "worker", "command": [sys.executable, "-c", code], "env": {},
              "tag": f"test/worker/{time.monotonic_ns()}", "max_restarts": 2,
              "address": "127.0.0.1", **extra}
    return ProcessSpec(**fields)


def wait_for(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def read_all(host: ProcessHost) -> bytes:
    data, offset = host.read_log(0)
    return data


def test_process_runs_with_its_environment_and_files_and_its_log_is_read_in_pieces(tmp_path):
    code = ("import os, pathlib; print('hello', os.environ['GREETING'], "
            "pathlib.Path(os.environ['CONF']).read_text(), flush=True); import time; time.sleep(60)")
    host = ProcessHost(spec(code, env={"GREETING": "node", "CONF": "{run_dir}/c.txt"},
                            files={"c.txt": "conf in {run_dir}"}), run_root=str(tmp_path))
    try:
        text = wait_for(lambda: b"hello" in read_all(host) and read_all(host))
        assert f"hello node conf in {host.run_dir}".encode() in text
        first, offset = host.read_log(0)
        rest, end = host.read_log(offset)
        assert rest == b"" and end == offset == len(first)
        # A log shorter than the offset asked for is a new incarnation's: read from 0.
        again, _ = host.read_log(offset + 10_000)
        assert again == first
        status = host.status()
        assert status["pid"] and status["exit_code"] is None and not status["gave_up"]
    finally:
        host.stop()


def test_exiting_process_is_restarted_then_given_up_with_events(tmp_path):
    host = ProcessHost(spec("print('run', flush=True); raise SystemExit(4)"),
                       run_root=str(tmp_path))
    events: list[str] = []

    def gave_up() -> bool:
        status = host.status()
        events.extend(status["events"])  # each event is reported once
        return status["gave_up"]

    try:
        wait_for(gave_up, timeout=30)
        status = host.status()
        assert status["restarts"] == 2 and status["exit_code"] == 4
        assert events == ["worker exited with code 4; restarting (1/2)",
                          "worker exited with code 4; restarting (2/2)",
                          "worker exited with code 4; restarted 2 times already, giving up "
                          f"(log: {host.run_dir / 'process.log'})"]
        assert read_all(host).count(b"run\n") == 3  # the first start and two restarts
    finally:
        host.stop()


def test_stop_kills_the_whole_tree(tmp_path):
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "time.sleep(120)")
    host = ProcessHost(spec(code), run_root=str(tmp_path))
    pid = wait_for(lambda: host.status()["pid"])
    leader = psutil.Process(pid)
    grandchild = wait_for(lambda: leader.children())[0]
    host.stop()
    for proc in (leader, grandchild):
        assert not psutil.pid_exists(proc.pid) or proc.status() == psutil.STATUS_ZOMBIE


def test_a_busy_port_or_a_missing_model_is_reported_and_nothing_starts(tmp_path):
    port = free_port_block(1, start=26000)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        host = ProcessHost(spec("print('started')", ports={port: "instance e0"}),
                           run_root=str(tmp_path))
        assert host.status()["error"] == f"port {port} (instance e0) on 127.0.0.1 is in use"
        assert host.status()["gave_up"] and host.status()["pid"] is None
    missing = tmp_path / "no-model"
    host = ProcessHost(spec("print('started')", required_path=str(missing)),
                       run_root=str(tmp_path))
    assert host.status()["error"] == f"{missing} does not exist on node 127.0.0.1"
    assert host.stop() == 0


def test_a_new_incarnation_kills_what_an_earlier_one_left_running(tmp_path):
    # The same tag, as when Ray restarts an actor on the same machine.
    first = ProcessHost(spec("import time; time.sleep(120)"), run_root=str(tmp_path))
    pid = wait_for(lambda: first.status()["pid"])
    second = ProcessHost(first.spec, run_root=str(tmp_path))
    try:
        wait_for(lambda: not psutil.pid_exists(pid)
                 or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
        assert wait_for(lambda: second.status()["pid"]) != pid
    finally:
        first._stopping.set()
        second.stop()
