"""This machine's limits, and how close a `fleet bench serve` run came to them (issue 27, point 2).

    python -P scripts/roofline.py                                   # the peaks only
    fleet bench serve --max-concurrency 1 --result-json c1.json ...  # (or vllm bench serve's JSON), then
    python -P scripts/roofline.py --result-json c1.json c32.json [--model PATH] [--dtype float32]

Peaks, measured here with every core:
  - compute: the GEMM rate of torch.mm (oneDNN, the best dense kernel this
    CPU class has) in float32 and bfloat16 (emulated, and slow, without native bfloat16);
  - bandwidth: a stream-like read (a sum over 1 GiB, larger than any cache).
Model facts come from fleet's own loader (the weights as fleet holds them: a
GGUF's kept blocks count at their size), for the model the run served
(default: the default model) in the dtype `fleet launch` picks here.

Per result: prefill FLOP/s (the median TTFT at concurrency 1 is one prompt's
prefill) against the compute peak, and per decode step (the median TPOT) the
bytes read (weights once, each sequence's KV) and the FLOPs, against both
limits: the binding one is the larger of bytes / bandwidth and FLOPs / peak,
and "of limit" is that time over the step's time. One run, this machine only.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from fleet.config.cpu_class import cpu_class, cpu_computes_bfloat16
from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import default_model_path, hf_config_from_gguf
from fleet.kernels.linear import AMX_BLOCK_ROWS
from fleet.workers.loader import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_seconds(work, repeats: int = 5) -> float:
    work()  # warm up: threads, caches, oneDNN's primitive
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_flops_per_s(dtype: torch.dtype, size: int = 2048) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b))


def read_bytes_per_s(nbytes: int = 2**30) -> float:
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_seconds(lambda: data.sum())


class ModelFacts:
    """What one forward of the model reads and computes."""

    def __init__(self, path: str, dtype: torch.dtype):
        is_gguf = path.endswith(".gguf")
        hf_config = hf_config_from_gguf(path) if is_gguf else json.load(open(os.path.join(path, "config.json")))
        config = ModelConfig(model=path, model_path=path, architecture=hf_config["architectures"][0],
                             hf_config=hf_config, dtype=str(dtype).removeprefix("torch."))
        model = load_model(config, LoadConfig(load_format="gguf" if is_gguf else "auto"), dtype, "cpu")
        # A oneDNN-prepacked weight (opaque: no storage to ask) counts its elements.
        tensors = {id(t) if t.is_mkldnn else t.untyped_storage().data_ptr():
                   t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
                   for t in [*model.parameters(), *model.buffers()]}
        self.weight_bytes = sum(tensors.values())
        """Every weight once (a tied head shares its embedding's): what a decode step reads."""
        copied = {m.weight.data_ptr(): m.weight for m in model.modules() if getattr(m, "amx_weight", None) is not None}
        self.amx_copy_bytes_added = sum(2 * w.gguf_shape[0] * w.gguf_shape[1] - w.nbytes for w in copied.values())
        """What a step of more than AMX_BLOCK_ROWS rows reads more: the layers' bfloat16 copies of their
        kept blocks instead of the blocks (kernels/linear.py; on AMX only)."""
        c = hf_config
        self.layers, hidden, inter = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads", heads)
        self.head_dim = c.get("head_dim") or hidden // heads
        self.q_width = heads * self.head_dim
        per_layer = hidden * (self.q_width + 2 * kv_heads * self.head_dim) + self.q_width * hidden + 3 * hidden * inter
        self.matmul_params = self.layers * per_layer
        self.head_params = hidden * c["vocab_size"]
        self.kv_bytes_per_token = 2 * self.layers * kv_heads * self.head_dim * dtype.itemsize

    def prefill_flops(self, tokens: int) -> float:
        """Linear layers for every token, causal attention (QK and PV), the head for the last token."""
        attention = 2 * 2 * self.layers * self.q_width * tokens * tokens / 2
        return 2 * self.matmul_params * tokens + attention + 2 * self.head_params

    def decode_step(self, batch: int, context: float) -> tuple[float, float]:
        """(bytes read, FLOPs) of one decode step of `batch` sequences of `context` tokens each."""
        kv = batch * context * self.kv_bytes_per_token
        flops = batch * (2 * (self.matmul_params + self.head_params) + 2 * 2 * self.layers * self.q_width * context)
        weights = self.weight_bytes + (self.amx_copy_bytes_added if batch > AMX_BLOCK_ROWS else 0)
        return weights + kv, flops


def report_run(result: dict, facts: ModelFacts, flops_peak: float, bytes_peak: float) -> list[str]:
    c = result.get("max_concurrency") or result["num_prompts"]
    # fleet bench serve writes the lengths asked for; vllm bench serve the totals sent and received.
    done = result.get("completed") or result["num_prompts"]
    prompt = result.get("random_input_len") or round(result["total_input_tokens"] / done)
    output = result.get("random_output_len") or round(result["total_output_tokens"] / done)
    lines = [f"{result.get('label') or 'run'}: concurrency {c}, {prompt} in / {output} out, "
             f"{result['output_throughput']:.1f} output tok/s"]
    if c == 1:
        flops = facts.prefill_flops(prompt) / (result["median_ttft_ms"] / 1e3)
        lines.append(f"  prefill  {flops / 1e9:8.1f} GFLOP/s = {flops / flops_peak:6.1%} of the compute peak")
    step_s = result["median_tpot_ms"] / 1e3
    step_bytes, step_flops = facts.decode_step(c, prompt + output / 2)
    bandwidth_s, compute_s = step_bytes / bytes_peak, step_flops / flops_peak
    binding = "bandwidth" if bandwidth_s >= compute_s else "compute"
    lines.append(f"  decode   {step_bytes / step_s / 1e9:8.1f} GB/s = {bandwidth_s / step_s:6.1%} of bandwidth, "
                 f"{step_flops / step_s / 1e9:8.1f} GFLOP/s = {compute_s / step_s:6.1%} of compute; "
                 f"{binding} binds: {max(bandwidth_s, compute_s) / step_s:6.1%} of the limit")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-json", nargs="*", default=[],
                        help="`fleet bench serve --result-json` or `vllm bench serve --save-result` files")
    parser.add_argument("--model", default=None, help="the model the runs served (default: the default GGUF)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the dtype the runs used (default: what fleet launch picks on this CPU)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    dtype_name = args.dtype or ("bfloat16" if cpu_computes_bfloat16() else "float32")
    print(f"CPU class {cpu_class().name}, {torch.get_num_threads()} threads, "
          f"torch capability {torch.backends.cpu.get_cpu_capability()}")
    peaks = {name: gemm_flops_per_s(dtype) for name, dtype in DTYPES.items()}
    for name, value in peaks.items():
        print(f"compute peak {name:<9} {value / 1e9:8.1f} GFLOP/s (torch.mm 2048^3)")
    bandwidth = read_bytes_per_s()
    print(f"read bandwidth          {bandwidth / 1e9:8.1f} GB/s (sum over 1 GiB)")
    if not args.result_json:
        return
    facts = ModelFacts(args.model or default_model_path(), DTYPES[dtype_name])
    print(f"model: {facts.weight_bytes / 1e6:.0f} MB of weights as fleet holds them in {dtype_name}"
          + (f" (steps of more than {AMX_BLOCK_ROWS} rows read {facts.amx_copy_bytes_added / 1e6:.0f} MB more: "
             "the bfloat16 copies)" if facts.amx_copy_bytes_added else "")
          + f", {facts.kv_bytes_per_token / 1e3:.1f} kB of KV per token; limits below against the {dtype_name} peak")
    for path in args.result_json:
        with open(path) as f:
            print("\n".join(report_run(json.load(f), facts, peaks[dtype_name], bandwidth)))


if __name__ == "__main__":
    main()
