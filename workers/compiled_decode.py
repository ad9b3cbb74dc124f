"""The decode step compiled with torch.compile (--compilation-config mode torch_compile).

A step in which every sequence brings one new token (decodes, and prefill
chunks of one token) runs the model compiled by Inductor; any other step
runs it eager. On the CPU nearly every op of the forward is one of fleet's
fused C++ kernels (kernels/csrc/), which the graph calls as they are (their
shapes come from kernels/fake_ops.py): what compiling removes is the Python
around them (modules, the kernels' dispatch checks). Measured with
scripts/bench_compile.py (SmolLM2-135M Q4_1, two Zen 4 cores): 5.9 -> 5.1 ms
a step at one sequence, 13.6 -> 12.5 at 8, 40.8 -> 38.8 at 32.

Shapes: the batch dimension is symbolic (torch._dynamo.mark_dynamic), so
one graph serves every batch size; Dynamo still makes a graph for one
sequence (it specialises sizes 0 and 1) and one per side of each size
threshold the Python under it branches on (kernels/linear.py's decode
rows). No step is padded to a bucket: on the CPU a padded row costs as much
compute as a real one (~1.1 ms a row between 8 and 32 rows, above), more
than compiling saves. The block tables' width is symbolic too, kept at two
columns or more for the same reason as the batch.

Start-up runs a decode step of each of `CompilationConfig.warm_up_sizes`,
so the graphs compile before the first request. Their dummy tokens write
into the first blocks of the KV cache before any request owns one, and a
request writes each slot before it reads it.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F

from fleet.config.fleet import FleetConfig
from fleet.kernels import fake_ops
from fleet.kernels.attention import AttentionMetadata
from fleet.kernels.linear import DECODE_ROWS
from fleet.parallel.comm import get_pp_group

logger = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {"compile_threads": 1}
"""Compile in the worker process itself. With more threads Inductor starts a
pool of compile subprocesses, children that fleet's process tree does not
supervise, and on a CPU worker they would compete with the model's threads."""


class CompiledDecode:
    """The model's forward for decode-only steps, compiled; `applies` says
    which steps it takes."""

    def __init__(self, config: FleetConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.largest = config.compilation.largest_batch(config.scheduler.max_num_seqs)
        _check_compilable(model, device, self.largest)
        self.model = model
        self.warm_up_sizes = config.compilation.warm_up_sizes(config.scheduler.max_num_seqs)
        self.is_first_stage = get_pp_group().is_first
        self.hidden_size = model.spec.hidden_size
        self.forward = torch.compile(model, options=INDUCTOR_OPTIONS)

    def applies(self, meta: AttentionMetadata) -> bool:
        return meta.decodes_only and 1 <= meta.num_seqs <= self.largest

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward (same arguments) on a step that `applies`."""
        if meta.block_tables.shape[1] == 1:  # one column would be a graph of its own
            meta = dataclasses.replace(meta, block_tables=F.pad(meta.block_tables, (0, 1)))
        if meta.num_seqs > 1:  # one sequence is a graph of its own whatever is marked
            for tensor in (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables):
                torch._dynamo.mark_dynamic(tensor, 0)
            if intermediate is not None:
                torch._dynamo.mark_dynamic(intermediate, 1)  # [2, T, hidden]
        torch._dynamo.mark_dynamic(meta.block_tables, 1)
        return self.forward(input_ids, positions, kv_caches, meta, intermediate)

    def warm_up(self, kv_caches: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Run one decode step of each warm-up size before any request owns a
        block: sequence i is one token at slot i of the cache (position i mod
        block_size of block i // block_size); a pipeline stage after the first
        gets zeros for the previous stage's hidden states. Every rank of a
        stage runs the same sizes in the same order, so their collectives meet."""
        started = time.monotonic()
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        device = kv_caches[0].device
        for size in self.warm_up_sizes:
            rows = range(size)
            positions = [i % block_size for i in rows]
            tables = [[i // block_size % num_blocks] for i in rows]
            meta = AttentionMetadata.build([1] * size, [p + 1 for p in positions], tables, block_size, device)
            intermediate = None
            if not self.is_first_stage:
                intermediate = torch.zeros(2, size, self.hidden_size, dtype=dtype, device=device)
            tokens = torch.zeros(size, dtype=torch.int64, device=device)
            self(tokens, torch.tensor(positions, device=device), kv_caches, meta, intermediate)
        if self.warm_up_sizes:
            logger.info("compiled the decode step for batch sizes %s in %.1f s", self.warm_up_sizes,
                        time.monotonic() - started)


def _check_compilable(model: torch.nn.Module, device: torch.device, largest: int) -> None:
    """The compiled graph calls the fused CPU kernels; where they do not run
    (no compiler to build them, an attention shape they do not take), the
    torch-native attention would read host lists and recompile every step.
    Steps of more rows than kernels/linear.py's DECODE_ROWS multiply oneDNN's
    prepacked weights, which Inductor cannot read (an opaque tensor)."""
    if device.type != "cpu":
        raise ValueError(f"--compilation-config mode torch_compile is built for the cpu, not {device.type}")
    if not fake_ops.register():
        raise RuntimeError("--compilation-config mode torch_compile calls fleet's CPU kernels, "
                           "which could not be built here (see the warning above); use mode none")
    head_dim = model.head_dim
    if head_dim % 16 or head_dim > 256:
        raise ValueError(f"--compilation-config mode torch_compile needs fleet's CPU attention kernel, which takes "
                         f"a head_dim that is a multiple of 16 up to 256, not {head_dim=}; use mode none")
    if largest > DECODE_ROWS and any(param.is_mkldnn for param in model.parameters()):
        raise ValueError(f"--compilation-config max_batch_size (capped by --max-num-seqs) is {largest}, but decode "
                         f"steps of more than {DECODE_ROWS} sequences multiply this model's prepacked weights, "
                         f"which do not compile: set it to {DECODE_ROWS} or less")
