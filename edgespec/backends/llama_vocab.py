"""A GGUF model's tokenizer and metadata through llama.cpp (the llama extra).

The llama backend's own vocabulary (``LlamaVocab(model)``, borrowed from its
loaded model), and edgespec.backends.vocab's fallback for a tokenizer that
edgespec.models.tokenizer does not build: llama.cpp's ``vocab_only`` model,
which skips the weights. Also llama.cpp's process-wide setup (init_llama,
model_params), which the llama backend and the tests' reference share.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path

import llama_cpp.llama_cpp as lc

from ..capi import Closing
from ..errors import ModelFormatError


@lc.llama_log_callback
def _drop_log(level, text, user_data):  # llama.cpp prints nothing unless asked
    pass


@lc.llama_log_callback
def _stderr_log(level, text, user_data):
    os.write(2, text)


_initialized = False


def init_llama(verbose: bool) -> None:
    """Start llama.cpp's backend once per process and route its log."""
    global _initialized
    lc.llama_log_set(_stderr_log if verbose else _drop_log, ctypes.c_void_p(0))
    if not _initialized:
        lc.llama_backend_init()
        _initialized = True


@functools.cache
def _cpu_advertises_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX. A VM can advertise AMX it does not run
    (seen on a Firecracker guest of a Sapphire Rapids host): the first
    `ldtilecfg` in ggml's AMX matmul then kills the process with SIGILL."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def model_params(**fields):
    """llama.cpp's default model parameters with ``fields`` set. Where the CPU
    advertises AMX, without the extra buffer types (ggml's AMX and repacked
    weights, as llama.cpp's --no-repack): a lost speed-up on a true AMX
    machine is better than a crash on a VM that only claims it."""
    params = lc.llama_model_default_params()
    params.use_extra_bufts = not _cpu_advertises_amx()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def tokenize(vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """Token ids of ``text`` under a llama.cpp vocabulary."""
    data = text.encode("utf-8")
    cap = len(data) + 8
    buf = (lc.llama_token * cap)()
    n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:  # a negative count is the size that was needed
        cap = -n
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    return list(buf[:n])


class LlamaVocab(Closing):
    """Tokenizer, token pieces and metadata of one llama.cpp model.

    ``LlamaVocab.load(path)`` owns a vocabulary-only model and frees it on close();
    ``LlamaVocab(model)`` borrows a loaded model, which must outlive it.
    """

    _owned = None  # llama_model loaded by load(), freed by close()
    path: Path | None = None  # the file load() read

    def __init__(self, model):
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    @classmethod
    def load(cls, path: Path, *, verbose: bool = False) -> "LlamaVocab":
        init_llama(verbose)
        model = lc.llama_model_load_from_file(str(path).encode(), model_params(vocab_only=True))
        if not model:
            raise ModelFormatError(f"{path}: llama.cpp could not read this model's vocabulary")
        vocab = cls(model)
        vocab._owned = model
        vocab.path = Path(path)
        return vocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        tokens = tokenize(self._vocab, text, add_special, parse_special)
        bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
        if bad is not None:   # a tokenizer (tokenizer.ggml.model) that does not fit the tokens
            raise ModelFormatError(f"the model's tokenizer gave token id {bad}, outside its vocabulary "
                                   f"[0, {self.n_vocab}): its tokenizer.ggml.model does not fit its tokens")
        return tokens

    def piece(self, token: int) -> bytes:
        """The bytes of one token's text (control tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            n = lc.llama_token_to_piece(self._vocab, token, self._piece_buf, 256, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
                cached = buf.raw[:n]
            else:
                cached = self._piece_buf.raw[:n]
            self._pieces[token] = cached
        return cached

    @property
    def llama_vocab(self):
        """The llama.cpp vocabulary handle; borrowed, valid until close()."""
        return self._vocab

    def token_table(self) -> list[bytes]:
        """Every token's bytes as llguidance takes them: special tokens shown,
        control tokens (and user-defined ones written <like this>) behind a
        0xff byte."""
        buf = ctypes.create_string_buffer(1024)
        table = []
        for t in range(self.n_vocab):
            n = lc.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, True)
            piece = buf.raw[:max(n, 0)]
            attr = lc.llama_vocab_get_attr(self._vocab, t)
            if attr & lc.LLAMA_TOKEN_ATTR_CONTROL or (attr & lc.LLAMA_TOKEN_ATTR_USER_DEFINED
                                                      and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            table.append(piece)
        return table

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(lc.llama_vocab_is_eog(self._vocab, token))
        return eog

    def token_text(self, token: int) -> str:
        """The vocabulary entry as stored (for compatibility checks)."""
        raw = lc.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    @property
    def bos_token(self) -> int:
        return lc.llama_vocab_bos(self._vocab)

    @property
    def adds_bos(self) -> bool:
        """Whether a tokenization with special tokens starts with BOS."""
        return bool(lc.llama_vocab_get_add_bos(self._vocab))

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle) that llama.cpp
        finds in the metadata or by their text (Qwen's <|fim_prefix|>,
        StarCoder's <fim_prefix>, CodeLlama's <PRE>, ...); None when the model
        has no complete set."""
        ids = (lc.llama_vocab_fim_pre(self._vocab), lc.llama_vocab_fim_suf(self._vocab),
               lc.llama_vocab_fim_mid(self._vocab))
        return ids if all(0 <= i < self.n_vocab for i in ids) else None

    @property
    def fim_repo_tokens(self) -> tuple[int | None, int | None]:
        """The repository-level fill-in-the-middle tokens (repository name,
        file separator: Qwen's <|repo_name|>, <|file_sep|>), each None when
        the model has none."""
        ids = (lc.llama_vocab_fim_rep(self._vocab), lc.llama_vocab_fim_sep(self._vocab))
        return tuple(i if 0 <= i < self.n_vocab else None for i in ids)

    @property
    def eos_token(self) -> int:
        return lc.llama_vocab_eos(self._vocab)

    @functools.cached_property
    def special_pattern(self) -> re.Pattern | None:
        """The texts that tokenize as a special token only when special tokens
        are parsed (control and unknown tokens: llama.cpp matches user-defined
        ones always), longest first; None when the vocabulary has none. A
        scan of the vocabulary, once."""
        parsed_only = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
        texts = {self.token_text(t) for t in range(self.n_vocab)
                 if lc.llama_vocab_get_attr(self._vocab, t) & parsed_only}
        texts.discard("")
        if not texts:
            return None
        return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))))

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        if self._owned:
            lc.llama_model_free(self._owned)
            self._owned = None
