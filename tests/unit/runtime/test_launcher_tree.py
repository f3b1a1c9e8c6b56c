"""The launcher leaves no orphans: a dead instance's engine processes die before its
restart, and `stop()` / `epd-serve down` kill every process an instance ever started.

The fake instance below is shaped like vLLM's: an API server serving /health forks an
engine core (multiprocessing), which starts a worker that ignores SIGTERM and a helper
that daemonizes. The worker runs with a cleared environment, so only its process group
finds it; the helper calls os.setsid() and is reparented to init, so only the
environment tag finds it. Like vLLM's, the engine core shares a ring in POSIX shared
memory with its worker, which nothing removes if they are killed: the sweep must
(epd_serve/runtime/shm_leftovers.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from epd_serve.backends.cpu.platform import CpuPlatform
from epd_serve.deployment import schema
from epd_serve.deployment.resolve import resolve
from epd_serve.runtime import child as child_mod
from epd_serve.runtime import launcher as launcher_mod
from epd_serve.runtime import proctree
from epd_serve.runtime.launcher import Launcher, stop_from_state
from epd_serve.runtime.proctree import TAG_ENV

from tests.ports import free_port_block
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
ROLES = ("leader", "engine", "worker", "escaper")

FAKE_INSTANCE = textwrap.dedent('''
    """A fake vLLM instance; every process writes <pid-dir>/<leader pid>.<role> = its pid."""
    import argparse, http.server, multiprocessing, os, signal, subprocess, sys, time
    import mmap

    def record(pid_dir, role):
        path = os.path.join(pid_dir, f"{os.environ['FAKE_LEADER']}.{role}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # never read half-written

    def sleep_forever():
        while True:
            time.sleep(60)

    def shared_ring(name=None):
        """A segment in /dev/shm named as multiprocessing.shared_memory names them,
        mapped and written to, that nothing removes at exit (as vLLM's rings: a killed
        engine leaves them). Made by hand: shared_memory would start a resource tracker
        process, one more process in the tree."""
        name = name or f"psm_fake{os.getpid()}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        ring = mmap.mmap(fd, 1 << 20)
        ring[:4] = b"ring"
        return name, ring

    def engine_core(pid_dir):
        name, ring = shared_ring()
        path = os.path.join(pid_dir, f"{os.environ['FAKE_LEADER']}.segment")
        with open(path + ".tmp", "w") as f:
            f.write(name)
        os.replace(path + ".tmp", path)
        record(pid_dir, "engine")
        # A clean environment drops the launcher's tag; the process group remains.
        subprocess.Popen([sys.executable, __file__, "worker", pid_dir, name],
                         env={"FAKE_LEADER": os.environ["FAKE_LEADER"]})
        subprocess.Popen([sys.executable, __file__, "escaper", pid_dir])
        sleep_forever()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    if sys.argv[1] == "worker":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
        name, ring = shared_ring(sys.argv[3])
        record(sys.argv[2], "worker")
        sleep_forever()
    elif sys.argv[1] == "escaper":
        os.setsid()  # its own session and group: killpg of the leader's group misses it
        if os.fork():
            os._exit(0)  # and no parent in the tree: init adopts it
        record(sys.argv[2], "escaper")
        sleep_forever()
    else:
        parser = argparse.ArgumentParser()
        parser.add_argument("--pid-dir", required=True)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, required=True)
        args, _ = parser.parse_known_args()
        os.environ["FAKE_LEADER"] = str(os.getpid())
        record(args.pid_dir, "leader")
        # Forked before any thread starts, like vLLM's engine core.
        multiprocessing.get_context("fork").Process(target=engine_core,
                                                    args=(args.pid_dir,)).start()
        # Healthy once its engine and worker run (and map their ring), as vLLM's /health.
        worker = os.path.join(args.pid_dir, f"{os.getpid()}.worker")
        while not os.path.exists(worker):
            time.sleep(0.05)
        http.server.HTTPServer((args.host, args.port), Health).serve_forever()
''')


class TreePlatform(CpuPlatform):
    """CPU command shapes, but each instance is the fake process tree above."""

    def __init__(self, script: Path, pid_dir: Path):
        super().__init__()
        self.script, self.pid_dir = script, pid_dir

    def engine_launcher(self) -> list[str]:
        return [sys.executable, str(self.script), "--pid-dir", str(self.pid_dir), "--model"]

    def check_available(self) -> None:
        pass


@pytest.fixture
def tree_launcher(tmp_path, monkeypatch):
    """A started TP1 deployment (one fake instance and the proxy), stopped afterwards."""
    monkeypatch.setattr(launcher_mod, "STOP_GRACE_S", 3.0)  # the worker ignores SIGTERM
    script = tmp_path / "fake_instance.py"
    script.write_text(FAKE_INSTANCE)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    base = free_port_block(5)
    dep = resolve(schema.Deployment(
        name="tree", deployment="TP1", model=str(model), served_model_name="fake",
        proxy_port=base, base_port=base + 1, work_dir=str(tmp_path / "work"),
        health_timeout_s=30), tmp_path)
    launcher = Launcher(dep, TreePlatform(script, pid_dir), on_event=lambda msg: None)
    launcher.start()
    launcher.pid_dir = pid_dir
    try:
        launcher.wait_healthy()
        yield launcher
    finally:
        launcher.stop()


def instance(launcher: Launcher):
    return next(c for c in launcher.children if c.name == "epd0")


def tree_pids(launcher: Launcher, timeout: float = 15.0) -> dict[str, int]:
    """The pids of every process the current incarnation of the instance started."""
    leader = instance(launcher).process.pid
    files = {role: launcher.pid_dir / f"{leader}.{role}" for role in ROLES}
    wait_for(lambda: all(path.exists() for path in files.values()),
             f"fake instance {leader} starting its tree", timeout=timeout)
    return {role: int(path.read_text()) for role, path in files.items()}


def segment(launcher: Launcher) -> Path:
    """The shared-memory segment the current incarnation's engine and worker map."""
    tree_pids(launcher)  # the worker has mapped it once it recorded its pid
    name = (launcher.pid_dir / f"{instance(launcher).process.pid}.segment").read_text()
    return Path("/dev/shm") / name


