"""The per-process actor of multi-node deployments, driven directly (no Ray): it
starts its process with the given environment, restarts it (after a back-off, never
giving up), keeps its log (read whole across rollovers), refuses to start where the
node lacks a port or the model, survives errors of its own, and kills the whole tree
on stop."""

from __future__ import annotations

import socket
import sys
import time

import psutil
import pytest

from epd_serve.deployment.schema import Supervision
from epd_serve.runtime import ray_host
from epd_serve.runtime.child import Child
from epd_serve.runtime.ray_host import ProcessHost, ProcessSpec

from tests.ports import free_port_block
from tests.waiting import wait_for


def spec(code: str, **extra) -> ProcessSpec:
    fields = {"name": "worker", "command": [sys.executable, "-c", code], "env": {},
              "tag": f"test/worker/{time.monotonic_ns()}", "address": "127.0.0.1", **extra}
    return ProcessSpec(**fields)


def read_all(host: ProcessHost) -> bytes:
    data, offset = host.read_log(0)
    return data


def test_process_runs_with_its_environment_and_files_and_its_log_is_read_in_pieces(tmp_path):
    code = ("import os, pathlib; print('hello', os.environ['GREETING'], "
            "pathlib.Path(os.environ['CONF']).read_text(), flush=True); import time; time.sleep(60)")
    host = ProcessHost(spec(code, env={"GREETING": "node", "CONF": "{run_dir}/c.txt"},
                            files={"c.txt": "conf in {run_dir}"}), run_root=str(tmp_path))
    try:
        text = wait_for(lambda: b"hello" in read_all(host) and read_all(host),
                        "the process's greeting in its log", timeout=20)
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


@pytest.fixture
def quick_rounds(monkeypatch):
    monkeypatch.setattr(ray_host, "SUPERVISE_INTERVAL_S", 0.02)


def collect_events(host: ProcessHost, events: list[str]) -> dict:
    status = host.status()
    events.extend(status["events"])  # each event is reported once
    return status


def test_a_crash_looping_process_keeps_being_restarted_after_its_backoff(tmp_path,
                                                                        quick_rounds):
    host = ProcessHost(spec("print('run', flush=True); raise SystemExit(4)",
                            supervision=Supervision(rapid_restarts=1, backoff_s=0.1,
                                                    backoff_max_s=0.2)),
                       run_root=str(tmp_path))
    events: list[str] = []
    try:
        # Far past the two restarts it used to get before giving up.
        wait_for(lambda: collect_events(host, events)["restarts"] >= 5, "five restarts",
                 timeout=60)
        status = host.status()
        assert not status["gave_up"] and status["error"] is None
        assert events[:6] == ["worker exited with code 4; restarting (restart 1)",
                              "worker exited with code 4; 2 crashes in a row, backing off: "
                              "next try in 0.1 s",
                              "worker: back-off over; restarting (restart 2)",
                              "worker exited with code 4; 3 crashes in a row, backing off: "
                              "next try in 0.2 s",
                              "worker: back-off over; restarting (restart 3)",
                              "worker exited with code 4; 4 crashes in a row, backing off: "
                              "next try in 0.2 s"]
        assert wait_for(lambda: "backing off, next try in" in host.status()["state"],
                        "backing off again", timeout=20)
        # The first start and five restarts (each log relay writes as it reads).
        wait_for(lambda: read_all(host).count(b"run\n") >= 6, "six runs logged", timeout=20)
    finally:
        host.stop()


