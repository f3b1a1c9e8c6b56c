"""Fixtures shared by the unit tests of every subpackage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epd_serve.mmstore import StoreSpec

from tests.stores import started_shm_store


@pytest.fixture(scope="module")
def store_spec(request: pytest.FixtureRequest) -> Iterator[StoreSpec]:
    """A shared-memory MM Store (tests/stores.py, 8 MiB) serving the tests of one
    module, on free loopback ports; its arena is named after the module, so the keys
    one module puts never meet another's."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    with started_shm_store(f"unit-{module.replace('_', '-')}") as spec:
        yield spec