class FrozenClock:
    """A clock for a child's back-off (Child.clock): it stands still until set."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie is dead
    except psutil.NoSuchProcess:
        return False


def tagged_pids(tags: set[str]) -> list[int]:
    """Running processes whose environment carries one of the tags."""
    pids = []
    for proc in psutil.process_iter(["environ"], ad_value=None):
        if (proc.info["environ"] or {}).get(TAG_ENV) in tags and alive(proc.pid):
            pids.append(proc.pid)
    return pids


def restart_without_cleanup(launcher: Launcher) -> dict[str, int]:
    """SIGKILL the instance's API server and start it again the way the launcher used to,
    leaving the old engine, worker and escaper running; returns the old tree's pids."""
    old = tree_pids(launcher)
    child = instance(launcher)
    os.kill(old["leader"], signal.SIGKILL)
    child.process.wait()
    child.start()
    launcher._write_state()
    return old


# -- the supervisor ---------------------------------------------------------------
def test_restart_kills_the_dead_api_servers_engine_processes_first(tree_launcher,
                                                                   monkeypatch):
    launcher = tree_launcher
    waits: list[float] = []  # the sweep's waits for processes to go, each its longest
    wait_gone = proctree._wait_gone
    monkeypatch.setattr(proctree, "_wait_gone",
                        lambda procs, timeout: waits.append(timeout) or wait_gone(procs, timeout))
    old = tree_pids(launcher)
    ring = segment(launcher)
    assert ring.exists()
    # The escaper left the group and the tree, the worker the tag: each is found one way.
    assert os.getpgid(old["escaper"]) != old["leader"] == os.getpgid(old["worker"])
    assert psutil.Process(old["escaper"]).ppid() != old["engine"]
    assert tagged_pids({instance(launcher).tag}) and old["worker"] not in tagged_pids(
        {instance(launcher).tag})
    os.kill(old["leader"], signal.SIGKILL)  # the API server alone, as an OOM kill would
    instance(launcher).process.wait()
    # The bug as reported: the engine processes outlive their API server.
    assert all(alive(old[role]) for role in ("engine", "worker", "escaper"))

    events = launcher.supervise_once()

    assert events == ["epd0 exited with code -9; killed 3 leftover processes; removed 1 "
                      "shared-memory segment it left; restarting (restart 1)"]
    assert not [role for role, pid in old.items() if alive(pid)]
    # Supervision blocks at most the short leftover grace (SIGTERM), then a second per
    # round of SIGKILL: never the grace a full stop gives (the worker ignores SIGTERM).
    assert waits[0] == child_mod.LEFTOVER_GRACE_S < launcher_mod.STOP_GRACE_S
    assert waits[1:] and set(waits[1:]) == {proctree.KILL_WAIT_S}
    most = child_mod.LEFTOVER_GRACE_S + proctree.KILL_ROUNDS * proctree.KILL_WAIT_S
    assert sum(waits) <= most < 6
    new = tree_pids(launcher)  # the replacement runs its own tree, untouched by the sweep
    assert new["leader"] != old["leader"] and all(alive(pid) for pid in new.values())
    assert not ring.exists() and segment(launcher).exists()
    launcher.wait_healthy()


