"""Tokenizers for the training recipes.

    ByteTokenizer: offline, no files. ids 0..255 are UTF-8 bytes, bos_id = 256, eos_id = 257.
    HFTokenizer:   a HuggingFace ``tokenizers`` tokenizer.json (bos_id / eos_id inferred).

Both expose:
    bos_id, eos_id: int | None
    get_vocab_size() -> int
    encode(text, add_bos=False, add_eos=False) -> list[int]
    encode_to_array(text) -> int32 array of shape (L,), no special tokens
    encode_batch_to_arrays(texts) -> list of int32 arrays, one per text, no special tokens
    decode(ids) -> str (special tokens skipped)

``build_tokenizer(path)`` picks one from a config value: None, "" or "bytes" -> ByteTokenizer;
a directory holding tokenizer.json, or a path to a .json file -> HFTokenizer.
"""

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from components.errors import UserError

_EXPECTED = 'expected a directory with tokenizer.json, a tokenizer .json file, or "bytes"'

# Fallbacks when no tokenizer_config.json names the special tokens (first match wins).
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS (vocab 258)."""

    bos_id = 256
    eos_id = 257

    def get_vocab_size(self) -> int:
        return 258

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_to_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch_to_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_to_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer loaded from a tokenizer.json file."""

    def __init__(self, path: str):
        """``path``: a directory holding tokenizer.json, or the path of a tokenizer .json file."""
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise UserError(f"tokenizer {path!r} needs the 'tokenizers' package: pip install tokenizers") from e

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            reason = " ".join(str(e).split())[:200]
            raise UserError(f"tokenizer {file!r} could not be parsed: {reason} ({_EXPECTED})") from e
        self.path = file
        self.bos_id, self.eos_id = self._special_ids(os.path.dirname(os.path.abspath(file)))

    def _special_ids(self, directory: str) -> tuple[int | None, int | None]:
        """bos/eos from tokenizer_config.json next to tokenizer.json, else from common token names."""
        named = {}
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_file):
            try:
                with open(config_file, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError):
                config = {}
            for key in ("bos_token", "eos_token"):
                token = config.get(key) if isinstance(config, dict) else None
                if isinstance(token, dict):
                    token = token.get("content")
                if isinstance(token, str):
                    named[key] = self._tok.token_to_id(token)

        def pick(key: str, candidates: tuple[str, ...]) -> int | None:
            if named.get(key) is not None:
                return named[key]
            for token in candidates:
                if (i := self._tok.token_to_id(token)) is not None:
                    return i
            return None

        return pick("bos_token", _BOS_CANDIDATES), pick("eos_token", _EOS_CANDIDATES)

    def get_vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_to_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch_to_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """None, "" or "bytes" -> ByteTokenizer; a dir with tokenizer.json or a .json file -> HFTokenizer."""
    if path is None or path == "" or path == "bytes":
        return ByteTokenizer()
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded) and os.path.isfile(os.path.join(expanded, "tokenizer.json")):
        return HFTokenizer(expanded)
    if os.path.isfile(expanded) and expanded.endswith(".json"):
        return HFTokenizer(expanded)
    raise UserError(f"tokenizer not found: {path!r} ({_EXPECTED})")
