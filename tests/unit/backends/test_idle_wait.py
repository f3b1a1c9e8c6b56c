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
from epd_serve.backends.hal import InstanceLaunch
from epd_serve.topology.notation import parse

from tests.waiting import wait_for

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def condition_cls():
    """A subclass, so that patching it leaves vLLM's class as it was."""
    return type("SpinCondition", (shm_broadcast.SpinCondition,), {})


class RecordingPoller:
    """A reader's zmq poller that records each poll: its timeout (ms) and whether the
    writer's notification ended it. A wait that spins never polls; a nap or vLLM's idle
    wait is exactly one poll, whose timeout says which of the two it was."""

    def __init__(self, reader):
        self.poller, self.notify_socket = reader.poller, reader.local_notify_socket
        self.polls: list[tuple[int | None, bool]] = []
        self.polling = threading.Event()  # set as the reader enters a poll

    def poll(self, timeout=None):
        self.polling.set()
        events = self.poller.poll(timeout=timeout)
        self.polls.append((timeout, self.notify_socket in dict(events)))
        return events


@pytest.fixture
def pair(condition_cls, tmp_path, monkeypatch):
    """A writer and a reader whose subscription has reached the writer, nothing left to
    read; the reader's polls are recorded and so are its sched_yield calls (spins), and
    its busy window lasts an hour, so no test depends on how fast the machine is."""
    import zmq

    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = condition_cls(False, context, address)
    reader = condition_cls(True, context, address)
    subscribed(writer, reader)
    reader.busy_loop_s = 3600.0
    reader.poller = RecordingPoller(reader)
    reader.yields = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: reader.yields.append(1))
    yield writer, reader
    context.destroy(linger=0)


def subscribed(writer, reader) -> None:
    """Publish probes until the reader receives the latest one sent: its subscription
    has reached the publisher (zmq drops what a PUB sends before that), and nothing
    sent is still on its way (each probe is the last sent when it is found)."""
    import zmq

    probes = iter(range(1 << 30))

    def latest_probe_received() -> bool:
        sent = f"probe-{next(probes)}".encode()
        writer.local_notify_socket.send(sent)
        received = None
        while reader.local_notify_socket.poll(10):
            received = reader.local_notify_socket.recv(zmq.NOBLOCK)
        return received == sent

    wait_for(latest_probe_received, "the reader's subscription reached the writer")


def nothing_left_to_read(reader) -> bool:
    return not reader.local_notify_socket.poll(0)


def test_the_nap_comes_from_the_environment_and_a_bad_one_is_refused():
    assert idle_wait.nap_ms({}) is None
    assert idle_wait.nap_ms({idle_wait.ENV: "2"}) == 2
    for bad in ("0", "-1", "1.5", "soon"):
        with pytest.raises(ValueError, match=idle_wait.ENV):
            idle_wait.nap_ms({idle_wait.ENV: bad})


def test_vllm_readers_spin_in_their_busy_window(pair):
    _, reader = pair
    reader.record_read()
    for _ in range(200):
        reader.wait(timeout_ms=5000)
    assert len(reader.yields) == 200  # each wait yields the CPU and returns at once...
    assert reader.poller.polls == []  # ... never sleeping on the socket


def test_patched_readers_nap_instead_and_burn_no_cpu(condition_cls, pair):
    _, reader = pair
    assert idle_wait.nap_instead_of_spin(condition_cls, 2)
    reader.record_read()
    for _ in range(50):
        reader.wait(timeout_ms=5000)
    assert reader.yields == []  # no spinning...
    # ... but one nap each, on the socket, for its 2 ms (no notification ended it early).
    assert reader.poller.polls == [(2, False)] * 50


def test_a_notification_ends_the_nap_at_once(condition_cls, pair):
    writer, reader = pair
    # A nap far longer than the test takes: ended early, it was woken (a nap that
    # sleeps through the notification fails the test after 30 s, not hangs it).
    assert idle_wait.nap_instead_of_spin(condition_cls, 30_000)
    reader.record_read()
    notifier = threading.Thread(target=lambda: (reader.poller.polling.wait(30), writer.notify()))
    notifier.start()
    reader.wait(timeout_ms=5000)
    notifier.join(30)
    assert reader.poller.polls == [(30_000, True)]  # the nap, ended by the notification
    assert nothing_left_to_read(reader)  # which it consumed
    assert reader.yields == []


def test_patching_twice_keeps_one_nap(condition_cls, pair):
    _, reader = pair
    idle_wait.nap_instead_of_spin(condition_cls, 50)
    idle_wait.nap_instead_of_spin(condition_cls, 2)
    assert condition_cls.wait.epd_nap_ms == 2
    # The second patch wraps vLLM's wait, not the first patch.
    assert condition_cls.wait.__wrapped__ is shm_broadcast.SpinCondition.wait
    reader.record_read()
    for _ in range(10):
        reader.wait(timeout_ms=5000)
    assert reader.poller.polls == [(2, False)] * 10  # one 2 ms nap each, no 50 ms one


def test_past_the_busy_window_vllm_waits_for_a_notification_as_before(condition_cls, pair):
    writer, reader = pair
    idle_wait.nap_instead_of_spin(condition_cls, 1)
    reader.last_read = time.monotonic() - 2 * reader.busy_loop_s
    notifier = threading.Thread(target=lambda: (reader.poller.polling.wait(30), writer.notify()))
    notifier.start()
    reader.wait(timeout_ms=30_000)
    notifier.join(30)
    # vLLM's idle wait (its own timeout, not the 1 ms nap), ended by the notification.
    assert reader.poller.polls == [(30_000, True)]
    assert nothing_left_to_read(reader) and reader.yields == []


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
        assert idle_wait.nap_ms(CpuPlatform().environment(launch)) == idle_wait.NAP_MS


def test_vllm_finds_the_plugin_among_its_general_plugins():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="vllm.general_plugins")
                if e.name == "epd_serve_idle_wait"]
    assert entry.load() is idle_wait.vllm_plugin


def test_a_notification_sent_right_after_the_last_one_was_taken_still_wakes(condition_cls, pair):
    """A writer notifying again within a millisecond of the notification its reader just
    took: vLLM's own notify drops it (the PUB socket still counts the first one as
    queued); ours sends it. Each nap here is long, so a dropped one shows as a nap that
    ran out (False) instead of one the notification ended (True)."""
    writer, reader = pair
    assert idle_wait.nap_instead_of_spin(condition_cls, 500)
    assert idle_wait.notify_without_drops(condition_cls)
    reader.record_read()
    for _ in range(5):
        writer.notify()
        reader.wait(timeout_ms=5000)
        writer.notify()  # at once: within zmq's command throttle of the first send
        reader.wait(timeout_ms=5000)
    assert reader.poller.polls == [(500, True)] * 10
    assert nothing_left_to_read(reader)


def test_patching_notify_twice_wraps_vllm_once(condition_cls):
    idle_wait.notify_without_drops(condition_cls)
    idle_wait.notify_without_drops(condition_cls)
    assert condition_cls.notify.__wrapped__ is shm_broadcast.SpinCondition.notify
