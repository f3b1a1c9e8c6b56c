"""Decode side: reserve blocks with the prefill worker, learn when the KV has landed,
and turn every way a transfer can go wrong into a recompute.

Runs in a decode engine's worker process (a kv_consumer, or a kv_both one beside a
Sender: its side channel only connects to the prefill workers' and binds no port, so
the Sender's kv_port stays its own). The model's thread calls `reserve` (before the
step that follows the allocation) and `take_results` (after each step); the
side-channel thread (which touches no device: prefill writes into decode's memory, so
it sets none) handles prefill's messages and, every tick, the checks:
- a reservation the prefill worker does not acknowledge within `ack_timeout_s`: decode
  cancels it and gives it up (a reservation that arrives late must not be written);
- a transfer that has not ended by its deadline (`Settings.receive_timeout_s`, sized
  to the bytes reserved): decode cancels it and gives it up;
- a prefill worker that stops answering pings for `peer_timeout_s`: if its process is
  gone (the side channel's connection closed or refused: a dead process writes
  nothing) its transfers are given up at once; if it is there (stopped, wedged: its
  kernel keeps the connection) they are failed and cancelled but their blocks held
  (fenced): a stopped process resumes and writes what it had queued;
- a prefill that answers as a new incarnation (it restarted: the old one writes
  nothing): its transfers are given up at once;
- a transfer the prefill worker answers pings without (`Pong.known`) for a heartbeat:
  it has ended there and what said so was lost; prefill forgets a transfer only once
  none of its writes is running (or could be: a failed write it gave up waiting for
  stays listed), so it is given up at once;
- a failed transfer whose writes may still run is held until prefill says they ended
  (`Released`, or a `Done` or `Failed` with none in flight that crossed decode's
  Cancel), its process is gone, or it answers pings without it for
  `release_grace_s`; one still listed or silent past `release_grace_s` is fenced, and
  held for `fence_max_s` at most (then given back, counted: prefill refuses writes for
  reservations that old, `Settings.stale_reservation_s`). So no late write lands in
  blocks the engine has given to another request. The request itself waits for its
  blocks; the proxy, which sees a stopped prefill as hung, aborts it and sends it on
  (vLLM keeps an aborted request's blocks until we report them).
Failed transfers are reported to vLLM as failed receives (before vLLM 0.32: as the
blocks they were to fill, connector.py); with `kv_load_failure_policy: recompute` the
engine then computes the prompt itself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.channel import Channel
from epd_serve.connectors.epd_kv.layout import LayerLayout
from epd_serve.connectors.epd_kv.settings import Settings

if TYPE_CHECKING:  # a vLLM class; this module itself stays importable without vLLM
    from epd_serve.connectors.epd_kv.stats import EPDKVStats

logger = logging.getLogger("vllm.epd_serve.kv.receiver")


@dataclasses.dataclass
class Incoming:
    plan: msg.RecvPlan
    address: str  # the prefill worker's side channel, host:port
    reserved_at: float
    deadline: float  # time.monotonic() by which it must have ended
    acked: bool = False
    incarnation: str | None = None
    landed_groups: int = 0
    # Wall clocks (ns) for the request's timeline: reserved, each group landed, concluded.
    reserved_ns: int = dataclasses.field(default_factory=time.time_ns)
    landed_ns: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # layers
    concluded_ns: int = 0
    outcome: str | None = None  # "done" | "failed" | "cancelled"
    reason: str = ""
    waiting_release_since: float | None = None  # writes may still land until Released
    fenced: bool = False  # held: its prefill went silent (not known gone) or still writes
    known_at: float | None = None  # when prefill's pongs last listed it (writes may run)
    missing_since: float | None = None  # acknowledged, then absent from prefill's pongs
    stats: msg.TransferStats | None = None
    resolved: bool = False  # reported to vLLM (or about to be)


@dataclasses.dataclass
class Peer:
    last_ping: float = 0.0
    last_heard: float = 0.0
    silent: bool = False  # no message since it was found silent (pings go on)
    incarnation: str | None = None


class Receiver:
    def __init__(self, layouts: list[LayerLayout], block_size: int, engine_id: str, rank: int,
                 te_session: str, settings: Settings, stats: "EPDKVStats",
                 layout_name: str = "", results_ready: threading.Event | None = None):
        self.layouts = layouts
        self.layout_name = layout_name
        self.block_size = block_size
        self.engine_id = engine_id
        self.rank = rank
        self.te_session = te_session
        self.settings = settings
        self.stats = stats
        self._block_bytes = sum(layout.block_bytes for layout in layouts)  # every layer
        self._lock = threading.Lock()
        self._incoming: dict[str, Incoming] = {}  # by transfer id
        self._peers: dict[str, Peer] = {}
        self._ready: list[Incoming] = []
        # Set when a result is ready (the worker's empty steps wait on it: worker.py).
        self.results_ready = results_ready or threading.Event()
        self.channel = Channel("decode", self._on_message, self._on_tick)

    def start(self) -> None:
        self.channel.start()

    def close(self) -> None:
        self.channel.close()

    # -- the model's thread -------------------------------------------------
    def reserve(self, plan: msg.RecvPlan) -> None:
        address = f"{plan.prefill_host}:{plan.prefill_port + self.rank}"
        if plan.error:
            now = time.monotonic()
            with self._lock:
                self._conclude(Incoming(plan, address, now, now), "failed", plan.error)
            return
        if not plan.block_ids:
            # Nothing to receive (decode had the prompt cached): let prefill free its
            # blocks now rather than at its reservation timeout.
            self.channel.post(address, msg.encode(msg.Cancel(plan.transfer_id)))
            return
        now = time.monotonic()
        deadline = now + self.settings.receive_timeout_s(len(plan.block_ids) * self._block_bytes)
        with self._lock:
            current = self._incoming.get(plan.transfer_id)
            if current is not None and not current.resolved:
                # Another request receives this transfer: one transfer fills one set
                # of blocks, so this one computes its prompt itself (the first keeps
                # its transfer; nothing is overwritten or left waiting).
                self._conclude(Incoming(plan, address, now, deadline), "failed",
                               f"transfer {plan.transfer_id} is already received by "
                               f"request {current.plan.request_id}")
                return
            peer = self._peers.setdefault(address, Peer())
            waiting = any(i.address == address and not i.resolved
                          for i in self._incoming.values())
            if peer.silent and waiting:
                # Silent with transfers still held for it (pings go on, and its first
                # answer ends `silent`): a reservation sent now would hold these blocks
                # too, for as long as it stays stopped, until decode has none left for
                # anyone. Not sent, nothing can ever be written into them: decode
                # computes the prompt and the blocks go back with the request.
                self.stats.record("refused_silent_peer")
                self._conclude(Incoming(plan, address, now, now), "failed",
                               f"prefill worker {address} is silent; not reserved")
                return
            if not waiting:
                # Nothing was pending with it, so nothing was pinged: its silence so far
                # says nothing about whether it is alive.
                peer.last_heard = now
            self._incoming[plan.transfer_id] = Incoming(plan, address, now, deadline)
        self.channel.post(address, msg.encode(msg.Reserve(
            transfer_id=plan.transfer_id, decode_engine=self.engine_id,
            decode_rank=self.rank, te_session=self.te_session, block_ids=plan.block_ids,
            first_block=plan.first_block, num_tokens=plan.num_tokens,
            block_size=self.block_size, layout=self.layouts, layout_name=self.layout_name)))

    def abort(self, request_ids: set[str]) -> None:
        """The engine finished these requests (aborted by the client, say) while their
        KV was still coming: tell prefill to stop, and free once it has."""
        with self._lock:
            for incoming in self._incoming.values():
                if incoming.plan.request_id in request_ids and incoming.outcome is None:
                    self._conclude(incoming, "cancelled", "request aborted", in_flight=True)
                    self.channel.post(incoming.address,
                                      msg.encode(msg.Cancel(incoming.plan.transfer_id)))

    def take_results(self) -> tuple[set[str], set[str], dict[str, dict[str, Any]]]:
        """(finished receives, failed receives, per-request reports) since last call."""
        with self._lock:
            ready, self._ready = self._ready, []
            for incoming in ready:
                if self._incoming.get(incoming.plan.transfer_id) is incoming:
                    del self._incoming[incoming.plan.transfer_id]
        finished = {i.plan.request_id for i in ready}
        failed = {i.plan.request_id for i in ready if i.outcome == "failed"}
        reports = {i.plan.request_id: self._report(i) for i in ready}
        return finished, failed, reports

    def awaiting(self) -> bool:
        """Whether a reserved transfer has no result yet."""
        with self._lock:
            return any(not incoming.resolved for incoming in self._incoming.values())

    def _report(self, incoming: Incoming) -> dict[str, Any]:
        report: dict[str, Any] = {"transfer_id": incoming.plan.transfer_id,
                                  "outcome": incoming.outcome,
                                  msg.REPORT_TIMES_KEY: {"reserved": incoming.reserved_ns,
                                              "landed": incoming.landed_ns,
                                              "concluded": incoming.concluded_ns}}
        if incoming.outcome != "done":
            report["reason"] = incoming.reason
        if incoming.stats is not None:
            s = incoming.stats
            report.update(mode=s.mode, bytes=s.nbytes, groups=s.groups,
                          transfer_ms=round(s.busy_s * 1e3, 3),
                          exposed_ms=round(s.exposed_s * 1e3, 3),
                          prefill_ms=round(s.prefill_s * 1e3, 3),
                          # From the end of prefill's forward pass until this engine
                          # learns the KV is here (wall clocks of two processes: exact
                          # on one host, as good as their clock sync across hosts).
                          handoff_ms=round((time.time() - s.forward_end) * 1e3, 3))
        return report

    # -- the side-channel thread --------------------------------------------
    def _on_message(self, address: str, payload: bytes) -> None:
        message = msg.decode_to_decode(payload)
        now = time.monotonic()
        with self._lock:
            peer = self._peers.setdefault(address, Peer())
            peer.last_heard, peer.silent = now, False
            if isinstance(message, msg.Pong):
                self._check_incarnation(address, peer, message.incarnation)
                self._check_known(address, message, now)
                return
            incoming = self._incoming.get(message.transfer_id)
            if incoming is None:
                return
            if isinstance(message, msg.Ack):
                incoming.acked = True
                incoming.incarnation = message.incarnation
                self._check_incarnation(address, peer, message.incarnation)
                if message.error:
                    self._conclude(incoming, "failed", f"prefill refused: {message.error}")
            elif isinstance(message, msg.Landed):
                incoming.landed_groups += 1
                incoming.landed_ns.append((time.time_ns(), message.first_layer,
                                           message.last_layer))
            elif isinstance(message, msg.Done):
                incoming.stats = message.stats
                self._conclude(incoming, "done")
                self._writes_ended(incoming)  # a Done decode no longer waited for
            elif isinstance(message, msg.Failed):
                self._conclude(incoming, "failed", message.reason,
                               in_flight=message.in_flight > 0)
                if message.in_flight == 0:
                    self._writes_ended(incoming)
            elif isinstance(message, msg.Released):
                self._writes_ended(incoming)

    def _writes_ended(self, incoming: Incoming) -> None:
        """(Lock held.) Prefill says no write of this transfer runs any more (Released,
        or a Done or Failed that overtook decode's own giving up): a transfer held for
        its writes is reported now."""
        if incoming.waiting_release_since is not None:
            incoming.waiting_release_since = None
            self._resolve(incoming)

    def _check_incarnation(self, address: str, peer: Peer, incarnation: str) -> None:
        """A new incarnation on the same address is a restarted prefill engine: what the
        old one had in flight will never arrive."""
        if peer.incarnation is not None and peer.incarnation != incarnation:
            logger.warning("epd-kv: prefill worker at %s restarted", address)
            for incoming in self._incoming.values():
                if incoming.address == address and incoming.acked \
                        and incoming.incarnation != incarnation:
                    self._conclude(incoming, "failed", "prefill restarted")
                    self._resolve(incoming)
        peer.incarnation = incarnation

    def _check_known(self, address: str, pong: msg.Pong, now: float) -> None:
        """Give up the transfers prefill acknowledged and no longer knows: they ended
        there, and the Done or Failed that said so was lost. Only after a heartbeat
        without them: a pong can overtake a Done that another prefill thread sent
        just before."""
        known = set(pong.known)
        for incoming in self._incoming.values():
            if incoming.address == address and incoming.plan.transfer_id in known:
                incoming.known_at = now
            if incoming.address != address or incoming.resolved or not incoming.acked \
                    or incoming.incarnation != pong.incarnation:
                continue
            if incoming.plan.transfer_id in known:
                incoming.missing_since = None
            elif incoming.missing_since is None:
                incoming.missing_since = now
            elif now - incoming.missing_since >= self.settings.heartbeat_s:
                self._conclude(incoming, "failed",
                               f"prefill worker {address} no longer knows the transfer")
                self._resolve(incoming)  # prefill forgets a transfer with nothing in flight

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            pending = [i for i in self._incoming.values() if not i.resolved]
            for incoming in pending:
                if incoming.outcome is None and not incoming.acked \
                        and now - incoming.reserved_at > self.settings.ack_timeout_s:
                    # The reservation may only be late: a prefill that takes it after
                    # this would write into blocks given to another request. So, as for
                    # a deadline: cancel, and reuse the blocks once prefill says nothing
                    # runs (Released), or once it is silent for peer_timeout_s.
                    self._conclude(incoming, "failed", f"prefill worker {incoming.address} did "
                                   f"not acknowledge within {self.settings.ack_timeout_s:g}s",
                                   in_flight=True)
                    self.channel.post(incoming.address,
                                      msg.encode(msg.Cancel(incoming.plan.transfer_id)))
                elif incoming.outcome is None and now > incoming.deadline:
                    # Its writes may be running: prefill stops them and says when they
                    # have ended (Released) before these blocks are reused.
                    self._conclude(incoming, "failed", f"no KV from prefill worker "
                                   f"{incoming.address} within "
                                   f"{incoming.deadline - incoming.reserved_at:.1f}s of the "
                                   f"reservation", in_flight=True)
                    self.channel.post(incoming.address,
                                      msg.encode(msg.Cancel(incoming.plan.transfer_id)))
                elif incoming.waiting_release_since is not None:
                    self._maybe_release(incoming, now)
            for address in {i.address for i in pending}:
                peer = self._peers[address]
                if now - peer.last_heard > self.settings.peer_timeout_s:
                    self._silent(address, pending)
                    peer.silent = True
                    peer.last_heard = now  # keep pinging it: its answers end the fence
                elif now - peer.last_ping > self.settings.heartbeat_s:
                    peer.last_ping = now
                    ids = [i.plan.transfer_id for i in pending if i.address == address]
                    self.channel.post(address, msg.encode(msg.Ping(ids)))

    def _silent(self, address: str, pending: list[Incoming]) -> None:
        """(Lock held.) Prefill at `address` is silent: its transfers fail (decode
        computes those prompts). If its process is gone (its connection closed or
        refused) they are given up at once: a dead process writes nothing. If it is
        there (stopped, wedged: its kernel keeps the connection), they are cancelled and
        their blocks held: it may resume and write what it had queued."""
        if self.channel.connected(address) is False:
            for incoming in pending:
                if incoming.address == address and not incoming.resolved:
                    self._conclude(incoming, "failed", f"prefill worker {address} is gone")
                    self._resolve(incoming)
            return
        for incoming in pending:
            if incoming.address != address or incoming.resolved:
                continue
            if incoming.outcome is None:
                self._conclude(incoming, "failed", f"prefill worker {address} silent for "
                               f"{self.settings.peer_timeout_s:.0f}s", in_flight=True)
                self.channel.post(address, msg.encode(msg.Cancel(incoming.plan.transfer_id)))
            if not incoming.fenced:
                incoming.fenced = True
                self.stats.record("fenced")
                logger.warning("epd-kv: transfer %s of request %s: prefill worker %s is "
                               "silent; its %d blocks are held until it says no write runs",
                               incoming.plan.transfer_id, incoming.plan.request_id, address,
                               len(incoming.plan.block_ids))

    def _maybe_release(self, incoming: Incoming, now: float) -> None:
        """(Lock held.) A failed transfer waiting for `Released`: its blocks go back once
        its prefill's process is gone; after `release_grace_s` if prefill answers pings
        without it (it has dealt with everything decode sent before, the Cancel included,
        and no write of it runs); while prefill is silent or still lists it (a write of it
        may run: a transport slower than every deadline), they are held (fenced, counted)
        for `fence_max_s` at most."""
        held = now - incoming.waiting_release_since
        peer = self._peers.get(incoming.address)
        answering = peer is not None and not peer.silent \
            and now - peer.last_heard < self.settings.peer_timeout_s
        running = incoming.known_at is not None \
            and now - incoming.known_at < 3 * self.settings.heartbeat_s
        if self.channel.connected(incoming.address) is False:
            pass  # its process is gone: nothing of it can land any more
        elif answering and not running and held > self.settings.release_grace_s:
            logger.warning("epd-kv: transfer %s: no release from prefill after %.0fs; it no "
                           "longer lists the transfer", incoming.plan.transfer_id,
                           self.settings.release_grace_s)
        elif held > self.settings.fence_max_s:
            self.stats.record("fence_expired")
            logger.error("epd-kv: transfer %s: prefill worker %s silent for over %.0fs; its "
                         "blocks are given back (it refuses writes for reservations that "
                         "old)", incoming.plan.transfer_id, incoming.address,
                         self.settings.fence_max_s)
        else:
            if running and held > self.settings.release_grace_s and not incoming.fenced:
                incoming.fenced = True
                self.stats.record("fenced")
                logger.warning("epd-kv: transfer %s of request %s: prefill worker %s still "
                               "runs writes of it after %.0fs; its %d blocks are held until "
                               "it says none runs", incoming.plan.transfer_id,
                               incoming.plan.request_id, incoming.address,
                               self.settings.release_grace_s, len(incoming.plan.block_ids))
            return
        incoming.waiting_release_since = None
        self._resolve(incoming)

    # -- state changes (caller holds the lock) ------------------------------
    def _conclude(self, incoming: Incoming, outcome: str, reason: str = "",
                  in_flight: bool = False) -> None:
        if incoming.outcome is not None:
            return
        incoming.outcome, incoming.reason = outcome, reason
        incoming.concluded_ns = time.time_ns()
        if outcome == "failed":
            self.stats.record("receive_failures")
            logger.warning("epd-kv: KV for request %s did not arrive (%s); decode computes "
                           "the prompt itself", incoming.plan.request_id, reason)
        elif outcome == "done":
            self.stats.record("received")
        if in_flight:
            incoming.waiting_release_since = time.monotonic()
        else:
            self._resolve(incoming)

    def _resolve(self, incoming: Incoming) -> None:
        if not incoming.resolved:
            incoming.resolved = True
            self._ready.append(incoming)
            self.results_ready.set()
