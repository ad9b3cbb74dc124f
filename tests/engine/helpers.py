"""Checks shared by engine and server tests: random prompts, leftover processes, free KV blocks."""
from __future__ import annotations

import random

import psutil


def random_prompts(count: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(min_len, max_len))] for _ in range(count)]


def fleet_children() -> list[psutil.Process]:
    """Live fleet processes under this test process."""
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def assert_no_fleet_processes(timeout: float = 10.0) -> None:
    gone, alive = psutil.wait_procs(fleet_children(), timeout=timeout)
    assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"


def assert_all_blocks_free(llm) -> None:
    stats = llm.call_utility("kv_stats")
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
