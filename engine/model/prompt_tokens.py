"""Prompt tokens without re-tokenizing the whole conversation every turn.

With the prompt cache, a later turn's prefill is a few dozen tokens; what is
left is tokenizing the whole rendered conversation again, which on a long
conversation can cost more than the prefill on a fast GPU
(docs/BENCHMARKS.md, "Why the engine is built as it is"). Hugging
Face tokenizers cut a text at its added tokens (`<|im_start|>`, ...) before
anything else and encode the pieces between them independently, so a chat
prompt's tokens are the concatenation of its pieces' tokens. `PieceEncoder`
keeps each piece's tokens (least recently used out past a character budget):
a conversation's next turn encodes only what is new.

Whether that equality holds depends on the tokenizer (added tokens that strip
whitespace or are normalised break it), so it is checked on the model's own
chat template when the model loads; where it does not hold, the whole text
is encoded as before.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any

log = logging.getLogger("mlxd.engine.core.worker")

MAX_CACHED_CHARS = 16_000_000  # about 16 MB of text: hundreds of long conversations
SELF_CHECK = [  # varied text: spaces, newlines, digits, unicode, an added token's text inside content
    [{"role": "system", "content": "You are terse.\n\n  Tools: {\"a\": 1}\t<end>"},
     {"role": "user", "content": "Hi there!  2026-11-23 — ça va? 12345 "},
     {"role": "assistant", "content": " Fine.\n"}, {"role": "user", "content": "again\n\n"}],
    [{"role": "user", "content": "x" * 300 + " y  \n z"}],
]


def added_tokens(hf_tokenizer: Any) -> list[Any] | None:
    """The tokenizer's added tokens, or None when it does not say."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", None)
    return list(decoder.values()) if isinstance(decoder, dict) else None


def splittable(tokens: list[Any]) -> bool:
    """Whether a text cut at these added tokens encodes piece by piece as a
    whole (pure): none may strip neighbouring whitespace, match single words
    only or be normalised."""
    return all(not (getattr(t, "lstrip", False) or getattr(t, "rstrip", False) or getattr(t, "single_word", False)
                    or getattr(t, "normalized", False)) for t in tokens)


def split_pattern(contents: list[str]) -> re.Pattern[str] | None:
    """A regex that cuts text at these strings, longest first (as the
    tokenizer's own matcher does), keeping them as pieces."""
    contents = sorted({c for c in contents if c}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None


def template_tokens(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                    **template_kwargs: Any) -> list[int]:
    """The chat template's own tokenization of `messages` (the reference)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        **template_kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class PieceEncoder:
    """Encodes rendered prompts piece by piece, keeping each piece's tokens.
    Owned by the worker thread (one per resident model)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        extra = added_tokens(hf)
        self._pattern = split_pattern([t.content for t in extra]) if extra and splittable(extra) else None
        self._ids = {t.content: int(i) for i, t in hf.added_tokens_decoder.items()} if self._pattern else {}
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.enabled = self._pattern is not None and self._self_check()
        if not self.enabled:
            log.info("prompt tokens: this tokenizer is encoded whole every time")

    def encode(self, text: str) -> list[int]:
        """`text`'s tokens (no special tokens added), as encoding it whole gives."""
        if not self.enabled:
            return self._encode_whole(text)
        out: list[int] = []
        for piece in self._pattern.split(text):  # type: ignore[union-attr]
            if not piece:
                continue
            special = self._ids.get(piece)
            out.extend([special] if special is not None else self._piece(piece))
        return out

    def _piece(self, piece: str) -> list[int]:
        tokens = self._pieces.get(piece)
        if tokens is not None:
            self._pieces.move_to_end(piece)
            return tokens
        tokens = self._encode_whole(piece)
        self._pieces[piece] = tokens
        self._chars += len(piece)
        while self._chars > MAX_CACHED_CHARS and len(self._pieces) > 1:
            old, _ = self._pieces.popitem(last=False)
            self._chars -= len(old)
        return tokens

    def _encode_whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _self_check(self) -> bool:
        """Piece by piece == the template's own tokenization, on this model's chat template."""
        try:
            self.enabled = True
            for messages in SELF_CHECK:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                if self.encode(text) != template_tokens(self.tokenizer, messages):
                    return False
            return True
        except Exception:  # noqa: BLE001 - no template, or one that rejects the sample: encode whole
            return False
        finally:
            self._pieces.clear()
            self._chars = 0


def generation_prompt_length(tokenizer: Any) -> int:
    """Tokens the chat template adds to open the answer (`<|im_start|>assistant\n`,
    and a reasoning template's `<think>`): the part of a prompt that history
    renders differently. 0 where the template does not say."""
    sample = [{"role": "user", "content": "Hi"}]
    try:
        opened = template_tokens(tokenizer, sample)
        plain = tokenizer.apply_chat_template(sample, add_generation_prompt=False, tokenize=True)
        plain = list(plain["input_ids"] if hasattr(plain, "keys") else plain)
    except Exception:  # noqa: BLE001 - no template, or one that rejects the sample
        return 0
    return max(len(opened) - len(plain), 0) if opened[:len(plain)] == plain else 0


def answer_echo(tokenizer: Any, generated: list[int], n: int = 4) -> tuple[int, ...]:
    """The first `n` tokens of an answer as the next turn's prompt will hold
    them: the client sends back its text, which re-encodes to other tokens
    where the model wrote, say, half a character."""
    if not generated:
        return ()
    try:
        text = tokenizer.decode(generated[:4 * n])
        return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False)[:n])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot: the generated tokens themselves
        return tuple(int(t) for t in generated[:n])
