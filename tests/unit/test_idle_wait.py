"""The CPU platform's vLLM plugin: readers of vLLM's shared-memory queue nap on the
writer's notification socket instead of spinning in their busy window. Run against
vLLM's own SpinCondition, with real zmq sockets."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from epd_serve.backends.cpu import idle_wait
from epd_serve.backends.cpu.platform import CpuPlatform
from epd_serve.engines.hal import InstanceLaunch
from epd_serve.topology.notation import parse

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def condition_cls():
    """A subclass, so that patching it leaves vLLM's class as it was."""
    return type("SpinCondition", (shm_broadcast.SpinCondition,), {})


@pytest.fixture
def pair(condition_cls, tmp_path):
    import zmq

    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = condition_cls(False, context, address)
    reader = condition_cls(True, context, address)
    time.sleep(0.2)  # the subscription reaches the publisher
    yield writer, reader
    context.destroy(linger=0)


def waits_in(reader, n: int) -> tuple[float, float]:
    """Wall and CPU seconds of `n` waits of a reader that has just read."""
    reader.record_read()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        reader.wait(timeout_ms=5000)
    return time.perf_counter() - wall, time.thread_time() - cpu


def test_the_nap_comes_from_the_environment_and_a_bad_one_is_refused():
    assert idle_wait.nap_ms({}) is None
    assert idle_wait.nap_ms({idle_wait.ENV: "2"}) == 2
    for bad in ("0", "-1", "1.5", "soon"):
        with pytest.raises(ValueError, match=idle_wait.ENV):
            idle_wait.nap_ms({idle_wait.ENV: bad})


def test_vllm_readers_spin_in_their_busy_window(pair):
    _, reader = pair
    wall, _ = waits_in(reader, 200)
    assert wall < 0.1  # 200 sched_yield calls: no sleeping at all


def test_patched_readers_nap_instead_and_burn_no_cpu(condition_cls, pair):
    _, reader = pair
    assert idle_wait.nap_instead_of_spin(condition_cls, 2)
    wall, cpu = waits_in(reader, 50)
    assert wall >= 50 * 0.002 * 0.9  # each wait slept its nap
    assert cpu < wall / 4


def test_a_notification_ends_the_nap_at_once(condition_cls, pair):
    writer, reader = pair
    assert idle_wait.nap_instead_of_spin(condition_cls, 1000)
    reader.record_read()
    threading.Timer(0.05, writer.notify).start()
    start = time.perf_counter()
    reader.wait(timeout_ms=5000)
    assert 0.04 < time.perf_counter() - start < 0.5


def test_patching_twice_keeps_one_nap(condition_cls, pair):
    _, reader = pair
    idle_wait.nap_instead_of_spin(condition_cls, 50)
    idle_wait.nap_instead_of_spin(condition_cls, 2)
    assert condition_cls.wait.epd_nap_ms == 2
    wall, _ = waits_in(reader, 10)
    assert wall < 10 * 0.05 / 2


def test_past_the_busy_window_vllm_waits_for_a_notification_as_before(condition_cls, pair):
    writer, reader = pair
    idle_wait.nap_instead_of_spin(condition_cls, 1)
    reader.last_read = time.monotonic() - 2 * reader.busy_loop_s
    threading.Timer(0.2, writer.notify).start()
    start = time.perf_counter()
    reader.wait(timeout_ms=5000)
    assert time.perf_counter() - start > 0.15  # slept until the notification, not 1 ms


def test_the_plugin_patches_vllm_only_where_the_hal_asked():
    code = ("from epd_serve.backends.cpu.idle_wait import vllm_plugin; vllm_plugin(); "
            "from vllm.distributed.device_communicators import shm_broadcast as s; "
            "print(getattr(s.SpinCondition.wait, 'epd_nap_ms', None))")
    for env, expected in (({}, "None"), ({idle_wait.ENV: "1"}, "1")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", **env}, check=True)
        assert done.stdout.splitlines()[-1] == expected, done.stderr[-2000:]
        assert ("instead of spinning in MainProcess" in done.stderr) == bool(env)


def test_the_cpu_hal_switches_it_on_for_every_instance():
    for instance in parse("E-P-D").instances:
        launch = InstanceLaunch(instance=instance, model="m", served_model_name="m",
                                host="127.0.0.1", port=8100, devices=(0,), memory_share=1.0,
                                max_model_len=4096)
        assert idle_wait.nap_ms(CpuPlatform().environment(launch)) == 1


def test_vllm_finds_the_plugin_among_its_general_plugins():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="vllm.general_plugins")
                if e.name == "epd_serve_idle_wait"]
    assert entry.load() is idle_wait.vllm_plugin
