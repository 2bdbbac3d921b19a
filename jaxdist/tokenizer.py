"""Text ↔ token ids: a Hugging Face `tokenizer.json` (the `tokenizers` library), or bytes.

A run's tokenizer is the `tokenizer.json` in its folder (an imported Hugging Face model brings its
own); without one, text is its UTF-8 bytes (ids 0-255), as the byte-level data sources feed it.
"""

from __future__ import annotations

import os

from jaxdist.errors import ConfigError


class Bytes:
    """UTF-8 bytes as tokens; no special tokens."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int | None:
        """No special tokens: always None."""
        return None


class HFTokenizer:
    """A `tokenizer.json`: its own normaliser, pre-tokeniser, model and post-processor (which adds
    a BOS token where the model was trained with one)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f"{path} needs the tokenizers library: pip install -e '.[hf]'"
            ) from None
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library's own error type for a malformed file
            raise ConfigError(f"{path}: not a readable tokenizer.json ({e})") from None
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens`: run the post-processor (a BOS, say)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of `token` (e.g. "</s>"), or None when the vocabulary lacks it."""
        return self._tok.token_to_id(token)


def load(path: str | None) -> Bytes | HFTokenizer:
    """The tokenizer in `path` (a tokenizer.json), or bytes when `path` is None."""
    if path is None:
        return Bytes()
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such tokenizer file")
    return HFTokenizer(path)
