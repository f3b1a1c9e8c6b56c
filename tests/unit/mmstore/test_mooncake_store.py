"""Mooncake MM Store backend against a real master and holder (run inside a netns:
`scripts/in-netns.sh`, which `scripts/test.sh` uses)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from epd_serve.mmstore import FeatureMeta, StoreError, StoreSpec
from epd_serve.mmstore.mooncake import (
    LEASE_TTL_MS,
    MooncakeStore,
    holder_command,
    master_command,
)
from tests.ports import free_port_block

BIN = Path(sys.executable).parent
MiB = 1 << 20
META = FeatureMeta(shape=(4, 8), dtype="float16", placeholder={"image_grid_thw": [[1, 2, 2]]})


def test_commands_bind_the_spec_host_and_enable_eviction():
    spec = StoreSpec(backend="mooncake", host="10.0.0.5", port=7000, metrics_port=7001,
                     capacity_bytes=3 << 30, protocol="rdma")
    master = master_command(spec, "/bin/mm")
    assert master[0] == "/bin/mm"
    assert {"--rpc_address=10.0.0.5", "--rpc_port=7000", "--metrics_host=10.0.0.5",
            "--metrics_port=7001", f"--default_kv_lease_ttl={LEASE_TTL_MS}"} <= set(master)
    assert any(f.startswith("--eviction_high_watermark_ratio=") for f in master)
    assert any(f.startswith("--eviction_ratio=") for f in master)
    holder = holder_command(spec)
    assert holder[0] == "mooncake_client"
    assert {"--host=10.0.0.5", "--master_server_address=10.0.0.5:7000",
            f"--global_segment_size={3 << 30}", "--protocol=rdma",
            "--metadata_server=P2PHANDSHAKE", "--port=7002"} <= set(holder)
    assert not any("0.0.0.0" in f for f in master + holder)


def test_module_imports_without_mooncake():
    code = ("import sys; sys.modules['mooncake'] = None; "
            "import epd_serve.mmstore.mooncake")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _master_listening(spec: StoreSpec) -> bool:
    try:
        socket.create_connection((spec.host, spec.port), timeout=1).close()
    except OSError:
        return False
    return True


def _capacity_mounted(spec: StoreSpec) -> bool:
    url = f"http://{spec.host}:{spec.metrics_port}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=1).read().decode()
    except OSError:
        return False
    return any(line.startswith("master_total_capacity_bytes ")
               and float(line.split()[1]) >= spec.capacity_bytes for line in text.splitlines())


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    # Mooncake listens on every interface: same rule as tests/e2e/conftest.py.
    extra = [i for i in os.listdir("/sys/class/net") if i != "lo"]
    if extra and os.environ.get("EPD_ALLOW_HOST_NETWORK") != "1":
        pytest.fail(f"this network namespace has {extra}: run through scripts/test.sh "
                    "or scripts/in-netns.sh (loopback only)")
    base = free_port_block(3, start=23000)
    spec = StoreSpec(backend="mooncake", host="127.0.0.1", port=base, metrics_port=base + 1,
                     capacity_bytes=64 * MiB)
    logs = tmp_path_factory.mktemp("mooncake")
    procs: list[subprocess.Popen] = []

    def start_and_wait(name: str, cmd: list[str], ready) -> None:
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=logs))
        deadline = time.monotonic() + 15
        while not ready(spec):
            assert procs[-1].poll() is None, f"{name} exited; see {logs}"
            assert time.monotonic() < deadline, f"{name} not ready in 15 s; see {logs}"
            time.sleep(0.05)

    try:
        start_and_wait("master", master_command(spec, str(BIN / "mooncake_master")),
                       _master_listening)
        # The holder retries a master it cannot reach only every few seconds: start it after.
        start_and_wait("holder", holder_command(spec, str(BIN / "mooncake_client")),
                       _capacity_mounted)
        yield spec
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def store(spec):
    with MooncakeStore(spec) as store:
        yield store


def payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_round_trip_bytes_and_meta(store):
    data = payload(3 * MiB + 5, seed=1)
    assert store.put("rt", data.tobytes(), META)
    got, meta = store.get("rt")
    assert meta == META
    assert got.dtype == np.uint8 and got.flags.writeable
    assert np.array_equal(got, data)
    # Arrays of any dtype and memoryviews are stored as their bytes.
    halves = np.arange(1000, dtype=np.float16).reshape(10, 100)
    assert store.put("rt-f16", memoryview(halves), META)
    assert store.get("rt-f16")[0].tobytes() == halves.tobytes()


class RecordingClient:
    """Forwards to the Mooncake client and remembers each call."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args[:1]))
            return getattr(self.client, name)(*args)
        return call


