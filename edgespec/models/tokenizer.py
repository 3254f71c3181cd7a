"""A GGUF model's tokenizer built from the file's own metadata, without llama.cpp.

The tokenizer.* keys of a GGUF say everything llama.cpp's tokenizer uses:

    tokenizer.ggml.model        "gpt2" (byte-level BPE) or "llama" (SentencePiece-style BPE over scores)
    tokenizer.ggml.pre          the pre-tokenizer (BPE): the regexes that split text into words
    tokenizer.ggml.tokens       (n_vocab,) token texts
    tokenizer.ggml.token_type   (n_vocab,) 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges       (n_merges,) "left right", by rank (BPE)
    tokenizer.ggml.scores       (n_vocab,) the merge priority of each token (SentencePiece)
    tokenizer.ggml.*_token_id, add_bos_token, add_eos_token, add_space_prefix

Hugging Face ``tokenizers`` runs it (a wheel on every platform): a BPE model
over the same vocabulary and merges (SentencePiece's merges derived from the
scores: the pair making the higher-scored token first), the pre-tokenizer
regexes of llama.cpp for each ``tokenizer.ggml.pre`` name, byte fallback
(``<0xNN>``) for SentencePiece. Special tokens are added tokens: user-defined
ones always split out, control and unknown ones only when special tokens are
parsed, as llama.cpp does; the rules llama.cpp applies by token text (which
tokens end a generation, fill-in-the-middle tokens, control-looking tokens)
are applied here too, so tokens, pieces and special ids are llama.cpp's, token
for token (tests/test_tokenizer.py compares them).

Byte-level BPE under one pre-tokenizer regex (GPT-2's, SmolLM's, Qwen2's,
Llama 3's) splits a text into words in Python's re and keeps each word's
tokens, ``tokenizers`` encoding only the words not seen yet (on the whole
text, most of its time goes to objects it builds for every word). A text
holding a special token's text, or a character whose class re does not spell
as Oniguruma does, goes through ``tokenizers`` whole.

    tok = GGUFTokenizer.load("model.gguf")   # UnknownTokenizerError: a type not known here
    tok.tokenize("text", add_special=True, parse_special=False)
    tok.piece(token)                        # bytes
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import unicodedata
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError, UnsupportedModelError
from ..files import atomic_output
from .gguf import GGUFFile

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe),
# applied one after another, each splitting the pieces the previous left (the
# text between two matches is a piece too).
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
# GPT-2's, ending as tokenizers' ByteLevel does in "|\s+": llama.cpp's leaves
# a whitespace character other than a space before a non-space unmatched (a
# piece alone all the same); "\s+" matches it alone, so that the words findall
# returns cover the text (_tokenize_words).
_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",)
# llama.cpp's "\p{N}" split, then GPT-2's in each piece, as one regex (one
# pass, and one regex to spell in re): every number alone, and a piece's end (a
# number or the text's end) is where GPT-2's (?!\S) holds, hence (?![^\s\p{N}]).
# No other alternative takes a number or looks past its match, so each match
# is the one GPT-2's makes in its piece.
_SMOLLM = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+",)
_CJK = "[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+\z",   # llama.cpp's "\s+$": std::regex's $ is the end of the text, Oniguruma's \z
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")

# tokenizer.ggml.pre -> (regexes, llama.cpp's ignore_merges: a word that is a
# token is that token, add_bos: its default before tokenizer.ggml.add_bos_token)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), (_LLAMA3, True, True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (_LLAMA3, False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2, False, False)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), (_GPT2, False, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
                    (_SMOLLM, False, False)),
    "deepseek-llm": (_DEEPSEEK_LLM, False, False),
    "deepseek-coder": (_DEEPSEEK_CODER, False, False),
}

# Token texts llama.cpp gives a role whatever their type (llama_vocab::impl::load):
# end of generation, and the fill-in-the-middle tokens in order of preference.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["})
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# Texts llama.cpp always renders (gpt-oss): user-defined whatever their type.
ALWAYS_RENDERED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# Model names whose tokens llama.cpp strips spaces around (phi-3), and
# pre-tokenizers it gives a stripping <mask>: not reproduced here.
_STRIPPING_NAMES = ("phi-3", "phi3", "modern-bert")
_STRIPPING_PRES = ("jina-v2-de", "jina-v2-es", "jina-v2-code")

# The GPT-2 byte <-> character map byte-level BPE token texts are written in.
_BYTE_CHARS = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
_CHAR_TO_BYTE = {chr(c): c for c in _BYTE_CHARS}
_CHAR_TO_BYTE.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in _BYTE_CHARS)})

# Oniguruma's classes in the pre-tokenizer regexes as Python's re spells them
# (python_regex), exact where re_spelled() holds: \s is Unicode's White_Space
# (re's \s adds U+001C..U+001F); re's \d is Nd alone and [^\W\d_] is L with Nl
# and No, so no Nl or No, and no character Python's unicodedata leaves
# unassigned (tokenizers' Oniguruma may know it: Unicode 16, Python 3.11's is
# 14). tests/test_tokenizer.py checks every class on every character.
_WHITE_SPACE = r"\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_RE_SPELLING = {
    r"\p{L}": r"[^\W\d_]", r"\p{N}": r"\d", r"\s": f"[{_WHITE_SPACE}]", r"\S": f"[^{_WHITE_SPACE}]",
    r"[^\s\p{N}]": rf"[^\d{_WHITE_SPACE}]", r"[^\s\p{L}\p{N}]": rf"(?:[^\w{_WHITE_SPACE}]|_)",
    r"[^\r\n\p{L}\p{N}]": r"(?:[^\r\n\w]|_)",
}
_NOT_SPELLED = frozenset({"Cn", "Nl", "No"})
# a regex's parts: a class, \p{..}, an escape, one character
_REGEX_PART = re.compile(r"\[\^?(?:\\.|[^\]\\])*\]|\\p\{\w+\}|\\.|.", re.S)
_LITERAL_CLASS = re.compile(r"\[\^?(?:[A-Za-z]|\\[rn])+\]")   # [sS], [\r\n]: the same in both
# Words whose tokens are kept (_tokenize_words): a text's words recur, and a
# few thousand cover most of a language's text; longer words (runs of spaces,
# encoded blobs) seldom do, as tokenizers' own BPE cache reckons.
_WORD_CACHE_SIZE = 1 << 16
_CACHED_WORD_LENGTH = 256

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE = "\u2581"   # SentencePiece's escaped space

# The merges derived from SentencePiece scores, kept between loads (seconds
# of Python over a 262k vocabulary), one file per model file.
MERGES_DIR = "tokenizers"


def python_regex(pattern: str) -> re.Pattern | None:
    """An Oniguruma pre-tokenizer regex in Python's re (alternation, greedy
    quantifiers and lookahead mean the same in both), or None where it has a
    class or escape not spelled here, or a group findall would return."""
    parts = []
    for part in _REGEX_PART.findall(pattern):
        if part in _RE_SPELLING:
            parts.append(_RE_SPELLING[part])
        elif part[0] in "\\[" and not _LITERAL_CLASS.fullmatch(part):
            return None
        else:
            parts.append(part)
    regex = re.compile("".join(parts))
    return regex if regex.groups == 0 else None


def re_spelled(text: str) -> bool:
    """Whether python_regex's classes are Oniguruma's on every character of ``text``."""
    return text.isascii() or all(unicodedata.category(c) not in _NOT_SPELLED for c in set(text) if not c.isascii())


class UnknownTokenizerError(UnsupportedModelError):
    """A tokenizer (tokenizer.ggml.model / .pre) this module does not build;
    llama.cpp may still know it (edgespec.backends.vocab falls back to it)."""


def _need(ok: bool, path, field: str, problem: str) -> None:
    if not ok:
        raise ModelFormatError(f"{path}: {field}: {problem}")


def _strings(f: GGUFFile, key: str) -> list[str] | None:
    """A string array as str (invalid UTF-8 kept as surrogate escapes), read
    whole rather than string by string."""
    raw = f.strings_nul_joined(key)
    if raw is None:
        _need(key not in f, f.path, key, "not an array of strings")
        return None
    n = f.array_length(key)
    out = raw.decode("utf-8", "surrogateescape").split("\0")[:-1] if n else []
    return out if len(out) == n else f.get(key)   # a NUL inside a string: read one by one


def _numbers(f: GGUFFile, key: str, n: int, kind: str) -> np.ndarray | None:
    if key not in f:
        return None
    values = f.get(key)
    _need(isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           for v in values[:1]), f.path, key, f"not an array of {kind}")
    _need(len(values) >= n, f.path, key, f"{len(values)} values for {n} tokens")
    return np.asarray(values[:n])


def _token_id(f: GGUFFile, key: str, n: int, default: int | None) -> int | None:
    """A special token id key; out of range (or absent): the default, as llama.cpp does."""
    value = f.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
        return value
    return default if default is not None and 0 <= default < n else None


class GGUFTokenizer:
    """The tokenizer, token pieces and special tokens of one GGUF file."""

    def __init__(self, path: Path, f: GGUFFile):
        self.path = path
        model = f.get("tokenizer.ggml.model")
        _need(model is not None, path, "tokenizer.ggml.model", "missing")
        pre = f.get("tokenizer.ggml.pre") or "default"
        name = str(f.get("general.name") or "").lower()
        if model == "gpt2" and pre not in PRE_TOKENIZERS:
            raise UnknownTokenizerError(f"{path}: tokenizer.ggml.pre '{pre}' is a pre-tokenizer edgespec "
                                        "does not know")
        if (model not in ("gpt2", "llama") or any(s in name for s in _STRIPPING_NAMES)
                or pre in _STRIPPING_PRES or f.get("tokenizer.ggml.add_sep_token")):
            raise UnknownTokenizerError(f"{path}: tokenizer.ggml.model '{model}' (pre '{pre}') is a tokenizer "
                                        "edgespec does not build")
        self.model, self.pre = model, pre
        texts = _strings(f, "tokenizer.ggml.tokens")
        _need(bool(texts), path, "tokenizer.ggml.tokens", "missing or empty")
        n = self.n_vocab = len(texts)
        # llama.cpp renames an empty token so that every text names one token
        texts = [t or f"[EMPTY_{i}]" for i, t in enumerate(texts)]
        types = _numbers(f, "tokenizer.ggml.token_type", n, "integers")
        if types is None:
            types = np.full(n, NORMAL)
        bad = np.flatnonzero((types < NORMAL) | (types > BYTE))
        if len(bad):
            raise ModelFormatError(f"{path}: tokenizer.ggml.token_type: token {bad[0]} has type "
                                   f"{types[bad[0]]}, outside 1..6")
        self.texts = texts
        self.ids = {t: i for i, t in enumerate(texts)}
        _need(len(self.ids) == n, path, "tokenizer.ggml.tokens", "a token text appears twice")
        spm = model == "llama"
        self.bos = _token_id(f, "tokenizer.ggml.bos_token_id", n, 1 if spm else 11)
        self.eos = _token_id(f, "tokenizer.ggml.eos_token_id", n, 2 if spm else 11)
        self.unk = _token_id(f, "tokenizer.ggml.unknown_token_id", n, 0 if spm else None)
        self.types = types.astype(np.int8)
        self.roles, self.eog = self._roles(f)

        regexes, ignore_merges, add_bos = PRE_TOKENIZERS.get(pre, ((), False, spm))
        self.add_bos = bool(f.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
        _need(not (self.add_bos and self.bos is None), path, "tokenizer.ggml.bos_token_id",
              "BOS is added but the model has none")
        _need(not (self.add_eos and self.eos is None), path, "tokenizer.ggml.eos_token_id",
              "EOS is added but the model has none")
        self.add_space_prefix = spm and bool(f.get("tokenizer.ggml.add_space_prefix", True))
        if spm:
            merges = self._spm_merges(path, f)
        else:
            merges = _strings(f, "tokenizer.ggml.merges")
            _need(merges is not None, path, "tokenizer.ggml.merges", "missing")
            merges = self._split_merges(merges)
        self._build(path, merges, regexes, ignore_merges, spm)
        self._word_ids: dict[str, list[int]] = {}
        self._lock = threading.Lock()   # encode_special_tokens and _word_ids are the tokenizer's state
        self._pieces: dict[int, bytes] = {}   # rendered on first use

    @classmethod
    def load(cls, path: str | os.PathLike) -> "GGUFTokenizer":
        path = Path(path)
        with GGUFFile(path) as f:
            return cls(path, f)

    # -- building ---------------------------------------------------------------

    def _roles(self, f: GGUFFile) -> tuple[dict[str, int | None], frozenset[int]]:
        """The special tokens by role (eot, eom and the FIM roles pre, suf, mid,
        pad, rep, sep) and the end-of-generation set, from the metadata, else
        found by text as llama.cpp finds them; the tokens found by text become
        control tokens (and the gpt-oss ones it always renders user-defined),
        in ``self.types``."""
        n, ids, types = self.n_vocab, self.ids, self.types
        roles = {role: _token_id(f, f"tokenizer.ggml.{role}_token_id", n, None) for role in ("eot", "eom")}
        for role in FIM_TEXTS:
            roles[role] = _token_id(f, f"tokenizer.ggml.fim_{role}_token_id", n, None)
        for role, old in (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle")):
            roles[role] = _token_id(f, f"tokenizer.ggml.{old}_token_id", n, roles[role])
        for role, candidates in {"eot": EOT_TEXTS, "eom": ("<|eom_id|>",), **FIM_TEXTS}.items():
            if roles[role] is None:
                roles[role] = next((ids[t] for t in candidates if t in ids), None)
                if roles[role] is not None:
                    types[roles[role]] = CONTROL
        eog = {roles[r] for r in ("pad", "rep", "sep")} - {None}
        for t in EOG_TEXTS & ids.keys():
            eog.add(ids[t])
            types[ids[t]] = CONTROL
        eog |= {t for t in (self.eos, roles["eot"], roles["eom"]) if t is not None}
        for t in ALWAYS_RENDERED & ids.keys():
            types[ids[t]] = USER_DEFINED
        return roles, frozenset(eog)

    @staticmethod
    def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
        # llama.cpp splits at the first space after the first character
        return [(m[:cut], m[cut + 1:]) for m in merges for cut in (m.find(" ", 1),)]

    def _spm_merges(self, path: Path, f: GGUFFile) -> list[tuple[str, str]]:
        """SentencePiece's merge order as BPE merges: every split of a token
        into two tokens, the pair making the higher-scored token first (llama.cpp
        merges the adjacent pair whose concatenation scores highest). Kept in a
        file as (n_merges, 2) int32 rows (token, characters in its left half):
        deriving them takes seconds of Python on a 262k vocabulary."""
        from . import registry

        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
        cache = registry.home() / MERGES_DIR / f"{path.stem}-{key}.npy"
        try:
            rows = np.load(cache)
        except (OSError, ValueError):
            rows = None
        if rows is None or rows.ndim != 2 or rows.shape[1] != 2:
            scores = _numbers(f, "tokenizer.ggml.scores", self.n_vocab, "numbers")
            rows = self._derive_spm_merges(np.zeros(self.n_vocab) if scores is None else scores)
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                with atomic_output(cache) as tmp, open(tmp, "wb") as out:
                    np.save(out, rows)
            except OSError:
                pass   # a read-only cache: derived again next time
        texts = self.texts
        return [(texts[t][:c], texts[t][c:]) for t, c in rows.tolist()]

    def _derive_spm_merges(self, scores: np.ndarray) -> np.ndarray:
        ids = self.ids
        ranked = []
        for tid, text in enumerate(self.texts):
            for cut in range(1, len(text)):
                if text[:cut] in ids and text[cut:] in ids:
                    ranked.append((-scores[tid], tid, cut))
        ranked.sort()
        return np.array([(t, c) for _, t, c in ranked], dtype=np.int32).reshape(-1, 2)

    def _build(self, path, merges, regexes, ignore_merges, spm) -> None:
        """``self._hf``, tokenizers' tokenizer; for byte-level BPE under one
        regex spelled in re, what _tokenize_words needs beside it: that regex
        (``self._words``), the BPE on one word alone (``self._word_bpe``, the
        same model) and the added tokens' texts, which it leaves to ``self._hf``
        (``self._added``)."""
        from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

        if spm:
            unk = self.texts[self.unk] if self.unk is not None else None
            field, options = "tokenizer.ggml.scores", {"unk_token": unk, "byte_fallback": True}
        else:
            field, options = "tokenizer.ggml.merges", {"ignore_merges": ignore_merges}
        try:
            model = models.BPE(vocab=self.ids, merges=merges, **options)
        except Exception as e:   # a merge naming a text that is no token: tokenizers' one line names it
            raise ModelFormatError(f"{path}: {field}: {str(e).splitlines()[0]}") from None
        tk = Tokenizer(model)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._words = python_regex(regexes[0]) if not spm and len(regexes) == 1 else None
        self._word_bpe = None
        if self._words is not None:
            self._word_bpe = Tokenizer(model)
            self._word_bpe.pre_tokenizer = byte_level
        if spm:
            steps = [normalizers.Prepend(SPACE)] if self.add_space_prefix else []
            tk.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
        else:
            # each digit alone (\p{N}: Nd, Nl, No, as Rust's char::is_numeric):
            # tokenizers' Digits does it in a quarter of the regex's time
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True) if r == r"\p{N}" else
                 pre_tokenizers.Split(Regex(r), "isolated") for r in regexes] + [byte_level])
        # Split out before the model: user-defined tokens always, control and
        # unknown ones only when special tokens are parsed (llama.cpp's
        # tokenizer_st_partition); matched on the text as written.
        added = [AddedToken(self.texts[t], special=bool(self.types[t] != USER_DEFINED), normalized=False)
                 for t in np.flatnonzero(np.isin(self.types, (UNKNOWN, CONTROL, USER_DEFINED)))]
        tk.add_tokens(added)
        texts = sorted({a.content for a in added}, key=len, reverse=True) if self._words else ()
        self._added = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._hf = tk

    # -- tokenizing -------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``. Bytes that were not UTF-8 (lone surrogates, as
        surrogateescape leaves them) become U+FFFD each, as llama.cpp reads them."""
        if not text.isascii():
            text = _LONE_SURROGATE.sub("\ufffd", text)
        with self._lock:
            ids = self._tokenize_words(text)
            if ids is None:
                self._hf.encode_special_tokens = not parse_special
                # the batch call without offsets: half the time of encode()
                ids = self._hf.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special:
            ids = ([self.bos] if self.add_bos else []) + ids + ([self.eos] if self.add_eos else [])
        return ids

    def _tokenize_words(self, text: str) -> list[int] | None:
        """The tokens of ``text`` word by word, byte-level BPE's words being
        independent: the pre-tokenizer's split in Python's re and each word's
        tokens kept, tokenizers encoding only words not seen yet: a third of
        tokenizers' time on a text (its split and encoding build objects for
        every word). None where the split could differ from tokenizers': no
        one regex spelled in re, a special token's text in ``text``, a
        character not re_spelled, words that do not cover the text."""
        if (self._words is None or (self._added is not None and self._added.search(text))
                or not re_spelled(text)):
            return None
        words = self._words.findall(text)
        if sum(map(len, words)) != len(text):
            return None
        cache = self._word_ids
        new = list(set(words).difference(cache))
        if new:
            if len(cache) + len(new) > _WORD_CACHE_SIZE:
                cache.clear()
            encoded = self._word_bpe.encode_batch_fast(new, add_special_tokens=False)
            cache.update(zip(new, (e.ids for e in encoded)))
        ids: list[int] = []
        for word in words:
            ids += cache[word]
        for word in new:
            if len(word) > _CACHED_WORD_LENGTH:
                del cache[word]
        return ids

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token's text; control and unknown tokens render as
        nothing unless ``special`` (llama.cpp's token_to_piece)."""
        if not special and self.types[token] in (CONTROL, UNKNOWN):
            return b""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = self._render(token)
        return cached

    def pieces(self) -> list[bytes]:
        """Every token's bytes as llama.cpp renders it with special tokens shown."""
        return [self.piece(t, special=True) for t in range(self.n_vocab)]

    def _render(self, token: int) -> bytes:
        text, kind = self.texts[token], self.types[token]
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if kind == BYTE:
            m = _BYTE_TOKEN.fullmatch(text)
            if m and self.model == "llama":
                return bytes([int(m.group(1), 16)])
            return bytes([_CHAR_TO_BYTE.get(text, 0)]) if len(text) == 1 else b""
        if kind != NORMAL:
            return b""
        if self.model == "llama":
            return text.replace(SPACE, " ").encode("utf-8", "surrogateescape")
        return bytes(_CHAR_TO_BYTE[c] for c in text if c in _CHAR_TO_BYTE)
