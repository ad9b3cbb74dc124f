"""An explicit --dtype bfloat16 on a CPU that emulates it says what it costs."""
from __future__ import annotations

import logging

import torch

from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.workers.cpu_dtype import warn_if_bfloat16_is_emulated


def test_emulated_bfloat16_is_warned_about_with_its_measured_cost(caplog):
    with caplog.at_level(logging.WARNING, logger="fleet.workers.cpu_dtype"):
        warn_if_bfloat16_is_emulated(torch.bfloat16)
        warn_if_bfloat16_is_emulated(torch.float32)
    warnings = [record.getMessage() for record in caplog.records]
    if cpu_computes_bfloat16():
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert "emulated" in warnings[0] and "ms in float32" in warnings[0] and "--dtype auto" in warnings[0]