def test_a_process_that_cannot_start_is_reported_and_tried_until_it_can(tmp_path,
                                                                       quick_rounds):
    program = tmp_path / "engine"  # not there yet, as after a half-done upgrade
    host = ProcessHost(spec("", command=[str(program)],
                            supervision=Supervision(rapid_restarts=0, backoff_s=0.05,
                                                    backoff_max_s=0.1)),
                       run_root=str(tmp_path))
    events: list[str] = []
    try:
        wait_for(lambda: collect_events(host, events) and len(events) >= 2,
                 "two failed starts reported", timeout=20)
        assert events[0].startswith("worker: could not start it (FileNotFoundError")
        assert events[0].endswith("1 crash in a row, backing off: next try in 0.05 s")
        assert host.status()["state"].startswith("could not start: FileNotFoundError")
        program.write_text("#!/bin/sh\necho started\nexec sleep 60\n")
        program.chmod(0o755)
        wait_for(lambda: b"started" in read_all(host), "the program started", timeout=20)
        # The supervisor marks it running once the start call returns, which may be just
        # after the program printed.
        status = wait_for(lambda: (got := collect_events(host, events))["state"] == "running"
                          and got, "the host reporting it running", timeout=20)
        assert status["pid"]
        assert events[-1].startswith("worker: back-off over; restarting (restart 1)")
    finally:
        host.stop()


def test_the_supervise_thread_outlives_an_error_of_its_own(tmp_path, quick_rounds,
                                                          monkeypatch):
    revive, calls = Child.revive, []

    def flaky_revive(child):
        calls.append(child)
        if len(calls) == 1:
            raise RuntimeError("psutil hiccup")
        return revive(child)

    monkeypatch.setattr(Child, "revive", flaky_revive)
    host = ProcessHost(spec("import time; time.sleep(0.3); raise SystemExit(4)"),
                       run_root=str(tmp_path))
    events: list[str] = []
    try:
        wait_for(lambda: collect_events(host, events)["restarts"] >= 1, "a restart",
                 timeout=20)
        assert events[0] == ("worker: supervising it failed (RuntimeError: psutil hiccup); "
                             "trying again")
        assert "worker exited with code 4; restarting (restart 1)" in events
    finally:
        host.stop()


def test_the_log_is_read_whole_across_its_rollovers(tmp_path):
    # Six batches of 25 KB into files of 64 KiB, each batch read before the next is
    # written: the reader is always behind by less than a file.
    batches, lines = 6, 500
    code = (f"import os, sys, time\n"
            f"for b in range({batches}):\n"
            f"    while not os.path.exists(os.path.join({str(tmp_path)!r}, f'go{{b}}')):\n"
            f"        time.sleep(0.01)\n"
            f"    for i in range({lines}):\n"
            f"        print(f'{{b}}:{{i:05d}} ' + 'y' * 40)\n"
            f"    sys.stdout.flush()\n"
            f"time.sleep(60)\n")
    host = ProcessHost(spec(code, supervision=Supervision(log_max_bytes="64KiB", log_files=3)),
                       run_root=str(tmp_path))
    read, offset = b"", 0

    def read_on() -> bool:
        nonlocal read, offset
        data, offset = host.read_log(offset)
        read += data
        return True

    try:
        for batch in range(batches):
            (tmp_path / f"go{batch}").touch()
            last = f"{batch}:{lines - 1:05d} ".encode()
            wait_for(lambda: read_on() and last in read, f"batch {batch} read", timeout=30)
        assert host.run_dir.joinpath("process.log.2").exists()  # it did roll over, twice
        printed = [line for line in read.decode().splitlines() if line[:1].isdigit()]
        assert printed == [f"{b}:{i:05d} " + "y" * 40 for b in range(batches)
                           for i in range(lines)]
    finally:
        host.stop()


def test_stop_kills_the_whole_tree(tmp_path):
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "time.sleep(120)")
    host = ProcessHost(spec(code), run_root=str(tmp_path))
    pid = wait_for(lambda: host.status()["pid"], "the process started", timeout=20)
    leader = psutil.Process(pid)
    grandchild = wait_for(lambda: leader.children(), "its child started", timeout=20)[0]
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
    pid = wait_for(lambda: first.status()["pid"], "the first process started", timeout=20)
    second = ProcessHost(first.spec, run_root=str(tmp_path))
    try:
        wait_for(lambda: not psutil.pid_exists(pid)
                 or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 "the first incarnation's process killed", timeout=20)
        assert wait_for(lambda: second.status()["pid"], "the second process started",
                        timeout=20) != pid
    finally:
        first._stopping.set()
        second.stop()
