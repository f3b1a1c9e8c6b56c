"""The chaos soak's deployment and its faults (benchmarks/chaos_soak.py).

The deployment under test runs as an operator runs it: `epd-serve up` in a process of
its own (`UpProcess`), so that the supervisor itself can be killed or stopped, and
started again "from above" (as systemd restarts it), when it adopts what runs. Which
process is whose is read from the deployment's state file, as `epd-serve down` reads it.

Each fault strikes once per deck, in a random order (`FAULTS`; the ones a deployment
cannot have, a store or switchable instances, are left out):
  kill -9 of E, P or D (the instance's whole process group), of the MM Store server or
  of the proxy; SIGSTOP of an instance, of its engine core alone (its API server still
  answering /health), of the store server or of the supervisor, for STOP_FOR_S; kill -9
  of the supervisor, started again two seconds later; the store filled past its
  capacity with other features; the store server restarted (SIGTERM); a role switch
  of a switchable instance, under load;
and two late writers, each paused for longer than every deadline that could give its
memory to another request (LONG_STOP_S):
  "stop prefill mid-write": a long prompt whose prefill engine SIGSTOPs itself at the
  worst moment (its reservation checked, its first write not yet handed to the transfer
  engine: `epd_fault: stop_process`), continued LONG_STOP_S later; decode's fence
  counts are read from its /metrics;
  "stop writer mid-put": a store client (the put the encoder's connector makes) that
  SIGSTOPs itself between its reservation and its writes, for longer than the store's
  `hold_s`; meanwhile the store is filled (its space goes to other features) and the
  load puts live features back; then it is continued, writes over them and commits. The
  live features its bytes hit are counted by reading them back (each must be a miss).
The soak's deployment lets a stopped engine stay stopped that long (supervision
`hung_restart_s` above LONG_STOP_S), or the supervisor would kill it, and a dead process
writes nothing.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
import yaml

from epd_serve.mmstore import FeatureMeta, open_store

STOP_FOR_S = 20.0
# Longer than decode's peer_timeout_s (10), release_grace_s (30), receive_timeout_base_s
# (60), prefill's drain (30) and the store's hold_s (60).
LONG_STOP_S = 75.0
SUPERVISOR_BACK_AFTER_S = 2.0  # as a systemd unit's RestartSec
ADMIN_KEY = "chaos-soak-admin"
FAULTS = ("kill E", "kill P", "kill D", "kill store", "kill proxy", "stop instance",
          "stop engine core", "stop store", "stop supervisor", "kill supervisor",
          "fill store", "restart store", "switch role", "stop prefill mid-write",
          "stop writer mid-put")


@dataclass
class Fault:
    at: float  # seconds since the load began
    kind: str
    target: str
    detail: str = ""


class UpProcess:
    """`epd-serve up` of the deployment `dep` (its file written to `config_path`)."""

    def __init__(self, dep, config_path: Path, log_path: Path):
        self.dep = dep
        self.config_path = config_path
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        # Restarts counted by supervisors that were killed since (a new one counts from 0).
        self.earlier_restarts: dict[str, int] = {}
        config = dep.config.model_dump(mode="json", exclude_none=True)
        config.update(model=str(dep.model_dir), work_dir=str(dep.work_dir))
        config_path.write_text(yaml.safe_dump(config))

    def start(self, timeout_s: float = 900.0) -> None:
        """Start `up` (which adopts a deployment that runs) and wait until it serves."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "epd_serve.cli", "up", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "EPD_ADMIN_KEY": ADMIN_KEY})
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"epd-serve up exited ({self.process.returncode}); "
                                   f"see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the deployment is not ready; see {self.log_path}")
            time.sleep(1.0)

    def ready(self) -> bool:
        try:
            return httpx.get(self.dep.proxy_url + "/ready", timeout=5).status_code == 200 \
                and self.dep.work_dir.joinpath("state.json").is_file()
        except httpx.HTTPError:
            return False

    def state(self) -> dict:
        return json.loads(self.dep.work_dir.joinpath("state.json").read_text())

    def leader(self, name: str) -> int:
        return self.state()["children"][name]

    def restarts(self) -> dict[str, int]:
        now = {name: s["restarts"] for name, s in self.state()["supervision"].items()}
        return {name: now.get(name, 0) + self.earlier_restarts.get(name, 0)
                for name in {*now, *self.earlier_restarts}}

    def kill(self) -> None:
        """kill -9 of the supervisor alone; its restart counts are kept."""
        for name, count in self.restarts().items():
            self.earlier_restarts[name] = count
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """Stop the whole deployment, as Ctrl-C does (or `down`, if `up` is gone)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=120)
                return
            except subprocess.TimeoutExpired:
                self.process.kill()
        subprocess.run([sys.executable, "-m", "epd_serve.cli", "down", str(self.config_path)],
                       check=False)


@dataclass
class Targets:
    """Child names by what a fault can strike."""

    by_role: dict[str, list[str]] = field(default_factory=dict)  # E, P, D, instance
    store: list[str] = field(default_factory=list)
    switchable: list[str] = field(default_factory=list)
    kv_protocol: str = "epd"
    store_backend: str | None = None

    @classmethod
    def of(cls, dep) -> "Targets":
        targets = cls({"E": [], "P": [], "D": [], "instance": []})
        for launch in dep.launches:
            for role in launch.instance.roles:  # "E", "P", "D", or several: "PD"
                targets.by_role[role].append(launch.name)
            targets.by_role["instance"].append(launch.name)
            if launch.instance.switchable:
                targets.switchable.append(launch.name)
            targets.kv_protocol = launch.kv_protocol
        if dep.mm_store is not None:
            targets.store = ["mmstore" if dep.mm_store.backend == "shm" else "mooncake-master"]
            targets.store_backend = dep.mm_store.backend
        return targets

    def kinds(self) -> list[str]:
        possible = {"switch role": bool(self.switchable),
                    # our KV connector's fault, on a prefill of its own
                    "stop prefill mid-write": self.kv_protocol == "epd"
                    and any(name not in self.by_role["D"] for name in self.by_role["P"]),
                    "stop writer mid-put": self.store_backend == "shm"}
        return [k for k in FAULTS if (self.store or "store" not in k) and possible.get(k, True)]


def stop_for(pids: list[int], seconds: float) -> None:
    """SIGSTOP these processes now, SIGCONT them `seconds` later (those still there)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed meanwhile (the supervisor found it hung)

    threading.Timer(seconds, resume).start()


