"""Process trees: every process an instance started, found and killed even after its
leader died.

Used by the launcher (epd_serve/runtime/launcher.py) in the `epd-serve up` process and by
`epd-serve down`. vLLM's API server forks an engine-core process that forks workers;
when the API server dies those are reparented to init and keep their memory, and a
death signal set on the leader (cleared on fork) never reaches them. So a child's tree
is its leader's process group plus every process carrying its tag in the environment
(TAG_ENV, inherited by all descendants), plus the descendants of all those. Never
signal a process that cannot be tied to the deployment: a recorded group counts only
while a member still carries the child's tag, since a pid from an old state file may
have been reused.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import typing
from collections.abc import Iterable
from pathlib import Path

import psutil

from epd_serve.runtime import shm_leftovers

TAG_ENV = "EPD_SERVE_PROCESS"
KILL_WAIT_S = 1.0  # for a SIGKILLed process to be gone
KILL_ROUNDS = 3  # look again after each SIGKILL: something may have forked meanwhile


@dataclasses.dataclass(frozen=True)
class ProcessTree:
    """What one child started: the process group its leader heads (start_new_session
    makes pgid == leader pid) and every process carrying its tag. tag None means a state
    file from before tags, whose recorded group is trusted as it always was."""

    tag: str | None
    pgid: int | None


class Sweep(typing.NamedTuple):
    killed: int  # processes of the trees that were running when the sweep began or later
    survivors: list[int]  # pids still running after the last SIGKILL (stuck in the kernel)
    released: list[Path]  # shared-memory segments they left behind, removed


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _is_gone(proc: psutil.Process) -> bool:
    """Exited, or a zombie: a zombie holds no memory and only waits for its parent."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def _tag_of(proc: psutil.Process) -> str | None:
    # environ is None where it cannot be read: another user's process, or a zombie.
    return (proc.info["environ"] or {}).get(TAG_ENV)


def find_tree_processes(trees: list[ProcessTree],
                        known: Iterable[psutil.Process] = ()) -> dict[int, psutil.Process]:
    """Running processes of the trees (never this process), by pid: tagged ones, the
    members of a group one of them is in, and the descendants of all those (in case one
    dropped both the tag and the group). `known` are processes an earlier look found:
    they stay in the tree after the tagged processes that tied them to it are gone."""
    tags = {tree.tag for tree in trees if tree.tag}
    group_tag = {tree.pgid: tree.tag for tree in trees if tree.pgid}
    procs: dict[int, psutil.Process] = {}
    tagged: set[int] = set()
    group_members: dict[int, set[int]] = {}
    children_of: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["environ", "ppid"], ad_value=None):
        procs[proc.pid] = proc
        children_of.setdefault(proc.info["ppid"], []).append(proc.pid)
        if _tag_of(proc) in tags:
            tagged.add(proc.pid)
        pgid = _pgid(proc.pid)
        if pgid in group_tag:
            group_members.setdefault(pgid, set()).add(proc.pid)
    known_pids = {proc.pid for proc in known if not _is_gone(proc)} & set(procs)
    found = tagged | known_pids
    for pgid, members in group_members.items():
        tag = group_tag[pgid]
        if tag is None or members & known_pids or any(_tag_of(procs[p]) == tag for p in members):
            found |= members
    stack = list(found)
    while stack:
        for child_pid in children_of.get(stack.pop(), []):
            if child_pid not in found:
                found.add(child_pid)
                stack.append(child_pid)
    found.discard(os.getpid())
    return {pid: procs[pid] for pid in found if not _is_gone(procs[pid])}


def _send(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil refuses if the pid was reused meanwhile
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _wait_gone(procs: Iterable[psutil.Process], timeout: float) -> bool:
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while not all(_is_gone(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_trees(trees: list[ProcessTree], grace_s: float,
               segments: Iterable[Path] = ()) -> Sweep:
    """SIGTERM every process of the trees, SIGKILL whatever is left after grace_s (or
    appeared since), and look again until none is left or KILL_ROUNDS are spent. Then
    remove the shared-memory segments the trees leave behind (shm_leftovers.py): those
    their processes map now and `segments`, noted while they ran, that nothing maps."""
    procs = find_tree_processes(trees)
    segments = set(segments) | shm_leftovers.mapped_segments(procs)
    if not procs:
        return Sweep(0, [], shm_leftovers.release(segments))
    seen = dict(procs)
    _send(procs.values(), signal.SIGTERM)
    _wait_gone(procs.values(), grace_s)
    for _ in range(KILL_ROUNDS):
        # A worker that ignored SIGTERM and dropped the tag was tied to the tree only by
        # the engine that has exited since: remember everything seen.
        procs = find_tree_processes(trees, known=seen.values())
        if not procs:
            break
        segments |= shm_leftovers.mapped_segments(procs.keys() - seen.keys())
        seen.update(procs)
        _send(procs.values(), signal.SIGKILL)
        _wait_gone(procs.values(), KILL_WAIT_S)
    else:
        procs = find_tree_processes(trees, known=seen.values())
    # A survivor's segments stay: release() keeps whatever a running process maps.
    return Sweep(len(seen), sorted(procs), shm_leftovers.release(segments))


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es"
