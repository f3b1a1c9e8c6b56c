"""The built wheel holds every package of the source tree under one namespace."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Source folder -> the package it becomes (pyproject.toml's package-dir).
ROOTS = {"epd_serve": "epd_serve", "backends": "epd_serve.backends", "proxy": "epd_serve.proxy"}


def source_packages() -> set[str]:
    packages = set()
    for folder, package in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            packages.add(".".join([package, *relative.parts]))
    return packages


def test_wheel_contains_every_source_package(tmp_path):
    # Build from a copy: setuptools reuses the build/ folder of earlier builds, whose
    # files would hide a package missing from pyproject.toml.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".epd", "build", "results", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("epd_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.removesuffix("/__init__.py").replace("/", ".")
                for n in names if n.endswith("/__init__.py")}
    assert source_packages() - in_wheel == set()
    assert "epd_serve/connectors/epd_kv/sender.py" in names
    assert "epd_serve/proxy/handoff/epd_push.py" in names
