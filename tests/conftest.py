"""Fixtures of every test session."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _no_local_profiles(tmp_path_factory: pytest.TempPathFactory):
    """A profile a developer measured on their machine (`epd-serve profile --quick`, in
    .epd/profiles/) would be found by name before the shipped one: the tests read the
    shipped ones, whatever this machine holds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPD_PROFILE_DIR", str(tmp_path_factory.mktemp("local-profiles")))
        yield
