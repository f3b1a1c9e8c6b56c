"""The HAL: its interface (hal.py), one implementation per platform, the registry by name.

Each subpackage exposes `PLATFORM`, an `epd_serve.backends.hal.Platform`. Importing one
must not import its hardware packages: those load lazily in `check_available()`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epd_serve.backends.hal import Platform

# The one list of platforms: deployment files, profiles and the CLI derive theirs from it.
PLATFORMS = ("cpu", "cuda", "ascend")


def get_platform(name: str) -> Platform:
    """Resolve a backend by name; imports only that backend's module."""
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; choose one of {', '.join(PLATFORMS)}")
    return importlib.import_module(f"epd_serve.backends.{name}").PLATFORM
