"""The built wheel holds every package of the source tree under one namespace, and
every module imports from the installed wheel alone, without the repository and without
hardware packages."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Source folder -> the package it becomes (pyproject.toml's package-dir).
ROOTS = {"epd_serve": "epd_serve", "backends": "epd_serve.backends", "proxy": "epd_serve.proxy"}
# Device packages the backends may only import on demand; the import check hides them
# so that an eager import fails here even on a machine that has them.
HARDWARE = ("torch_npu", "vllm_ascend", "flashinfer")
# Engine packages some modules (vLLM connectors) need at import. Where the environment
# lacks one, those modules are reported as skipped rather than failed.
ENGINE = ("torch", "torchvision", "transformers", "vllm", "mooncake")


def source_packages() -> set[str]:
    packages = set()
    for folder, package in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            packages.add(".".join([package, *relative.parts]))
    return packages


def source_modules() -> list[str]:
    """Every module and package of the source tree, as the wheel names them; entry
    points (`__main__`) are left out, importing them would start the program."""
    modules = set()
    for folder, package in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO / folder).with_suffix("")
            parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
            if "__pycache__" in parts or relative.name == "__main__":
                continue
            modules.add(".".join([package, *parts]))
    return sorted(modules)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy: setuptools reuses the build/ folder of earlier builds, whose
    # files would hide a package missing from pyproject.toml. No environment is copied
    # (.venv-vllm023 alone came to 12 GB: its lib64 link is followed).
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".epd", "build", "results", "*.egg-info", "__pycache__",
        ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp), str(source)], check=True, capture_output=True)
    (built,) = tmp.glob("epd_serve-*.whl")
    return built


def test_wheel_contains_every_source_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.removesuffix("/__init__.py").replace("/", ".")
                for n in names if n.endswith("/__init__.py")}
    assert source_packages() - in_wheel == set()
    assert "epd_serve/connectors/epd_kv/sender.py" in names
    assert "epd_serve/proxy/handoff/epd_push.py" in names


# Runs in a fresh interpreter whose path is the installed wheel, then the environment's
# third-party packages: no repository, no editable-install hook (-S skips .pth files).
IMPORT_EVERYTHING = """
import importlib, importlib.util, json, os, sys

site_dir, modules, hardware, engine = json.loads(sys.argv[1])
start_path = list(sys.path)  # before imports: Ray puts its vendored folder first

# None in sys.modules: `import` raises ModuleNotFoundError and find_spec says "not
# installed", exactly as on a machine without the package.
for name in hardware:
    sys.modules[name] = None
results = {}
for module in modules:
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top in engine and importlib.util.find_spec(top) is None:
            results[module] = {"skipped": f"needs {top}, not installed here"}
        else:
            results[module] = {"error": f"{type(err).__name__}: {err}"}
    except BaseException as err:
        results[module] = {"error": f"{type(err).__name__}: {err}"}
    else:
        where = os.path.realpath(getattr(imported, "__file__", None) or "")
        if not where.startswith(os.path.realpath(site_dir) + os.sep):
            results[module] = {"error": f"imported from {where}, not from the wheel"}
        else:
            results[module] = {}
import epd_serve
print(json.dumps({"epd_serve": os.path.realpath(epd_serve.__file__), "path": start_path,
                  "results": results}))
"""


def test_every_module_imports_from_the_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    empty = tmp_path / "cwd"
    empty.mkdir()
    third_party = [p for p in site.getsitepackages() if Path(p).is_dir()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *third_party]),
           "PYTHONNOUSERSITE": "1"}
    flags = ["-S", "-P"] if sys.version_info >= (3, 11) else ["-S"]  # -P: no cwd on the path
    modules = source_modules()
    proc = subprocess.run(
        [sys.executable, *flags, "-c", IMPORT_EVERYTHING,
         json.dumps([str(target), modules, HARDWARE, ENGINE])],
        cwd=empty, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    site_dir = os.path.realpath(target)
    assert report["epd_serve"].startswith(site_dir + os.sep)
    assert report["path"][0] == str(target)
    assert not [p for p in report["path"] if p and Path(p).resolve() == REPO]

    results = report["results"]
    failed = {m: r["error"] for m, r in results.items() if "error" in r}
    skipped = {m: r["skipped"] for m, r in results.items() if "skipped" in r}
    for module, why in skipped.items():
        print(f"skipped {module}: {why}")
    for module, error in failed.items():
        print(f"FAILED {module}: {error}")
    assert failed == {}
    assert set(results) == set(modules)
    # The hardware backends and the bench stay importable in every install.
    for module in ("epd_serve.backends.cuda.platform", "epd_serve.backends.ascend.platform",
                   "epd_serve.bench.report", "epd_serve.cli.status_view", "epd_serve.proxy.app"):
        assert results[module] == {}, module


# The subpackages of epd_serve from the bottom up: a module may import its own
# subpackage and those below it, never one above. The package root (`epd_serve`) holds
# only the version and sits below them all.
LAYERS = ("protocols", "topology", "models", "mmstore", "connectors", "backends", "instances",
          "proxy", "deployment", "runtime", "bench", "planner", "testing", "cli")


def wheel_imports(wheel: Path) -> dict[str, set[str]]:
    """Every module of the wheel -> the epd_serve modules it imports, lazy (in-function)
    and type-checking imports included: each is a dependency someone reading it follows."""
    import ast

    archive = zipfile.ZipFile(wheel)
    sources = {}
    for name in archive.namelist():
        if name.startswith("epd_serve/") and name.endswith(".py"):
            parts = name.removesuffix(".py").split("/")
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            sources[module] = (archive.read(name).decode(), is_package)
    graph: dict[str, set[str]] = {}
    for module, (text, is_package) in sources.items():
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[:len(module.split(".")) - node.level + is_package]
                    base = ".".join(anchor + ([base] if base else []))
                # `from package import module` depends on the module itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base
                           for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t.split(".")[0] == "epd_serve" and t != module}
        graph[module] = deps
    return graph


def layer_of(module: str) -> int:
    parts = module.split(".")
    return -1 if len(parts) == 1 else LAYERS.index(parts[1])


def test_every_subpackage_has_a_layer_and_a_one_line_job(wheel):
    graph = wheel_imports(wheel)
    subpackages = {m.split(".")[1] for m in graph if m.count(".") >= 1}
    assert subpackages == set(LAYERS)
    archive = zipfile.ZipFile(wheel)
    import ast

    for sub in LAYERS:
        doc = ast.get_docstring(ast.parse(archive.read(f"epd_serve/{sub}/__init__.py")))
        assert doc, f"epd_serve/{sub}/__init__.py has no docstring"
        assert len(doc.splitlines()[0]) <= 100, f"{sub}: its job does not fit in one line"


def test_no_module_imports_a_subpackage_above_its_own(wheel):
    graph = wheel_imports(wheel)
    upward = sorted(f"{module} imports {dep}" for module, deps in graph.items() for dep in deps
                    if layer_of(dep) > layer_of(module))
    assert upward == []


def test_the_import_graph_has_no_cycles(wheel):
    graph = wheel_imports(wheel)
    edges = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    cycles = [c for c in _strongly_connected(edges) if len(c) > 1]
    assert cycles == []


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is a few hundred modules deep at most)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components