def test_a_tree_killed_whole_leaves_no_shared_memory_behind(tree_launcher):
    """Every process of the instance SIGKILLed at once (as the OOM killer or a crashed
    machine view would): nothing is left running that maps the ring, so the sweep before
    the restart finds it only by what the launcher noted when the instance came up."""
    launcher = tree_launcher
    old, ring = tree_pids(launcher), segment(launcher)
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    instance(launcher).process.wait()
    wait_for(lambda: not any(alive(pid) for pid in old.values()), "the tree gone", timeout=10)
    assert ring.exists()  # what vLLM's rings do today: nothing removes them

    assert launcher.supervise_once() == ["epd0 exited with code -9; removed 1 shared-memory "
                                         "segment it left; restarting (restart 1)"]
    assert not ring.exists()
    launcher.wait_healthy()
    launcher.stop()
    assert not segment(launcher).exists()  # the stop's sweep removed the new one's


def test_killing_a_hung_instance_removes_its_shared_memory(tree_launcher):
    launcher = tree_launcher
    old, ring = tree_pids(launcher), segment(launcher)
    for pid in old.values():
        os.kill(pid, signal.SIGSTOP)  # hung: SIGTERM waits, only SIGKILL ends them

    event = instance(launcher).kill_hung("it answers nothing")

    assert event == ("epd0 is hung (it answers nothing): killed 4 processes; removed 1 "
                     "shared-memory segment it left")
    assert not ring.exists() and not any(alive(pid) for pid in old.values())


def test_a_segment_another_process_still_maps_is_left_alone(tree_launcher):
    launcher = tree_launcher
    ring = segment(launcher)
    reader = subprocess.Popen(  # not of the instance's tree: it maps the ring too
        [sys.executable, "-c", "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); "
         "ring = mmap.mmap(f.fileno(), 0); print('mapped', flush=True); time.sleep(60)",
         str(ring)], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "mapped"
        launcher.stop()
        assert ring.exists()
    finally:
        reader.kill()
        reader.wait()
        ring.unlink(missing_ok=True)


def test_a_death_without_leftovers_restarts_with_the_plain_message(tree_launcher):
    launcher = tree_launcher
    proxy = next(c for c in launcher.children if c.name == "proxy")
    proxy.process.kill()
    proxy.process.wait()
    assert launcher.supervise_once() == ["proxy exited with code -9; restarting (restart 1)"]


# -- stopping -----------------------------------------------------------------------
def test_stop_leaves_no_process_carrying_a_tag_from_any_incarnation(tree_launcher):
    launcher = tree_launcher
    earlier = restart_without_cleanup(launcher)
    current = tree_pids(launcher)
    tags = {c.tag for c in launcher.children}
    assert len(tags) == 2 and {earlier["engine"], earlier["escaper"]} <= set(tagged_pids(tags))

    launcher.stop()

    assert tagged_pids(tags) == []
    left = {f"{role} {pid}" for tree in (earlier, current) for role, pid in tree.items()
            if alive(pid)}
    assert not left
    assert not launcher.state_path.exists()


def test_down_from_the_state_file_alone_kills_every_incarnation(tree_launcher, tmp_path):
    launcher = tree_launcher
    earlier = restart_without_cleanup(launcher)
    current = tree_pids(launcher)
    state = json.loads(launcher.state_path.read_text())
    # The earlier group is recorded nowhere; only the tag in the state file leads to it.
    assert earlier["leader"] not in state["children"].values()
    tags = set(state["process_tags"].values())
    assert tags == {c.tag for c in launcher.children}

    # `epd-serve down` runs in another process; a stand-in plays the launcher it signals.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    state["launcher_pid"] = stand_in.pid
    launcher.state_path.write_text(json.dumps(state))
    down = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from epd_serve.runtime.launcher import stop_from_state; "
         "print(sorted(stop_from_state(Path(sys.argv[1]), grace_s=3)))",
         str(launcher.state_path)],
        capture_output=True, text=True, cwd=REPO, timeout=60)

    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "['epd0', 'proxy']"
    assert stand_in.wait(timeout=5) == -signal.SIGTERM
    assert tagged_pids(tags) == []
    left = {f"{role} {pid}" for tree in (earlier, current) for role, pid in tree.items()
            if alive(pid)}
    assert not left
    assert not launcher.state_path.exists()


