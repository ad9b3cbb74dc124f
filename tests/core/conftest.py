from __future__ import annotations

import pytest

from fleet.tests.core.scheduler_factories import CREATED_SCHEDULERS


@pytest.fixture(autouse=True)
def no_block_leaks():
    """After every test, every scheduler it made has no request left and all blocks free."""
    CREATED_SCHEDULERS.clear()
    yield
    for scheduler in CREATED_SCHEDULERS:
        assert not scheduler.has_unfinished_requests(), f"unfinished: {sorted(scheduler.requests)}"
        scheduler.kv_cache_manager.assert_all_free()
    CREATED_SCHEDULERS.clear()