def group(pid: int) -> list[int]:
    """The process group a child leads (its instance), as pids."""
    return [p.pid for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def engine_core(leader: int) -> int:
    """The engine core process of the instance `leader` leads (VLLM::EngineCore)."""
    for proc in psutil.Process(leader).children(recursive=True):
        if "EngineCore" in " ".join(proc.cmdline()) or "EngineCore" in proc.name():
            return proc.pid
    raise LookupError(f"no engine core under pid {leader}")


def fill_store(dep) -> str:
    """Put other features into the store until it has taken 1.5 times its capacity."""
    spec = dep.mm_store
    chunk = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
    stored = 0
    with open_store(spec) as store:
        while stored < 1.5 * spec.capacity_bytes:
            key = secrets.token_hex(32)
            if store.put(key, chunk, FeatureMeta((chunk.size // 512, 256), "float16")):
                stored += chunk.nbytes
    return f"{stored >> 20} MiB of other features"


def switch_role(dep, name: str, rng: random.Random) -> str:
    roles = httpx.get(dep.proxy_url + "/roles", timeout=30).json()["instances"]
    target = rng.choice([r for r in "EPD" if r != roles[name]["roles"]])
    resp = httpx.post(f"{dep.proxy_url}/instances/{name}/role", timeout=60,
                      json={"role": target, "wait_s": 0},
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})
    return f"{roles[name]['roles']} -> {target}: {resp.status_code} " \
           f"{resp.json().get('outcome') or resp.json().get('error', {}).get('message')}"


def stopped_in(pids: list[int], timeout_s: float) -> int | None:
    """The first of `pids` (or their children) found stopped within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in pids:
            try:
                procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in procs:
                try:
                    if proc.status() == psutil.STATUS_STOPPED:
                        return proc.pid
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.05)
    return None


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples (with these labels) at an instance's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def fences(dep) -> dict[str, float]:
    """The KV fence counts of every instance (held, expired: decode's; refused:
    prefill's), by event."""
    urls = [f"http://{launch.host}:{launch.port}" for launch in dep.launches]
    counts = {}
    for event in ("held", "expired", "refused"):
        try:
            counts[event] = sum(metric_sum(url, "epd_kv_fence_total", event=event)
                                for url in urls)
        except httpx.HTTPError:
            counts[event] = float("nan")
    return counts


def stop_prefill_mid_write(up: UpProcess, targets: Targets, rng: random.Random,
                           send_long) -> tuple[str, str]:
    """A long prompt whose prefill engine stops itself just before its first write;
    continued LONG_STOP_S later. `send_long(kv_transfer_params)` sends a long prompt of
    the pool with them (judged like the load) and returns when it is answered."""
    target = rng.choice([n for n in targets.by_role["P"] if n not in targets.by_role["D"]])
    before = fences(up.dep)
    sender = threading.Thread(target=send_long, args=({"epd_fault": "stop_process"},))
    sender.start()
    stopped = stopped_in([up.leader(target)], timeout_s=60.0)
    if stopped is None:
        sender.join()
        return target, "its engine did not stop (the request took no prefill hand-off)"
    time.sleep(LONG_STOP_S)
    os.kill(stopped, signal.SIGCONT)
    time.sleep(15.0)  # its late write, Released, decode's release
    sender.join()
    after = fences(up.dep)
    held = {k: after[k] - before[k] for k in after}
    return target, (f"engine pid {stopped} stopped before its first write, for "
                    f"{LONG_STOP_S:g}s; decode fence events: {held}")


def late_writer(spec_json: str, nbytes: int) -> None:
    """(A process of its own.) Put `nbytes` of 0xEE, stopping itself (SIGSTOP) between
    the store's reservation and the writes; prints what became of its Commit."""
    from epd_serve.mmstore import StoreSpec
    from epd_serve.mmstore import shm_wire as wire

    spec = StoreSpec.from_json(spec_json)
    with open_store(spec) as store:
        call = store._call

        def stopped_after_reserving(req, timeout_ms=None):
            reply = call(req, timeout_ms)
            if isinstance(req, wire.Reserve) and isinstance(reply, wire.Placed):
                os.kill(os.getpid(), signal.SIGSTOP)
            return reply

        store._call = stopped_after_reserving
        key = f"chaos-late-writer-{secrets.token_hex(8)}"
        published = store.put(key, np.full(nbytes, 0xEE, np.uint8),
                              FeatureMeta((nbytes,), "uint8"))
        print("published" if published else "refused", flush=True)


def stop_writer_mid_put(up: UpProcess, live_keys: list[str]) -> tuple[str, str]:
    spec = up.dep.mm_store
    nbytes = spec.capacity_bytes - (64 << 20)  # most of the store: live features land in it
    writer = subprocess.Popen([sys.executable, __file__, "late-writer", spec.to_json(),
                               str(nbytes)], stdout=subprocess.PIPE, text=True)
    if stopped_in([writer.pid], timeout_s=30.0) is None:
        writer.kill()
        return "store", "the writer did not reserve"
    time.sleep(spec.hold_s + 5.0)  # its reservation lapses
    filled = fill_store(up.dep)  # its space goes to other features ...
    time.sleep(20.0)  # ... and the load puts live ones back
    os.kill(writer.pid, signal.SIGCONT)
    commit = writer.communicate(timeout=60)[0].strip()
    with open_store(spec) as store:
        present = sum(store.get(key) is not None for key in live_keys)
        hit = store.corrupt_reads
    return "store", (f"a writer stopped {spec.hold_s + 25:.0f}s past its reservation "
                     f"(meanwhile {filled}); its commit: {commit}; of {len(live_keys)} live "
                     f"features {present} read back right and {hit} its bytes hit (misses)")


def strike(up: UpProcess, targets: Targets, kind: str, rng: random.Random, *,
           send_long=None, live_keys: list[str] = ()) -> tuple[str, str]:
    """Carry out one fault; (its target, what was done)."""
    if kind.startswith("kill ") and kind.split()[1] in "EPD":
        role = kind.split()[1] if targets.by_role[kind.split()[1]] else "P"
        target = rng.choice(targets.by_role[role])
        os.killpg(up.leader(target), signal.SIGKILL)
        return target, f"pid {up.leader(target)}"
    if kind in ("kill store", "kill proxy", "restart store"):
        target = targets.store[0] if "store" in kind else "proxy"
        sig = signal.SIGTERM if kind == "restart store" else signal.SIGKILL
        os.killpg(up.leader(target), sig)
        return target, f"pid {up.leader(target)}"
    if kind in ("stop instance", "stop store"):
        target = rng.choice(targets.by_role["instance"] if kind == "stop instance"
                            else targets.store)
        stop_for(group(up.leader(target)), STOP_FOR_S)
        return target, f"its process group, for {STOP_FOR_S:g}s"
    if kind == "stop engine core":
        target = rng.choice(targets.by_role["instance"])
        core = engine_core(up.leader(target))
        stop_for([core], STOP_FOR_S)
        return target, f"engine core pid {core} (its API server running), for {STOP_FOR_S:g}s"
    if kind == "stop supervisor":
        stop_for([up.process.pid], STOP_FOR_S)
        return "epd-serve up", f"pid {up.process.pid}, for {STOP_FOR_S:g}s"
    if kind == "kill supervisor":
        pid = up.process.pid
        up.kill()
        time.sleep(SUPERVISOR_BACK_AFTER_S)
        started = time.monotonic()
        up.start()
        return "epd-serve up", f"pid {pid}; started again, serving after " \
                               f"{time.monotonic() - started:.1f}s"
    if kind == "fill store":
        return "store", fill_store(up.dep)
    if kind == "switch role":
        target = rng.choice(targets.switchable)
        return target, switch_role(up.dep, target, rng)
    if kind == "stop prefill mid-write":
        return stop_prefill_mid_write(up, targets, rng, send_long)
    if kind == "stop writer mid-put":
        return stop_writer_mid_put(up, list(live_keys))
    raise ValueError(f"unknown fault {kind!r}")


if __name__ == "__main__" and sys.argv[1:2] == ["late-writer"]:
    late_writer(sys.argv[2], int(sys.argv[3]))
