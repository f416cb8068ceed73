"""The built-in model is the same bytes on every machine and loads through the normal Hugging Face path."""

from __future__ import annotations

import hashlib

import pytest

from app.tiny_model import BUILTIN_SCHEME, TINY_MODEL_NAME, build_tiny_model, resolve_model_source


def _digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_two_builds_are_byte_identical(tmp_path):
    first = build_tiny_model(tmp_path / "a")
    second = build_tiny_model(tmp_path / "b")
    assert first.name == second.name
    digests = _digests(first)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= digests.keys()
    assert digests == _digests(second)


def test_a_finished_build_is_reused(tmp_path):
    first = build_tiny_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_and_chat_template_load(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    directory = build_tiny_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.encode("Hello, the user and the assistant.")
    assert tokenizer.decode(ids) == "Hello, the user and the assistant."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = AutoConfig.from_pretrained(directory)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.vocab_size == len(tokenizer)


def test_model_sources():
    assert resolve_model_source("/models/x") == "/models/x"
    assert resolve_model_source("Qwen/Qwen3-32B") == "Qwen/Qwen3-32B"
    with pytest.raises(ValueError, match="unknown built-in model"):
        resolve_model_source(BUILTIN_SCHEME + "huge")
    assert resolve_model_source(BUILTIN_SCHEME + TINY_MODEL_NAME).endswith(build_tiny_model().name)
