"""Scheduler side of the epd KV connector: which requests send or receive, and when.

Runs in the engine-core process, inside vLLM's scheduler; must stay cheap and never
touch the network (workers do that).
- decode (`kv_consumer`): a request with `do_remote_prefill` loads its whole prompt
  asynchronously; once blocks are allocated the next step's plan tells the workers to
  reserve them with the prefill instance named in `kv_transfer_params`
  (`remote_host`, `remote_port`). When the request finishes, its transfer report is
  returned in `kv_transfer_params["epd_kv"]`; where the engine exports spans, the
  transfer (reserved, each group landed, concluded) is one of the request's timeline
  (connectors/spans.py: recorded here, exported by a background thread).
- prefill (`kv_producer`): every step that computes part of a `do_remote_decode`
  request's prompt tells the workers which blocks and tokens that step writes; when the
  request finishes its blocks stay pinned until the workers report the writes done.
  Every request it computes waits for its encoder features first (feature_gate.py).
- both (`kv_both`): an instance the proxy may use as prefill or as decode, switching
  at run time by routing alone. Each request is taken as its own parameters ask: one
  with `do_remote_decode` is prefilled and sent as above, one with `do_remote_prefill`
  received as above, one with neither computed here (through the feature gate, as on
  prefill); one with both is refused. Sends and receives of different requests run
  side by side, in the same steps.

One transfer is received by one request and sent by one: vLLM's `n` samples of a
prompt reach decode as `n` requests carrying the prompt's one transfer (the proxy sends
prefill `n: 1`). The first of them to be scheduled receives the KV; its siblings wait
until it is in this engine's prefix cache, then compute only what the cache lacks (the
prompt's last, partial block), as one engine's samples share their prompt; they answer
with its transfer report. A second request sending a transfer another one sends is
refused (computed, nothing sent).

A request's parameters are read through protocols/epd_push.py's structs. Ones that do
not match (decode's `remote_port` missing, a renamed key, an `epd_v` this connector does
not know) are refused loudly: an ERROR log naming the field, no transfer, and the
refusal in the request's own report (`{"epd_kv": {"outcome": "refused", "reason": ...}}`),
which the proxy turns into a 502 naming the field. The refusal is of the transfer, not
of the request: vLLM's KV connector scheduler interface has no call that fails a
request, so the engine still computes it (decode: the whole prompt) and the proxy,
reading the report, is the one that fails it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from msgspec import UNSET

from epd_serve.connectors import feature_gate
from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.metadata import StepPlan, TransferReport
from epd_serve.connectors.epd_kv.prompt_tail import keep_plans
from epd_serve.connectors.epd_kv.settings import RECEIVING_ROLES, SENDING_ROLES, Settings
from epd_serve.connectors.spans import ConnectorSpans
from epd_serve.protocols import epd_push as wire
from epd_serve.protocols.epd_push import REPORT_KEY, DecodeParams, PrefillParams
from epd_serve.protocols.params import ParamsError, from_dict, to_dict

logger = logging.getLogger("vllm.epd_serve.kv.scheduler")
P = TypeVar("P", DecodeParams, PrefillParams)


@dataclasses.dataclass
class SharedReceive:
    """The requests of one transfer on decode: the holder receives it, the siblings
    (vLLM's other samples of the prompt) wait until its KV is in the prefix cache."""

    transfer_id: str
    holder: str
    members: set[str] = dataclasses.field(default_factory=set)  # not finished yet
    landed: bool = False  # the holder ran (its KV cached here) or finished
    report: dict[str, Any] | None = None  # the holder's transfer report


class EPDKVScheduler:
    def __init__(self, vllm_config, settings: Settings):
        self.settings = settings
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        role = vllm_config.kv_transfer_config.kv_role
        # What this instance may do with a request's KV; kv_both may do either, and
        # which one a request gets is read from its own parameters (_hand_off).
        self.sends = role in SENDING_ROLES
        self.receives = role in RECEIVING_ROLES
        # request id -> (Request being prefilled, its parameters)
        self._sending: dict[str, tuple[Any, PrefillParams]] = {}
        # Their blocks, from the scheduler outputs (vLLM before 0.32 lends a connector
        # no cache manager to ask).
        self._block_ids: dict[str, list[int]] = {}
        self._shipped: dict[str, int] = {}  # request id -> blocks sent by earlier chunks
        self._finished_sends: list[msg.FinishedSend] = []
        self._unreleased: set[str] = set()  # finished, blocks pinned until the workers say
        self._recvs: list[msg.RecvPlan] = []
        self._receiving: set[str] = set()  # decode requests whose transfer is reserved
        self._shared: dict[str, SharedReceive] = {}  # by transfer id
        self._shares: dict[str, str] = {}  # request id -> the transfer it receives (with)
        self._send_ids: dict[str, str] = {}  # transfer id -> the request sending it
        self.internal_errors = 0  # exceptions of our own code since the last step
        self._reports: dict[str, dict[str, Any]] = {}
        # request id -> the report of parameters refused, returned when it finishes
        self._refused: dict[str, dict[str, Any]] = {}
        self.spans = ConnectorSpans.of(vllm_config) if self.receives else None
        self._trace_headers: dict[str, Mapping[str, str]] = {}  # receiving, traced

    def _hand_off(self, request) -> str | None:
        """What this instance does with the request's KV: "receive" it (decode, asked
        by `do_remote_prefill`), "send" it (prefill, asked by `do_remote_decode`), or
        None: computed here, nothing handed off. A kv_producer or kv_consumer reads only
        its own flag, as it always has; a kv_both instance refuses a request that asks
        for both (a proxy bug), and computes it."""
        params = request.kv_transfer_params
        if not params:
            return None
        receive = self.receives and bool(params.get("do_remote_prefill"))
        send = self.sends and bool(params.get("do_remote_decode"))
        if receive and send:
            self._refuse(request, "kv_both", "kv_transfer_params: "
                         "`do_remote_prefill` and `do_remote_decode` are both set; a "
                         "request's KV is either received here or sent from here")
            params["do_remote_prefill"] = params["do_remote_decode"] = False
            return None
        return "receive" if receive else "send" if send else None

    def _read(self, request, kind: type[P]) -> P | None:
        """The request's kv_transfer_params as `kind`; None, refused, where they do not
        match: logged naming the field, and the refusal kept for the request's report."""
        try:
            return from_dict(kind, request.kv_transfer_params, "kv_transfer_params")
        except ParamsError as err:
            # Named by what the parameters ask of this instance, not by its role: a
            # kv_both instance is the prefill of some requests and the decode of others.
            self._refuse(request, "prefill" if kind is PrefillParams else "decode", str(err))
            return None

    def _refuse(self, request, side: str, reason: str) -> None:
        """Loudly, naming the field: the refusal goes back in the request's own report,
        for the proxy to fail the request (no call here can)."""
        logger.error("epd-kv: %s refuses the KV transfer of request %s, no transfer: %s",
                     side, request.request_id, reason)
        self._refused[request.request_id] = {REPORT_KEY: to_dict(wire.refusal(reason))}

    # -- before allocation -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._hand_off(request) == "receive":
            return self._remote_tokens(request, num_computed_tokens)
        # Prefilled here (its KV sent on, or not): None keeps the request waiting while
        # its encoder features are read, the one call every scheduler makes before it
        # schedules encoder inputs (feature_gate.py). A kv_consumer asks nothing, as
        # before kv_both.
        if self.sends and not feature_gate.features_ready(self.vllm_config, request,
                                                          num_computed_tokens):
            return None, False
        return 0, False

    def _remote_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the prompt's tokens past this engine's own prefix hit come from the
        prefill instance, asynchronously."""
        wanted = self._read(request, DecodeParams)
        if wanted is None:
            # Refused: computed here (no call fails it), the proxy fails it on the report.
            request.kv_transfer_params["do_remote_prefill"] = False
            return 0, False
        shared = self._shared.setdefault(
            wanted.transfer_id, SharedReceive(wanted.transfer_id, request.request_id))
        shared.members.add(request.request_id)
        self._shares[request.request_id] = wanted.transfer_id
        if shared.holder != request.request_id:
            return self._sibling_tokens(request, shared)
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    @staticmethod
    def _sibling_tokens(request, shared: SharedReceive) -> tuple[int | None, bool]:
        """A sibling of the transfer's holder: None (stay waiting) until the holder's KV
        is in the prefix cache; then nothing remote, vLLM's prefix hit takes it."""
        if not shared.landed:
            return None, False
        request.kv_transfer_params["do_remote_prefill"] = False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        hand_off = self._hand_off(request)
        if hand_off == "send":
            sent = self._read(request, PrefillParams)
            if sent is None:
                return
            owner = self._send_ids.setdefault(sent.transfer_id, request.request_id)
            if owner != request.request_id:
                self._refuse(request, "prefill", f"transfer {sent.transfer_id} is sent by "
                             f"request {owner} already")
                return
            self._sending[request.request_id] = (request, sent)
        elif hand_off == "receive":
            self._reserve(request, blocks, num_external_tokens)

    def _reserve(self, request, blocks, num_external_tokens: int) -> None:
        """Decode: plan the reservation of the blocks just allocated for the prompt's KV
        with the prefill instance its parameters name."""
        # One transfer per request, even if it is preempted.
        request.kv_transfer_params["do_remote_prefill"] = False
        wanted = self._read(request, DecodeParams)
        if wanted is None:
            return  # its refusal is reported when it finishes
        prompt_len = len(request.prompt_token_ids or [])
        # The allocated blocks past this engine's own prefix-cache hit (still unhashed
        # while the load is pending) receive the prompt's KV.
        block_ids = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._receiving.add(request.request_id)
        if self.spans is not None and getattr(request, "trace_headers", None):
            self._trace_headers[request.request_id] = request.trace_headers
        self._recvs.append(msg.RecvPlan(
            request_id=request.request_id, transfer_id=wanted.transfer_id,
            prefill_host=wanted.remote_host, prefill_port=wanted.remote_port,
            block_ids=block_ids,
            first_block=(prompt_len - num_external_tokens) // self.block_size,
            num_tokens=prompt_len))

    def fail_receive(self, request, blocks, num_external_tokens: int, why: str) -> None:
        """Decode: a receive the calls above could not plan (a bug of ours). The blocks
        vLLM allocated for it go to the worker marked failed, which reports the receive
        failed at once: decode computes the prompt, nothing waits for a transfer."""
        block_ids = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._receiving.discard(request.request_id)
        if block_ids:
            self._recvs.append(msg.RecvPlan(request.request_id, "", "", 0, block_ids, 0, 0,
                                            error=f"the scheduler could not plan it: {why}"))

    def abandon_step(self, scheduler_output, why: str) -> StepPlan:
        """The plan of a step whose planning failed (a bug of ours): its writes are not
        planned (their transfers fail when their requests finish, and decode computes
        those prompts), the reservations it would have sent fail at once, and the
        finished sends still reach the workers, so no block stays pinned."""
        failed = [dataclasses.replace(r, error=f"the step could not be planned: {why}")
                  if r.block_ids else r for r in self._recvs]
        plan = StepPlan(recvs=failed, finished_sends=self._finished_sends,
                        num_tokens=scheduler_output.total_num_scheduled_tokens,
                        internal_errors=self.internal_errors)
        self._recvs, self._finished_sends, self.internal_errors = [], [], 0
        return plan

    # -- every step -----------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> StepPlan:
        plan = StepPlan(recvs=self._recvs, finished_sends=self._finished_sends,
                        num_tokens=scheduler_output.total_num_scheduled_tokens,
                        internal_errors=self.internal_errors)
        self._recvs, self._finished_sends, self.internal_errors = [], [], 0
        self._note_holders_running(scheduler_output)
        if self._receiving:
            plan.keep = keep_plans(scheduler_output.scheduled_new_reqs, self._receiving,
                                   self.block_size)
        track_block_ids(self._block_ids, scheduler_output, self._sending)
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            sending = self._sending.get(request_id)
            if sending is None:
                continue
            request, sent = sending
            start = request.num_computed_tokens  # vLLM advances it after this call
            if start >= request.num_prompt_tokens:
                continue  # a decode step: its KV is not handed off
            end = min(start + count, request.num_prompt_tokens)
            first_block, end_block = msg.blocks_to_ship(
                end, request.num_prompt_tokens, self.block_size, self._shipped.get(request_id, 0))
            self._shipped[request_id] = end_block
            plan.sends.append(msg.SendChunk(
                request_id=request_id, transfer_id=sent.transfer_id,
                block_ids=list(self._block_ids.get(request_id, ())),
                start=start, end=end, prompt_len=request.num_prompt_tokens,
                first_block=first_block, end_block=end_block,
                mode=None if sent.epd_mode is UNSET else sent.epd_mode,
                fault=None if sent.epd_fault is UNSET else sent.epd_fault))
        preempted = scheduler_output.preempted_req_ids or set()
        plan.preempted = [r for r in preempted if r in self._sending]
        for request_id in plan.preempted:
            self._shipped.pop(request_id, None)  # prefilled (and shipped) again from 0
        return plan

    def _note_holders_running(self, scheduler_output) -> None:
        """A holder scheduled to run has its received KV in the prefix cache (vLLM
        caches it before scheduling): its siblings may go."""
        if not self._shared:
            return
        for new in scheduler_output.scheduled_new_reqs:
            shared = self._shared.get(self._shares.get(new.req_id, ""))
            if shared is not None and shared.holder == new.req_id:
                shared.landed = True

    def update_connector_output(self, connector_output) -> None:
        for request_id in connector_output.finished_sending or ():
            self._unreleased.discard(request_id)
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, TransferReport):
            return
        for request_id, stats in report.by_request.items():
            times = stats.pop(msg.REPORT_TIMES_KEY, None)
            headers = self._trace_headers.pop(request_id, None)
            if headers and times:
                self._record_span(headers, stats, times)
            # Reports of requests already finished (aborted) have nobody to go to.
            if request_id in self._receiving:
                self._reports[request_id] = stats
            shared = self._shared.get(self._shares.get(request_id, ""))
            if shared is not None and shared.holder == request_id:
                shared.report = stats  # what its siblings answer with

    def _record_span(self, headers: Mapping[str, str], stats: dict[str, Any],
                     times: dict[str, Any]) -> None:
        """The transfer as a span under the decode hop: from the reservation with
        prefill until it concluded, each group's landing an event."""
        attributes = {f"epd.kv.{key}": value for key, value in stats.items()
                      if isinstance(value, (int, float, str))}
        events = [(f"layers {first}-{last} landed", ns) for ns, first, last in times["landed"]]
        self.spans.record("kv receive", headers, times["reserved"], times["concluded"],
                          attributes, events)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping (and so polling its workers) while blocks of
        # finished requests wait for their writes to end.
        return bool(self._unreleased or self._finished_sends)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        request_id = request.request_id
        refused = self._refused.pop(request_id, None)
        self._shipped.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        sending = self._sending.pop(request_id, None)
        if sending is not None:
            return self._sent(request, sending[1])
        if not self.receives:
            return False, refused
        return self._received(request, refused)

    def _sent(self, request, sent: PrefillParams) -> tuple[bool, None]:
        """Prefill: the request's blocks stay pinned until the workers say no write of
        its KV runs any more."""
        aborted = request.status.name not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
        self._send_ids.pop(sent.transfer_id, None)
        self._finished_sends.append(msg.FinishedSend(request.request_id, sent.transfer_id,
                                                     aborted))
        self._unreleased.add(request.request_id)
        return True, None

    def _received(self, request, refused: dict | None) -> tuple[bool, dict | None]:
        """Decode (or a request computed here on an instance that receives): the
        transfer's report, or the refusal of its parameters, for the answer."""
        params = request.kv_transfer_params or {}
        shared = self._shared.get(self._shares.get(request.request_id, ""))
        sibling = shared is not None and shared.holder != request.request_id
        if params.get("do_remote_prefill") and not sibling:
            # Aborted before blocks were allocated: prefill must not wait for us. (Not a
            # sibling's: the transfer is its holder's to cancel.)
            params["do_remote_prefill"] = False
            wanted = self._read(request, DecodeParams)
            if wanted is not None:
                self._recvs.append(msg.RecvPlan(
                    request.request_id, wanted.transfer_id, wanted.remote_host,
                    wanted.remote_port, [], 0, 0))
            else:
                refused = self._refused.pop(request.request_id, None)
        self._drop_pending_reservation(request)
        self._receiving.discard(request.request_id)
        self._trace_headers.pop(request.request_id, None)
        holders_report = self._leave_shared(request)
        report = self._reports.pop(request.request_id, None) or holders_report
        if refused is not None:
            return False, refused
        return False, ({REPORT_KEY: self._versioned(report)} if report else None)

    def _drop_pending_reservation(self, request) -> None:
        """A reservation not yet handed to the workers goes with its finished request:
        its blocks are vLLM's again, nothing may be written into them. Prefill, which
        would wait for it, is told the transfer is off (an empty reservation)."""
        pending = [r for r in self._recvs if r.request_id == request.request_id]
        if not pending:
            return
        self._recvs = [r for r in self._recvs if r.request_id != request.request_id]
        self._recvs += [dataclasses.replace(r, block_ids=[], first_block=0, num_tokens=0)
                        for r in pending if r.block_ids and not r.error]

    def _leave_shared(self, request) -> dict[str, Any] | None:
        """A finished request leaves its transfer's group (a holder that finishes lets
        its siblings go); a sibling answers with the holder's report."""
        shared = self._shared.get(self._shares.pop(request.request_id, ""))
        if shared is None:
            return None
        shared.members.discard(request.request_id)
        if shared.holder == request.request_id:
            shared.landed = True
        if not shared.members:
            del self._shared[shared.transfer_id]
        return dict(shared.report) if shared.report and shared.holder != request.request_id \
            else None

    @staticmethod
    def _versioned(stats: dict[str, Any]) -> dict[str, Any]:
        """A worker's report of a transfer as decode answers it: the struct the proxy
        reads (protocols/epd_push.py), version included."""
        try:
            report = from_dict(wire.TransferReport, stats, f"kv_transfer_params.{REPORT_KEY}")
        except ParamsError as err:  # our worker and this struct disagree: a bug of ours
            logger.error("epd-kv: a transfer report does not match its struct: %s", err)
            report = wire.TransferReport(outcome="failed", reason=f"malformed report: {err}")
        return to_dict(report)

    def shutdown(self) -> None:
        if self.spans is not None:
            self.spans.close()


def track_block_ids(table: dict[str, list[int]], scheduler_output, wanted) -> None:
    """Keep `table` (request id -> its block ids, first KV cache group) up to date from
    one step's scheduler output, for the request ids in `wanted`. The same rules the
    workers build their block tables by: a new or resumed request comes with all its
    blocks, a running one with those added this step."""
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id in wanted:
            table[new.req_id] = list(new.block_ids[0])
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids):
        if req_id not in wanted:
            continue
        added = list(block_ids[0]) if block_ids else []
        if req_id in cached.resumed_req_ids:
            table[req_id] = added
        else:
            table.setdefault(req_id, []).extend(added)