def test_lookup_reads_only_the_meta(store, monkeypatch):
    assert store.put("lk", payload(MiB, seed=2), META)
    recorder = RecordingClient(store._store)
    monkeypatch.setattr(store, "_store", recorder)
    assert store.lookup("lk") == META
    assert recorder.calls == [("is_exist", ("lk",)), ("get", ("lk/meta",))]


def test_put_existing_key_returns_false_and_keeps_the_value(store):
    assert store.put("dup", b"first", META)
    assert not store.put("dup", b"other", META)
    assert store.get("dup")[0].tobytes() == b"first"


def test_a_feature_not_the_one_its_meta_was_written_with_reads_as_a_miss(store):
    """Feature and meta are two Mooncake objects: the meta can outlive its feature, and
    another value can then take the feature's key (or a write Mooncake revoked land in
    its space). The meta's checksum makes that a miss, never another feature's bytes."""
    data = payload(MiB, seed=4)
    assert store.put("swapped", data, META)
    assert store._store.batch_remove(["swapped"]) == [0]  # the feature alone goes
    assert store._store.put("swapped", payload(MiB, seed=5).tobytes()) == 0  # another's
    corrupt = store.corrupt_reads
    assert store.get("swapped") is None
    assert store.corrupt_reads == corrupt + 1
    assert store.delete("swapped")


def test_empty_feature_is_refused(store):
    assert not store.put("empty", b"", META)
    assert store.lookup("empty") is None


def test_missing_key(store):
    assert store.get("absent") is None
    assert store.lookup("absent") is None
    assert not store.delete("absent")


def test_delete_waits_out_the_lease_of_a_read(store):
    assert store.put("del", b"x" * 1000, META)
    assert store.delete("del")  # nothing read it yet: no lease
    assert store.put("del", b"y" * 1000, META)
    assert store.get("del") is not None  # the read holds a lease for LEASE_TTL_MS
    started = time.monotonic()
    assert store.delete("del")
    assert time.monotonic() - started > LEASE_TTL_MS / 1000 / 2
    assert store.get("del") is None and store.lookup("del") is None


def test_another_process_reads_what_this_one_wrote(store, spec):
    data = payload(8 * MiB, seed=3)
    assert store.put("xproc", data, META)
    reader = ("import sys, hashlib; "
              "from epd_serve.mmstore import StoreSpec; "
              "from epd_serve.mmstore.mooncake import MooncakeStore; "
              "s = MooncakeStore(StoreSpec.from_json(sys.argv[1])); "
              "data, meta = s.get('xproc'); "
              "print(hashlib.sha256(data).hexdigest(), meta.encode().hex()); s.close()")
    out = subprocess.run([sys.executable, "-c", reader, spec.to_json()], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == [hashlib.sha256(data).hexdigest(), META.encode().hex()]


def test_overfilling_evicts_old_features_without_raising(store):
    # Last of the tests on the pool: it fills the shared 64 MiB with 4 MiB features. A
    # put that finds no room (eviction runs in the background) answers False; retrying
    # succeeds once the master has evicted the oldest unleased features.
    assert not store.put("too-big", np.zeros(80 * MiB, dtype=np.uint8), META)
    value, count = 4 * MiB, 28
    refused = 0
    for i in range(count):
        deadline = time.monotonic() + 5
        while not store.put(f"fill{i}", payload(value, seed=100 + i), META):
            refused += 1
            assert time.monotonic() < deadline, f"fill{i} never fitted"
            time.sleep(0.1)
    got = store.get(f"fill{count - 1}")
    assert got is not None and np.array_equal(got[0], payload(value, seed=100 + count - 1))
    gone = [i for i in range(8) if store.lookup(f"fill{i}") is None]
    assert gone, f"no early feature was evicted ({refused} puts refused)"


def test_no_master_fails_fast():
    port = free_port_block(1, start=31000)
    started = time.monotonic()
    with pytest.raises(StoreError, match="not reachable"):
        MooncakeStore(StoreSpec(backend="mooncake", port=port))
    assert time.monotonic() - started < 5
