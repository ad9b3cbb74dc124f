"""Tiny random-weight models written by transformers, for tests and fixtures.

Each model directory holds config.json, model.safetensors (float32) and a
tiny byte-level BPE tokenizer (vocabulary 512, ids 0/1/2 = <unk>/<s>/</s>,
with a chat template), so it serves end-to-end tests as well as model tests.

Weights are drawn with a larger spread than HF's default init (and biases
and norm weights are randomised too), so attention is far from uniform,
every parameter matters, and greedy choices are not near-ties.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)

MOE_DIMS = dict(num_experts_per_tok=2, intermediate_size=64, router_jitter_noise=0.0)
"""8 experts (so expert parallel splits them over up to 8 ranks), 2 per token."""

MODEL_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

def _corpus() -> list[str]:
    # Seeded pseudo-words: enough distinct pairs for the BPE to reach the full vocabulary.
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(400)]
    sentences = [" ".join(rng.choices(words, k=12)).capitalize() + rng.choice(".!?") for _ in range(300)]
    return sentences + ["0123456789 + - * / = ( ) [ ] { } < > # @ & % $ ! ? : ; , ."]


def write_tiny_model(directory: Path, model_type: str, seed: int, dtype: torch.dtype = torch.float32,
                     attention_output_scale: float = 1.0, **overrides) -> Path:
    """Save a seeded random model of `model_type` in `dtype`. attention_output_scale < 1 weakens what
    attention adds to the residual stream: at 0.01 the next token depends mostly on the current one, so
    greedy decoding soon cycles (a text that repeats, as speculative decoding's drafts need), yet
    still on the context, so a wrong key or value still shows in the logits."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in MODEL_CLASSES[model_type])
    config = config_class(**{**TINY_DIMS, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    _randomise_biases_and_norms(model, seed)
    if attention_output_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(attention_output_scale)
    model.to(dtype).save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


def write_tiny_gemma3_multimodal(directory: Path, seed: int, **text_overrides) -> Path:
    """A seeded random Gemma3ForConditionalGeneration: the tiny text model of TINY_DIMS plus a one-layer
    vision tower (whose weights fleet skips)."""
    import transformers

    text = {**TINY_DIMS, **text_overrides}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    _randomise_biases_and_norms(model, seed)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


def _randomise_biases_and_norms(model: torch.nn.Module, seed: int) -> None:
    # HF initialises biases to 0 and norm weights to 1, which would hide a
    # bias or norm weight that is loaded wrongly (or not at all).
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.2)


def write_tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE trained on a fixed corpus, vocabulary TINY_DIMS["vocab_size"]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_DIMS["vocab_size"],
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(directory)
