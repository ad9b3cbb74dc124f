from __future__ import annotations

import pytest

from fleet.tests.engine.helpers import assert_no_fleet_processes


@pytest.fixture
def no_leftover_processes():
    yield
    assert_no_fleet_processes()
