"""The supervisor outlives its children's failures: a crashing process is restarted at
once, then after a back-off that doubles to a cap and starts over after a healthy run,
for as long as it keeps crashing; one child's failure (or a failing round, or a state
file that cannot be written) does not stop the others nor the deployment; a process's
log rolls over by size without losing a line.

Real short-lived processes; time is a fake clock the test moves, so nothing here
depends on how fast the machine is.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest

from epd_serve.deployment import schema
from epd_serve.deployment.schema import Supervision
from epd_serve.deployment.resolve import resolve
from epd_serve.runtime import supervision
from epd_serve.runtime.child import Child, log_tail
from epd_serve.runtime.launcher import Launcher
from epd_serve.runtime.supervision import RestartBackoff

CRASH = [sys.executable, "-c", "raise SystemExit(4)"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def crashing_child(tmp_path: Path, clock: Clock, name: str = "e0", **settings) -> Child:
    return Child(name=name, command=CRASH, env={}, log_path=tmp_path / f"{name}.log",
                 health_url="", tag=f"test/{name}/{id(clock)}", clock=clock,
                 supervision=Supervision(**settings))


def crash(child: Child) -> None:
    """Let the current incarnation exit (it does at once) and be seen exited."""
    child.process.wait(timeout=30)


# -- the back-off ---------------------------------------------------------------------
def test_backoff_restarts_at_once_then_doubles_to_the_cap_and_never_gives_up():
    backoff = RestartBackoff(Supervision(rapid_restarts=2, backoff_s=1, backoff_max_s=8))
    delays = [backoff.delay_after_exit(up_for_s=0.5) for _ in range(10)]
    assert delays == [0, 0, 1, 2, 4, 8, 8, 8, 8, 8]
    # Days of crash-looping: still the cap, no overflow, no giving up.
    assert {backoff.delay_after_exit(up_for_s=0.5) for _ in range(5000)} == {8}
    assert backoff.crashes_in_a_row == 5010


def test_backoff_starts_over_after_a_healthy_run():
    backoff = RestartBackoff(Supervision(rapid_restarts=0, backoff_s=1, backoff_max_s=60,
                                         healthy_after_s=30))
    assert [backoff.delay_after_exit(up_for_s=29) for _ in range(4)] == [1, 2, 4, 8]
    assert backoff.delay_after_exit(up_for_s=30) == 1
    assert backoff.crashes_in_a_row == 1


# -- a child --------------------------------------------------------------------------
def test_a_crash_looping_child_keeps_coming_back_at_the_capped_delay(tmp_path):
    clock = Clock()
    child = crashing_child(tmp_path, clock, rapid_restarts=1, backoff_s=1, backoff_max_s=4,
                           healthy_after_s=30)
    child.start()
    try:
        crash(child)
        assert child.revive() == "e0 exited with code 4; restarting (restart 1)"
        waits = []
        for restart in range(2, 8):  # well past the 3 restarts a child used to get
            crash(child)
            event = child.revive()
            assert event.startswith(f"e0 exited with code 4; {restart} crashes in a row, "
                                    "backing off: next try in "), event
            wait = float(event.split("next try in ")[1].removesuffix(" s"))
            waits.append(wait)
            assert child.describe() == (f"exited with code 4; backing off, next try in "
                                        f"{wait:g} s")
            waiting = child.process
            clock.now += wait - 0.1
            assert child.revive() is None and child.process is waiting  # not yet
            clock.now += 0.1
            assert child.revive() == f"e0: back-off over; restarting (restart {restart})"
            assert child.process is not waiting
        assert waits == [1, 2, 4, 4, 4, 4]
        assert child.restarts == 7
    finally:
        child.process.wait(timeout=30)
        child.close_log()


def test_a_child_that_stayed_up_the_healthy_period_restarts_at_once_again(tmp_path):
    clock = Clock()
    child = crashing_child(tmp_path, clock, rapid_restarts=0, backoff_s=1, backoff_max_s=60,
                           healthy_after_s=30)
    child.start()
    try:
        for wait in (1, 2, 4):
            crash(child)
            assert child.revive().endswith(f"backing off: next try in {wait} s")
            clock.now += wait
            assert "restarting" in child.revive()
        clock.now += 30  # this incarnation "ran" the healthy period before it crashed
        crash(child)
        assert child.revive().endswith("1 crash in a row, backing off: next try in 1 s")
    finally:
        child.process.wait(timeout=30)
        child.close_log()


def test_a_start_that_fails_waits_its_backoff_and_is_tried_again(tmp_path):
    clock = Clock()
    child = crashing_child(tmp_path, clock, rapid_restarts=0, backoff_s=2, backoff_max_s=60)
    child.start()
    try:
        crash(child)
        child.command = [str(tmp_path / "no-such-program")]  # say, a broken upgrade
        assert child.revive().endswith("backing off: next try in 2 s")
        clock.now += 2
        event = child.revive()
        assert event.startswith("e0: back-off over; could not start it (FileNotFoundError")
        assert event.endswith("2 crashes in a row, backing off: next try in 4 s")
        assert child.describe().startswith("could not start: FileNotFoundError")
        child.command = CRASH  # fixed: the stage comes back by itself
        clock.now += 4
        assert child.revive() == "e0: back-off over; restarting (restart 1)"
        assert child.describe() in ("running", "exited with code 4")
    finally:
        child.process.wait(timeout=30)
        child.close_log()


# -- the launcher ---------------------------------------------------------------------
@pytest.fixture
def launcher(tmp_path):
    """A launcher that started nothing itself; each test hands it children."""
    model = tmp_path / "model"
    model.mkdir()
    dep = resolve(schema.Deployment(name="sup", deployment="TP1", model=str(model),
                                    work_dir=str(tmp_path / "work")), tmp_path)
    dep.work_dir.mkdir(parents=True)
    events: list[str] = []
    launcher = Launcher(dep, on_event=events.append)
    launcher.events = events
    yield launcher
    for child in launcher.children:
        if child.process is not None:
            child.process.wait(timeout=30)
        child.close_log()


def test_one_child_failing_to_be_supervised_does_not_stop_the_others(launcher, tmp_path):
    clock = Clock()
    broken, fine = crashing_child(tmp_path, clock, "e0"), crashing_child(tmp_path, clock, "p0")
    launcher.children = [broken, fine]
    for child in launcher.children:
        child.start()
        crash(child)

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    broken.revive = full_disk
    events = launcher.supervise_once()

    assert events == ["e0: supervising it failed (OSError: [Errno 28] No space left on "
                      "device); trying again at the next check",
                      "p0 exited with code 4; restarting (restart 1)"]
    assert launcher.events == events
    del broken.revive  # the disk has room again: the next check restarts it
    # (p0's new incarnation may have exited again by then: it is a crashing child too)
    assert "e0 exited with code 4; restarting (restart 1)" in launcher.supervise_once()


def test_supervision_goes_on_when_the_state_file_cannot_be_written(launcher, tmp_path):
    clock = Clock()
    child = crashing_child(tmp_path, clock)
    launcher.children = [child]
    launcher.state_path = tmp_path / "gone" / "state.json"  # as good as a full disk
    child.start()
    crash(child)
    events = launcher.supervise_once()
    assert events[0] == "e0 exited with code 4; restarting (restart 1)"
    assert events[1].startswith(f"cannot write {launcher.state_path} (")


def test_run_forever_outlives_a_failing_round(launcher, monkeypatch):
    rounds = []

    def supervise_once():
        rounds.append(1)
        if len(rounds) == 1:
            raise RuntimeError("psutil hiccup")
        launcher._stopping = True
        return []

    monkeypatch.setattr(launcher, "supervise_once", supervise_once)
    launcher.run_forever(interval=0)
    assert len(rounds) == 2
    assert launcher.events == ["supervision round failed (RuntimeError: psutil hiccup); "
                               "trying again at the next check"]


def test_supervision_rounds_share_one_http_client_and_stop_closes_it(launcher, monkeypatch):
    """Making an httpx client costs ~50 ms of CPU (a TLS context with the CA bundle):
    one a round every 2 s was 2-3% of a core on an idle deployment."""
    import httpx

    made = []

    class CountedClient(httpx.Client):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(httpx, "Client", CountedClient)
    for _ in range(3):
        assert launcher.supervise_once() == []
    assert len(made) == 1 and not made[0].is_closed
    launcher.stop()
    assert made[0].is_closed


def test_the_state_file_shows_restarts_and_a_child_backing_off(launcher, tmp_path):
    clock = Clock()
    child = crashing_child(tmp_path, clock, rapid_restarts=1, backoff_s=5, backoff_max_s=60)
    launcher.children = [child]
    child.start()
    crash(child)
    launcher.supervise_once()  # restarted at once
    crash(child)
    launcher.supervise_once()  # now backing off
    state = json.loads(launcher.state_path.read_text())
    assert state["supervision"] == {"e0": {
        "state": "exited with code 4; backing off, next try in 5 s", "restarts": 1,
        "crashes_in_a_row": 2}}


# -- the log --------------------------------------------------------------------------
def lines_printer(count: int, width: int = 60) -> list[str]:
    return [sys.executable, "-c",
            f"for i in range({count}): print(f'line {{i:08d}} ' + 'x' * {width - 15})"]


def log_files(path: Path) -> list[Path]:
    """The log and its rolled-over copies, oldest first."""
    return sorted(path.parent.glob(path.name + "*"), key=lambda p: -int(p.suffix[1:])
                  if p.suffix[1:].isdigit() else 0)


def run_to_end(child: Child) -> None:
    child.start()
    child.process.wait(timeout=60)
    child.close_log()


def test_the_log_rolls_over_by_size_and_keeps_every_line(tmp_path):
    # 150 KB through files of 64 KiB: two rollovers, and room for everything.
    child = Child(name="e0", command=lines_printer(2500), env={}, log_path=tmp_path / "e0.log",
                  health_url="", supervision=Supervision(log_max_bytes="64KiB", log_files=3))
    run_to_end(child)
    files = log_files(child.log_path)
    assert [f.name for f in files] == ["e0.log.2", "e0.log.1", "e0.log"]
    assert all(f.stat().st_size <= 64 << 10 for f in files)
    text = "".join(f.read_text() for f in files)
    printed = [line for line in text.splitlines() if line.startswith("line ")]
    assert printed == [f"line {i:08d} " + "x" * 45 for i in range(2500)]  # none lost or cut


def test_the_logs_of_a_chatty_child_stay_within_their_bound(tmp_path):
    child = Child(name="e0", command=lines_printer(20000), env={}, log_path=tmp_path / "e0.log",
                  health_url="", supervision=Supervision(log_max_bytes="64KiB", log_files=2))
    run_to_end(child)
    files = log_files(child.log_path)
    assert [f.name for f in files] == ["e0.log.1", "e0.log"]
    assert sum(f.stat().st_size for f in files) <= 2 * (64 << 10)
    assert child.log_tail(1) == f"line {19999:08d} " + "x" * 45  # the newest are kept


# -- the deployment file --------------------------------------------------------------
def test_the_older_max_restarts_key_sets_the_restarts_made_at_once():
    base = dict(name="x", deployment="TP1", model="m")
    assert schema.Deployment(**base).supervision == Supervision()
    older = schema.Deployment(**base, max_restarts=0)
    assert older.supervision == Supervision(rapid_restarts=0)  # backs off, never gives up
    with pytest.raises(ValueError, match="older name of supervision.rapid_restarts"):
        schema.Deployment(**base, max_restarts=2, supervision={"rapid_restarts": 5})
    with pytest.raises(ValueError, match="backoff_max_s must be at least backoff_s"):
        schema.Deployment(**base, supervision={"backoff_s": 10, "backoff_max_s": 5})


ENGINE_FAILED_LOG = """\
(APIServer pid=30) INFO starting
(EngineCore pid=31) ERROR EngineCore failed to start.
(EngineCore pid=31) Traceback (most recent call last):
(APIServer pid=30) INFO waiting for the engine
(EngineCore pid=31)   File "vllm/v1/engine/core.py", line 700, in run_engine_core
(EngineCore pid=31)     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore pid=31) ValueError: not enough memory for the KV cache
(APIServer pid=30) Traceback (most recent call last):
(APIServer pid=30)   File "vllm/v1/engine/utils.py", line 1249, in wait_for_engine_startup
(APIServer pid=30)     raise RuntimeError(
(APIServer pid=30) RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_a_start_up_failure_names_the_first_error_in_the_log_not_only_its_last_lines(tmp_path):
    """An engine's API server ends its log with "see root cause above": the launch error
    must carry that cause, the core process's own exception, without its neighbours."""
    log = tmp_path / "d0.log"
    log.write_text(ENGINE_FAILED_LOG + "\n".join(f"(APIServer pid=30) shutting down {i}"
                                                 for i in range(20)))

    class ExitedChild:  # what the launchers' children offer (see supervision's docstring)
        name, log_path = "d0", log

        def exit_code(self) -> int:
            return 1

        def log_tail(self) -> str:
            return log_tail(log)

    message = str(supervision.exited_during_start_up(ExitedChild()))
    assert "ValueError: not enough memory for the KV cache" in message
    assert "waiting for the engine" not in message  # another process's line, left out
    assert message.index("shutting down 19") < message.index("ValueError")


def test_the_first_traceback_of_a_log_ends_at_its_exception_line(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(ENGINE_FAILED_LOG)
    block = supervision.first_traceback(log).splitlines()
    assert block[0].endswith("Traceback (most recent call last):")
    assert block[-1] == "(EngineCore pid=31) ValueError: not enough memory for the KV cache"
    assert len(block) == 4
    assert supervision.first_traceback(tmp_path / "missing.log") == ""
    (tmp_path / "clean.log").write_text("all fine\n")
    assert supervision.first_traceback(tmp_path / "clean.log") == ""
