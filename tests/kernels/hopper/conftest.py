"""Shared by the Gluon (Hopper) kernel tests: every test forces the Gluon engine."""

import pytest


@pytest.fixture(autouse=True)
def _force_gluon(monkeypatch):
    # FLASHTILE_ENGINE=gluon: a call the Gluon kernels cannot take fails instead of silently
    # running the tl.* kernels.
    monkeypatch.setenv("FLASHTILE_ENGINE", "gluon")