def _unrelated_group() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)


def signals_sent(monkeypatch) -> list[tuple[str, int, int]]:
    """Every signal this process sends from now on (psutil's go through os.kill)."""
    sent: list[tuple[str, int, int]] = []
    kill, killpg = os.kill, os.killpg
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(("kill", pid, sig)) or
                        kill(pid, sig))
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append(("killpg", pgid, sig)) or
                        killpg(pgid, sig))
    return sent


def test_down_spares_a_recorded_group_that_no_longer_carries_the_tag(tmp_path, monkeypatch):
    # The recorded pid was reused by something else after the deployment went away.
    stranger = _unrelated_group()
    try:
        state = tmp_path / "state.json"
        state.write_text(json.dumps({"children": {"d0": stranger.pid},
                                     "process_tags": {"d0": "gone/d0/0123456789ab"}}))
        sent = signals_sent(monkeypatch)
        assert stop_from_state(state, grace_s=1) == ["d0"]
        assert sent == []  # not signalled at all: nothing for it to die of later
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_down_still_stops_the_groups_of_a_state_file_without_tags(tmp_path, monkeypatch):
    # A state file written before tags existed: its recorded groups are trusted as before.
    old_style = _unrelated_group()
    try:
        state = tmp_path / "state.json"
        state.write_text(json.dumps({"children": {"d0": old_style.pid}}))
        sent = signals_sent(monkeypatch)
        assert stop_from_state(state, grace_s=1) == ["d0"]
        assert ("kill", old_style.pid, signal.SIGTERM) in sent  # the spy sees signals
        assert old_style.wait(timeout=5) == -signal.SIGTERM
    finally:
        old_style.kill()
        old_style.wait()


def test_a_process_killed_again_and_again_keeps_coming_back_after_its_backoff(tree_launcher):
    # The deployment file's defaults: three restarts at once, then 1 s, doubling.
    launcher = tree_launcher
    proxy = next(c for c in launcher.children if c.name == "proxy")
    clock = FrozenClock(proxy.clock())
    proxy.clock = clock  # time moves only when the test says so
    for restart in (1, 2, 3):
        proxy.process.kill()
        proxy.process.wait()
        assert launcher.supervise_once() == [f"proxy exited with code -9; restarting "
                                             f"(restart {restart})"]
    proxy.process.kill()
    proxy.process.wait()
    assert launcher.supervise_once() == ["proxy exited with code -9; 4 crashes in a row, "
                                         "backing off: next try in 1 s"]
    state = json.loads(launcher.state_path.read_text())["supervision"]["proxy"]
    assert state["restarts"] == 3 and state["crashes_in_a_row"] == 4
    assert state["state"] == "exited with code -9; backing off, next try in 1 s"
    assert launcher.supervise_once() == []  # not before its back-off is over ...
    clock.now = proxy.next_start_at - 0.001
    assert launcher.supervise_once() == []
    clock.now = proxy.next_start_at  # ... and at once when it is
    assert launcher.supervise_once() == ["proxy: back-off over; restarting (restart 4)"]
    launcher.wait_healthy()
