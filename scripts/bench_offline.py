"""Offline throughput: fleet.LLM against transformers' batched `generate`.

64 prompts of 256 random tokens, 128 output tokens each (ignore_eos), on the
default model (SmolLM2-135M-Instruct) unless --model says otherwise.

    python scripts/bench_offline.py [--num-prompts 64] [--tp 1] [--pp 1] [--skip-transformers]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def bench_fleet(args, prompts: list[list[int]]) -> float:
    import fleet

    llm = fleet.LLM(
        args.model,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        max_num_seqs=max(args.num_prompts, 1),
    )
    params = fleet.SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return produced / elapsed


@torch.inference_mode()
def bench_transformers(args, prompts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    from fleet.config.model_files import default_model_path, is_default_model

    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if is_default_model(args.model):
        model = dense_model_from_gguf(default_model_path(), dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    input_ids = torch.tensor(prompts)  # all prompts have the same length: no padding
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    model.generate(input_ids[:2, :16], attention_mask=torch.ones_like(input_ids[:2, :16]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return produced / elapsed


def dense_model_from_gguf(path: str, dtype: torch.dtype):
    """transformers 5 keeps GGUF weights packed and computes with dequantising
    kernels; the fair baseline is the same weights as a plain dense model
    (what shared/bench/convert_gguf_to_hf.py writes), so copy them into one."""
    import copy

    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    packed = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    config = copy.deepcopy(packed.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    dense = LlamaForCausalLM(config)
    dense.load_state_dict({k: v.detach().float() for k, v in packed.state_dict().items()})
    return dense.to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    prompts = random_prompts(args.num_prompts, args.input_len, vocab=49152)
    fleet_tps = bench_fleet(args, prompts)
    print(f"fleet        {fleet_tps:8.1f} output tok/s  (tp={args.tp} pp={args.pp}, {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out)")
    if not args.skip_transformers:
        hf_tps = bench_transformers(args, prompts)
        print(f"transformers {hf_tps:8.1f} output tok/s  (one batched generate)")
        print(f"ratio        {fleet_tps / hf_tps:8.2f}x")


if __name__ == "__main__":
    main()
