"""The built-in models: small Qwen3s with seeded weights and a locally trained BPE tokenizer.

No model hub is reachable from our CI machines, so the default configuration points at a model the project
builds itself. Every input (corpus, seed, architecture) is fixed, so every machine builds the same bytes; the
cache directory name carries a hash of the recipe, so changing the recipe never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

BUILTIN_SCHEME = "builtin://"
TINY_MODEL_NAME = "tiny-qwen3"
KV_HEAVY_MODEL_NAME = "kv-heavy-qwen3"

TINY_ARCHITECTURE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    # Wider than the usual 0.02 so that logits are peaked: greedy choices then do not hinge on rounding noise.
    "initializer_range": 0.08,
}
# KV-heavy: more KV per token, so that moving it weighs on TTFT here about as it does for Qwen3-32B on GPUs (there,
# moving a token's 256 KiB over EFA takes a few percent of the time to prefill it). KV per prompt token is 2 (K, V)
# x layers x KV heads x head_dim x 4 bytes (float32): 32 KiB, 8x the tiny model's 4 KiB. Full multi-head attention
# (as many KV heads as query heads) and a narrow MLP put the compute into producing and attending over K and V; on
# this CPU prefill costs about 3x the tiny model's. bench/results/kv-heavy/ has the measured weight.
KV_HEAVY_ARCHITECTURE = {
    **TINY_ARCHITECTURE,
    "intermediate_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
}
ARCHITECTURES = {TINY_MODEL_NAME: TINY_ARCHITECTURE, KV_HEAVY_MODEL_NAME: KV_HEAVY_ARCHITECTURE}
SEED = 20261202
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RECIPE_VERSION = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("PD_SERVE_CACHE", Path.home() / ".cache" / "pd-serve"))


def recipe_digest(name: str = TINY_MODEL_NAME) -> str:
    recipe = {"arch": ARCHITECTURES[name], "seed": SEED, "special": SPECIAL_TOKENS, "chat": CHAT_TEMPLATE, "v": RECIPE_VERSION}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def corpus_lines(num_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-English: words made from a fixed syllable set, plus digits and punctuation."""
    rng = random.Random(SEED)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(1500)]
    words += ["the", "of", "and", "to", "in", "is", "a", "that", "for", "it", "user", "assistant", "system"]
    lines = []
    for _ in range(num_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
        lines.append(f"{sentence.capitalize()}{rng.choice('.,;:!?')} {rng.randint(0, 9999)}")
    return lines


def _build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_ARCHITECTURE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _build_weights(out_dir: Path, architecture: dict) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    config = Qwen3Config(
        **architecture,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)


def build_tiny_model(cache_dir: Path | None = None, name: str = TINY_MODEL_NAME) -> Path:
    """Return the directory of built-in model `name`, building it once into the cache. Safe against concurrent
    builders."""
    target = (cache_dir or default_cache_dir()) / f"{name}-{recipe_digest(name)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build_tokenizer(staging)
        _build_weights(staging, ARCHITECTURES[name])
        try:
            staging.rename(target)  # atomic: a concurrent builder either wins or finds the finished model
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_source(source: str) -> str:
    """Map `builtin://tiny-qwen3` to its built directory; any other source (path or hub id) passes through."""
    if not source.startswith(BUILTIN_SCHEME):
        return source
    name = source[len(BUILTIN_SCHEME):]
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown built-in model {name!r}; the built-in ones are {list(ARCHITECTURES)}")
    return str(build_tiny_model(name=name))


if __name__ == "__main__":
    for model in ARCHITECTURES:
        print(build_tiny_model(name=model))
