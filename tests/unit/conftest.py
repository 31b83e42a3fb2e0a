"""The unit layer: no broker, no PostgreSQL, no process of its own, no Java (`make test-unit`:
about a minute and a half on 2 cores). Its stores are SQLite files; a check that needs
PostgreSQL, a broker, a server on a socket or a subprocess belongs in tests/integration/."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["sqlite"])
def empty_db_url(request, tmp_path) -> str:
    """A URL of an empty SQLite database (the integration layer runs each store test on both)."""
    return f"sqlite:///{tmp_path / 'rtrl.db'}"
