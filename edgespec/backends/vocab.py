"""A GGUF model's tokenizer and metadata, shared by every backend.

``Vocab.load(path)`` builds the tokenizer from the file's own metadata
(edgespec.models.tokenizer: no llama.cpp), so every backend (native, onnx,
llama) and every tool that only tokenizes (``edgespec drafter ngram``) uses
the same tokenizer, token for token llama.cpp's. A tokenizer type it does not
build is llama.cpp's ``vocab_only`` model when llama-cpp-python is installed
(the llama extra: edgespec.backends.llama_vocab), else one line naming the
type and the extra.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from ..capi import Closing
from ..errors import UnsupportedModelError
from ..models.gguf import GGUFFile
from ..models.tokenizer import CONTROL, UNKNOWN, USER_DEFINED, GGUFTokenizer, UnknownTokenizerError

LLAMA_EXTRA = "pip install 'edgespec[llama]'"


def _meta_text(value) -> str:
    """A metadata value as llama.cpp's llama_model_meta_val_str writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:f}"
    if isinstance(value, list):
        return "[" + ", ".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' if isinstance(v, str)
                               else "???" if isinstance(v, list) else _meta_text(v) for v in value) + "]"
    return str(value)


class Vocab(Closing):
    """Tokenizer, token pieces and metadata of one GGUF file."""

    def __init__(self, path: Path, tokenizer: GGUFTokenizer, metadata: dict[str, object], arrays: set[str]):
        self.path = path
        self._tok = tokenizer
        self._metadata = metadata      # every scalar key's value
        self._arrays = arrays          # the array keys, read from the file when asked
        self.n_vocab = tokenizer.n_vocab

    @classmethod
    def load(cls, path: Path, *, verbose: bool = False):
        """The vocabulary of ``path``: a Vocab, or llama.cpp's (LlamaVocab, the
        same interface) for a tokenizer edgespec.models.tokenizer does not
        build. UnsupportedModelError naming the type and the extra when
        llama-cpp-python is not installed."""
        path = Path(path)
        with GGUFFile(path) as f:
            try:
                tokenizer = GGUFTokenizer(path, f)
            except UnknownTokenizerError as e:
                try:
                    from .llama_vocab import LlamaVocab
                except ImportError:
                    raise UnsupportedModelError(f"{e}; {LLAMA_EXTRA} brings llama.cpp's tokenizer") from None
                return LlamaVocab.load(path, verbose=verbose)
            metadata, arrays = {}, set()
            for key in f.keys():
                if f.array_length(key) is None:
                    metadata[key] = f.get(key)
                else:
                    arrays.add(key)
        return cls(path, tokenizer, metadata, arrays)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self._tok.tokenize(text, add_special=add_special, parse_special=parse_special)

    def piece(self, token: int) -> bytes:
        """The bytes of one token's text (control tokens render as nothing)."""
        return self._tok.piece(token)

    def token_table(self) -> list[bytes]:
        """Every token's bytes as llguidance takes them: special tokens shown,
        control tokens (and user-defined ones written <like this>) behind a
        0xff byte, as llguidance's own llama.cpp loader marks them."""
        types, pieces = self._tok.types, self._tok.pieces()
        return [b"\xff" + p if types[t] == CONTROL or (types[t] == USER_DEFINED and p[:1] == b"<"
                                                       and p[-1:] == b">") else p
                for t, p in enumerate(pieces)]

    def is_eog(self, token: int) -> bool:
        return token in self._tok.eog

    def token_text(self, token: int) -> str:
        """The vocabulary entry as stored (for compatibility checks)."""
        return self._tok.texts[token].encode("utf-8", "surrogateescape").decode("utf-8", "replace")

    @property
    def bos_token(self) -> int:
        return -1 if self._tok.bos is None else self._tok.bos

    @property
    def eos_token(self) -> int:
        return -1 if self._tok.eos is None else self._tok.eos

    @property
    def adds_bos(self) -> bool:
        """Whether a tokenization with special tokens starts with BOS."""
        return self._tok.add_bos

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle), from the
        metadata or found by their text as llama.cpp finds them (Qwen's
        <|fim_prefix|>, StarCoder's <fim_prefix>, CodeLlama's <PRE>, ...);
        None when the model has no complete set."""
        ids = tuple(self._tok.roles[r] for r in ("pre", "suf", "mid"))
        return None if None in ids else ids

    @property
    def fim_repo_tokens(self) -> tuple[int | None, int | None]:
        """The repository-level fill-in-the-middle tokens (repository name,
        file separator: Qwen's <|repo_name|>, <|file_sep|>), each None when
        the model has none."""
        return self._tok.roles["rep"], self._tok.roles["sep"]

    @functools.cached_property
    def special_pattern(self) -> re.Pattern | None:
        """The texts that tokenize as a special token only when special tokens
        are parsed (control and unknown tokens: user-defined ones are matched
        always), longest first; None when the vocabulary has none."""
        types, texts = self._tok.types, self._tok.texts
        found = {texts[t] for t in range(self.n_vocab) if types[t] in (CONTROL, UNKNOWN)}
        if not found:
            return None
        return re.compile("|".join(map(re.escape, sorted(found, key=len, reverse=True))))

    def metadata(self, key: str) -> str | None:
        if key in self._metadata:
            return _meta_text(self._metadata[key])
        if key in self._arrays:
            with GGUFFile(self.path) as f:
                return _meta_text(f.get(key))
        return None

    def close(self) -> None:
        pass   # nothing held: the file was read whole at load


class VocabMixin:
    """The vocabulary half of the Backend protocol, delegated to ``self.vocab``."""

    vocab: Vocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def piece(self, token: int) -> bytes:
        return self.vocab.piece(token)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)

    def token_text(self, token: int) -> str:
        return self.vocab.token_text(token)

    def metadata(self, key: str) -> str | None:
        return self.vocab.metadata(key)

    @property
    def bos_token(self) -> int:
        return self.vocab.bos_token

    @property
    def adds_bos(self) -> bool:
        return self.vocab.adds_bos

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        return self.vocab.fim_tokens

    @property
    def fim_repo_tokens(self) -> tuple[int | None, int | None]:
        return self.vocab.fim_repo_tokens

    @property
    def eos_token(self) -> int:
        return self.vocab.eos_token

    @property
    def special_pattern(self) -> re.Pattern | None:
        return self.vocab.special_pattern
