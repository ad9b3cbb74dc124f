from __future__ import annotations

from collections.abc import Iterator

import pytest

from fleet.kernels.attention import set_cpu_kernels_enabled
from fleet.kernels.cpu_extension import cpu_kernels


@pytest.fixture(scope="module")
def ops():
    """The built CPU kernel ops; tests that need them skip where they cannot be built."""
    built = cpu_kernels()
    if built is None:
        pytest.skip("the CPU kernel extension cannot be built here")
    return built


@pytest.fixture(autouse=True)
def _kernels_enabled_afterwards() -> Iterator[None]:
    yield
    set_cpu_kernels_enabled(True)
