"""The served model's tokenizer, chat template and incremental detokenizer.

Reads the files :mod:`services.worker.model_loader` writes (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja`` or a ``chat_template`` key) with the
``tokenizers`` library and ``jinja2`` directly, so serving does not import transformers. The
chat template is rendered the way transformers renders it (sandboxed Jinja with
``trim_blocks`` and ``lstrip_blocks``) and the text is encoded without adding special tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import ConfigError

if TYPE_CHECKING:
    from jinja2 import Template

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
#: Most characters Unicode normalization (NFC/NFKC) merges into one (Hangul L+V+T jamo).
MAX_NORMALIZATION_SHRINK = 3


class Tokenizer:
    """Encode prompts, render chat messages, decode generated ids.

    Args:
        model_dir: An HF model directory holding ``tokenizer.json`` (and optionally
            ``tokenizer_config.json``, ``chat_template.jinja``, ``config.json``).

    Raises:
        ConfigError: ``tokenizer.json`` is missing or unreadable.
    """

    def __init__(self, model_dir: Path | str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.model_dir = Path(model_dir)
        tok_file = self.model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"{self.model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg: dict[str, object] = {}
        if (self.model_dir / "tokenizer_config.json").is_file():
            cfg = json.loads((self.model_dir / "tokenizer_config.json").read_text("utf-8"))
        self._special = {
            str(cfg[k])
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(cfg.get(k), str)
        }
        template = cfg.get("chat_template")
        if (self.model_dir / "chat_template.jinja").is_file():
            template = (self.model_dir / "chat_template.jinja").read_text("utf-8")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token = cfg.get("bos_token") if isinstance(cfg.get("bos_token"), str) else None
        self.eos_token = cfg.get("eos_token") if isinstance(cfg.get("eos_token"), str) else None

        eos: set[int] = set()
        if isinstance(self.eos_token, str):
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                eos.add(int(tid))
        model_cfg_path = self.model_dir / "config.json"
        if model_cfg_path.is_file():
            mc = json.loads(model_cfg_path.read_text("utf-8"))
            val = mc.get("eos_token_id")
            if isinstance(val, int):
                eos.add(val)
            elif isinstance(val, list):
                eos.update(int(v) for v in val)
        self.eos_token_ids: set[int] = eos
        self._compiled: Template | None = None
        #: Characters in the longest token, added tokens included (81 for SmolLM2).
        self.max_token_chars = max(
            (len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1
        )

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the token count of any text of ``num_chars`` characters, from the
        vocabulary alone (no encoding): ``num_chars // (MAX_NORMALIZATION_SHRINK *
        max_token_chars)``.

        A token covers at most ``max_token_chars`` characters of the normalized text (a
        byte-level BPE token string has one character per byte it covers, a SentencePiece
        one at least one per character, a byte-fallback one six for one byte), and Unicode
        normalization merges at most :data:`MAX_NORMALIZATION_SHRINK` characters into one
        (Hangul jamo into a syllable). It lets the worker refuse a prompt far longer than its
        context before encoding it: encoding holds the interpreter for ~2 s per million
        characters, and a 15 MB prompt's ids took 5 GB.
        """
        return num_chars // (MAX_NORMALIZATION_SHRINK * self.max_token_chars)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (may end in U+FFFD when a multi-byte character is cut)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template applied to ``messages`` as text.

        Raises:
            ConfigError: the model has no chat template.
        """
        if self.chat_template is None:
            raise ConfigError(f"{self.model_dir} has no chat template; send a plain prompt")
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        return str(
            self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template and the generation prompt.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
        """
        return self.encode(self.render_chat(messages, add_generation_prompt=True))

    def detokenizer(self, prompt_ids: list[int] | None = None) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one generated sequence."""
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, one call per new token(s).

    Each call returns only the text that became complete since the previous call; a
    character whose UTF-8 bytes are split over several byte-level tokens is held back until
    its last byte arrives, so no delta ever contains a U+FFFD caused by a split (the offsets
    scheme of vLLM/TGI: decode a short window before and after the new ids and emit the
    difference). :meth:`flush` returns whatever is still held back at the end.

    Args:
        tokenizer: The :class:`Tokenizer`.
        prompt_ids: Optional prompt ids; the last few give decoding context (matters for
            SentencePiece tokenizers that drop a leading space at the start of a decode).
    """

    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        ctx = list(prompt_ids[-self._CONTEXT :]) if prompt_ids else []
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)

    def add(self, new_ids: list[int]) -> str:
        """Append ``new_ids`` and return the newly completed text (possibly ``""``)."""
        self._ids.extend(int(i) for i in new_ids)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character decodes as U+FFFD here)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
