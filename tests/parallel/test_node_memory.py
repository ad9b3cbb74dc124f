"""The node's plan, end to end: launches of 8 workers with default memory
flags start exactly the processes `fleet plan` shows and serve on this
machine, every worker gets the KV cache that `fleet plan` shows, a KV cache
holds RAM only as it fills, and a launch that cannot fit is refused before
anything starts."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import psutil
import pytest

from fleet.config import EngineArgs
from fleet.core.launch.memory import kv_bytes_per_block
from fleet.tests.config.plan_json import of_kind, planned_processes
from fleet.tests.frontend.server import CHECKOUT, Server
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http, launched_names

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu")
# (model fixture, flags, what shapes a worker's KV block): 8 workers on this node each
LAYOUTS = [
    ("tiny_llama_dir", ("--tp", "4", "--dp", "2"), dict(tensor_parallel_size=4)),
    ("tiny_llama_dir", ("--tp", "2", "--pp", "2", "--dp", "2"), dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("tiny_mixtral_dir", ("--tp", "4", "--dp", "2", "--enable-expert-parallel"), dict(tensor_parallel_size=4)),
]


def planned(model_dir: str, layout: tuple[str, ...], kv_layout: dict) -> dict:
    """`fleet plan`'s memory for this layout, the KV blocks each replica gets
    from it, and the names of the processes it plans."""
    done = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "plan", model_dir, *layout, *TINY],
                          capture_output=True, text=True, timeout=120, check=True)
    plan = json.loads(done.stdout)
    workers = of_kind(plan, "worker")
    memory = plan["memory"]
    assert all(w["kv_cache_bytes"] == memory["per_worker"]["kv_cache"] for w in workers)
    config = EngineArgs(model=model_dir, dtype="float32", device="cpu", **kv_layout).create_config()
    blocks = memory["per_worker"]["kv_cache"] // kv_bytes_per_block(config)
    return {**memory, "blocks": blocks, "names": sorted(p["name"] for p in planned_processes(plan))}


def tree_rss(server: Server) -> int:
    processes = [psutil.Process(server.proc.pid), *server.descendants]
    return sum(p.memory_info().rss for p in processes)


@pytest.mark.parametrize("model_fixture,layout,kv_layout", LAYOUTS, ids=[" ".join(flags) for _, flags, _ in LAYOUTS])
def test_eight_workers_with_default_memory_flags_serve(request, model_fixture, layout, kv_layout):
    model_dir = request.getfixturevalue(model_fixture)
    plan = planned(model_dir, layout, kv_layout)
    server = Server(model_dir, *layout, *TINY)
    try:
        assert len(server.children_named("fleet-worker-")) == 8
        assert launched_names(server) == plan["names"], "the launch started what `fleet plan` showed"
        assert_greedy_over_http(server, model_dir, count=8, seed=3)
        blocks = [int(b) for b in re.findall(r"KV cache of (\d+) blocks", "".join(server.log))]
        assert blocks == [plan["blocks"]] * 2, "each replica's workers got the planned budget"
        assert tree_rss(server) <= plan["footprint_bytes"]
    finally:
        server.close()


def test_a_kv_cache_holds_ram_only_as_it_fills(tiny_llama_dir):
    server = Server(tiny_llama_dir, *TINY, "--kv-cache-memory-bytes", "4G")
    try:
        assert_greedy_over_http(server, tiny_llama_dir, count=4, seed=4)
        worker = server.children_named("fleet-worker-")[0]
        assert worker.memory_info().rss < 2**30, "the 4 GiB cache is reserved, not resident"
    finally:
        server.close()


def test_a_launch_that_cannot_fit_is_refused_before_it_starts(tiny_llama_dir):
    done = subprocess.run(
        [sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", tiny_llama_dir, *TINY, "--dp", "2",
         "--kv-cache-memory-bytes", "200G"],
        capture_output=True, text=True, timeout=120, cwd=CHECKOUT,
    )
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert re.search(r"this launch needs 40\d\.\d\d GiB of memory on this node but .* is free", message), message
    assert "--kv-cache-memory-bytes" in message and "--tp, --pp, --dp" in message
