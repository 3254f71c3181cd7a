"""The tokenizer built from a GGUF's metadata (edgespec.models.tokenizer, through
edgespec.backends.vocab) against llama.cpp's (backends/llama_vocab.py), token
for token: on the generated tiny vocabulary (fast tier) and on every built-in
model over a corpus of ~60 languages, code, emoji, special tokens and odd
whitespace (models tier)."""
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import gguf
import llguidance as llg
import pytest

from edgespec.backends.llama_vocab import LlamaVocab
from edgespec.backends.vocab import Vocab
from edgespec.errors import ModelFormatError, UnsupportedModelError
from edgespec.grammar import tokenizer_for
from edgespec.models import registry
from edgespec.models.tokenizer import GGUFTokenizer, python_regex, re_spelled
from tiny_gguf import _tokenizer_fields, _write_out, write_tiny_qwen3moe, write_tiny_vocab

MIXED = [
    "", " ", "Hello, world: 42 caf\u00e9!", "def f(x):\n\treturn  x  \r\n\n\n    # odd   spacing\t\t \n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<|im_start|<|im_end|>>", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<start_of_turn>user\n<bos><eos><unused3>[multimodal]<mask><0x41>", "日本語のテキスト、中文。한국어 Ελληνικά русский العربية हिन्दी ไทย",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 \u200b\u00a0x\u3000y", "don't I'LL we've THEY'RE it's", "1234567890" * 20, "3.14159e-10 0x1F 1_000_000",
    "a" * 500, " " * 300 + "x", "\n" * 40 + "y", "\t" * 33, "x\u0301\u0302 \ufeff \U0001F600\U0001F601", "<0xE2><0x96>",
    "bad bytes: \udce2\udc82 \udcff", "<|im_end", "</s><s>", "  <|im_end|>  ",
    # spaces before numbers (smollm's one regex), numbers outside Nd, letters
    # and numbers of Unicode 16, controls Python's \s takes for spaces, "_"
    "a  1  b \t2\n3 \n x\u00a05\u30001 12 345 6789 ", "x\u00b2 \u00bd \u216b \u2460 9",
    "\U000105c0\U00010d40 9 \u0e5f", "\x1c\x1f a\x1cb \x1c 1 \x1f\x1f 2", "foo_bar __init__ a_1 _9 ._",
    "it's 'S 'll 're 9's", "tab\tx\n\tx\r\ny  \n  z\u2028q\x85r",
]


def _same(new, old, texts):
    # Bytes that are not UTF-8 become U+FFFD each: llama.cpp's byte-level BPE
    # does the same; its SentencePiece tokenizer cuts such bytes into byte
    # tokens by their lead byte's length, swallowing what follows (not
    # reproduced: there U+FFFD's tokens are what the test asks).
    spm = new.metadata("tokenizer.ggml.model") == "llama"
    for text in texts:
        if spm and _has_surrogate(text):
            fffd = new.tokenize("\ufffd", add_special=False)
            assert new.tokenize("\udcff", add_special=False) == fffd
            continue
        for add_special in (True, False):
            for parse_special in (True, False):
                got = new.tokenize(text, add_special=add_special, parse_special=parse_special)
                want = _llama_tokens(old, text, add_special, parse_special)
                assert got == want, (text[:60], add_special, parse_special)


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _llama_tokens(old, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokens of ``text``'s bytes (a lone surrogate: the byte that
    was not UTF-8, as surrogateescape wrote it)."""
    import llama_cpp.llama_cpp as lc

    raw = text.encode("utf-8", "surrogateescape")
    buf = (lc.llama_token * (len(raw) + 8))()
    n = lc.llama_tokenize(old.llama_vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
    return list(buf[:n])


def _compare_vocabularies(path: Path, texts):
    with Vocab.load(path) as new, LlamaVocab.load(path) as old:
        assert isinstance(new, Vocab) and new.n_vocab == old.n_vocab
        _same(new, old, texts)
        for t in range(new.n_vocab):
            assert new.piece(t) == old.piece(t), t
            assert new.is_eog(t) == old.is_eog(t), t
        assert new.token_table() == old.token_table()
        assert (new.bos_token, new.eos_token, new.adds_bos) == (old.bos_token, old.eos_token, old.adds_bos)
        assert new.fim_tokens == old.fim_tokens and new.fim_repo_tokens == old.fim_repo_tokens
        assert new.special_pattern.pattern == old.special_pattern.pattern
        for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template",
                    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"):
            assert new.metadata(key) == old.metadata(key), key
        # detokenizing gives the text back (control tokens render as nothing)
        for text in texts:
            if not _has_surrogate(text):
                pieces = b"".join(new.piece(t) for t in new.tokenize(text, add_special=False))
                assert pieces.decode("utf-8") == text


# -- fast tier: the generated vocabulary ----------------------------------------


def test_tiny_vocab_is_llama_cpps_token_for_token(tiny_vocab_path, tmp_path):
    _compare_vocabularies(tiny_vocab_path, MIXED)
    fim = tmp_path / "fim.gguf"
    write_tiny_vocab(fim, fim=True)
    _compare_vocabularies(fim, MIXED)


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama3"])
def test_one_regex_pre_tokenizers_are_llama_cpps_token_for_token(tiny_vocab_path, tmp_path, pre):
    """The pre-tokenizers whose regex tokenize() runs in Python's re (the tiny
    vocabulary's own, gpt-2, above)."""
    path = _rewrite(tiny_vocab_path, tmp_path / f"{pre}.gguf",
                    **{"tokenizer.ggml.pre": (pre, gguf.GGUFValueType.STRING, None)})
    _compare_vocabularies(path, MIXED)


def test_re_spelling_is_oniguruma_s_on_every_character():
    """Each class of the pre-tokenizer regexes as python_regex spells it
    matches what tokenizers' Oniguruma matches, on every character re_spelled
    lets through (a newer Python's Unicode, or an older tokenizers', shows here)."""
    from tokenizers import Regex, pre_tokenizers

    chars = "".join(c for c in map(chr, range(0x110000)) if not 0xD800 <= ord(c) < 0xE000 and re_spelled(c))
    for onig in (r"\p{L}", r"\p{N}", r"\s", r"\S", r"[^\s\p{N}]", r"[^\s\p{L}\p{N}]", r"[^\r\n\p{L}\p{N}]"):
        unmatched = pre_tokenizers.Split(Regex(onig), "removed").pre_tokenize_str(chars)
        want = set(chars) - set("".join(piece for piece, _ in unmatched))
        assert set(python_regex(onig).findall(chars)) == want, onig


def test_special_tokens_are_parsed_only_when_asked(tiny_vocab_path):
    with Vocab.load(tiny_vocab_path) as v:
        end = v.tokenize("<|im_end|>", add_special=False, parse_special=True)
        assert end == [v.eos_token] and v.is_eog(end[0])
        plain = v.tokenize("<|im_end|>", add_special=False, parse_special=False)
        assert v.eos_token not in plain and len(plain) > 1
        assert b"".join(v.piece(t) for t in plain) == b"<|im_end|>"
        assert v.piece(v.eos_token) == b""   # a control token renders as nothing


def test_llguidance_sees_the_same_table(tiny_vocab_path):
    """llguidance's tokenizer built from the GGUF data equals the one built on
    llama.cpp's vocabulary: every token's bytes and specialness."""
    import ctypes

    import llama_cpp as lc

    class Backend:
        vocab = Vocab.load(tiny_vocab_path)
        n_vocab = vocab.n_vocab
        is_eog = vocab.is_eog
        eos_token = vocab.eos_token

    new = tokenizer_for(Backend)
    with LlamaVocab.load(tiny_vocab_path) as old_vocab:
        eog = [t for t in range(old_vocab.n_vocab) if old_vocab.is_eog(t)]
        fptr = ctypes.cast(lc.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        old = llg.LLTokenizer.from_llamacpp(tokens=old_vocab.token_table(), vocab_ptr=old_vocab._vocab,
                                            tokenize_fptr=fptr, eos_token=eog, slices=None)
        for t in range(Backend.n_vocab):
            assert new.is_special_token(t) == old.is_special_token(t), t
            assert new.decode_bytes([t]) == old.decode_bytes([t]), t
        assert new.tokenize_str("Hello <|im_end|> world") == old.tokenize_str("Hello <|im_end|> world")


def test_a_megabyte_of_one_character_or_bad_bytes_is_linear(tiny_vocab_path):
    """1 MB of one letter, of spaces, of bytes that are not UTF-8: each within
    a bound a quadratic tokenizer would not meet (100 kB first: the ratio)."""
    with Vocab.load(tiny_vocab_path) as v:
        for unit in ("a", " ", "\udcff", "<|im_end|>"):
            small, big = unit * (100_000 // len(unit)), unit * (1_000_000 // len(unit))
            start = time.process_time()
            v.tokenize(small, parse_special=True)
            t_small = time.process_time() - start
            start = time.process_time()
            tokens = v.tokenize(big, parse_special=True)
            t_big = time.process_time() - start
            assert tokens and t_big < 30 * max(t_small, 0.01), (unit, t_small, t_big)


def _rewrite(source: Path, path: Path, **fields) -> Path:
    """The tokenizer-only GGUF ``source`` with tokenizer keys replaced:
    key=(value, gguf type, array element type)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value, kind, sub_type in _tokenizer_fields(str(source))[0]:
        writer.add_key_value(key, *fields.get(key, (value, kind, sub_type)))
    _write_out(writer)
    return path


@pytest.mark.parametrize("field,value,problem", [
    ("tokenizer.ggml.merges", (["Ġ t", "zz qq"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
     "Token `zz` out of vocabulary"),
    ("tokenizer.ggml.token_type", None, "outside 1..6"),
    ("tokenizer.ggml.pre", ("nobody-knows", gguf.GGUFValueType.STRING, None), "'nobody-knows'"),
])
def test_malformed_tokenizer_metadata_is_one_line_naming_the_field(tiny_vocab_path, tmp_path, field, value, problem,
                                                                    monkeypatch):
    if value is None:   # a token type out of range
        tok = GGUFTokenizer.load(tiny_vocab_path)
        value = ([*tok.types.tolist()[:-1], 9], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    path = _rewrite(tiny_vocab_path, tmp_path / "bad.gguf", **{field: value})
    with pytest.raises(ModelFormatError) as e:
        _load_without_llama(path, monkeypatch)
    message = str(e.value)
    assert "\n" not in message and field in message and problem in message


def _load_without_llama(path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "edgespec.backends.llama_vocab", None)   # import fails: the extra is missing
    return Vocab.load(path)


def test_unknown_type_falls_back_to_llama_cpp_when_installed(tiny_vocab_path, tmp_path):
    """A pre-tokenizer llama.cpp knows and this module does not build ("falcon")."""
    path = _rewrite(tiny_vocab_path, tmp_path / "falcon.gguf",
                    **{"tokenizer.ggml.pre": ("falcon", gguf.GGUFValueType.STRING, None)})
    with Vocab.load(path) as v:
        assert isinstance(v, LlamaVocab)
        assert v.tokenize("Hello", add_special=False)


def test_unknown_type_without_llama_names_type_and_extra(tiny_vocab_path, tmp_path, monkeypatch):
    path = _rewrite(tiny_vocab_path, tmp_path / "falcon.gguf",
                    **{"tokenizer.ggml.pre": ("falcon", gguf.GGUFValueType.STRING, None)})
    with pytest.raises(UnsupportedModelError) as e:
        _load_without_llama(path, monkeypatch)
    message = str(e.value)
    assert "\n" not in message and "'falcon'" in message and "edgespec[llama]" in message


# -- models tier: every built-in model over a large varied text ---------------------


def _corpus() -> list[str]:
    """~60 languages of dataset-build (a few kB of each), the bench suites'
    prompts (code, chat, edits, several languages) and MIXED."""
    from edgespec.training.corpus import dataset_build_wheel

    texts = list(MIXED)
    with zipfile.ZipFile(dataset_build_wheel(progress=False)) as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".txt")):
            texts.append(z.read(name).decode("utf-8")[:4000])
    suites = Path(__file__).parent.parent / "edgespec" / "bench" / "suites"
    for suite in sorted(suites.glob("*.jsonl")):
        for line in suite.read_text().splitlines():
            texts.append(json.dumps(json.loads(line), ensure_ascii=False))
    return texts


@pytest.mark.models
@pytest.mark.parametrize("name", sorted(registry.builtin_models()))
def test_builtin_model_is_llama_cpps_token_for_token(name):
    _compare_vocabularies(registry.resolve(name), _corpus())


@pytest.mark.models
def test_install_without_the_llama_extra_runs_the_native_engine(tmp_path):
    """The Quickstart's first line in a fresh virtualenv (no system
    site-packages): no llama.cpp compiled or installed, `edgespec generate`
    answers on the native engine, and `--backend llama` says in one line how
    to get it."""
    repo = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-e", str(repo)], check=True, timeout=3000)
    python, edgespec = str(venv / "bin" / "python"), str(venv / "bin" / "edgespec")
    assert subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode != 0
    env = {**os.environ, "PYTHONPATH": ""}   # the venv's own install, not this checkout by path
    run = subprocess.run([edgespec, "generate", "def add(a, b):", "-n", "4", "-m", "smollm2-135m", "--drafter", "none"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    run = subprocess.run([edgespec, "generate", "hi", "-n", "1", "-m", "smollm2-135m", "--backend", "llama"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0
    assert run.stderr.startswith("error: ") and "edgespec[llama]" in run.stderr


def test_llama_backend_and_peers_without_the_extra_say_how_to_get_them(monkeypatch, tiny_vocab_path, tmp_path):
    from edgespec import backends
    from edgespec.bench.peers import LlamaCppPython, PeerError
    from edgespec.errors import ExtraNotInstalledError

    for name in ("llama_cpp", "llama_cpp.llama_cpp", "llama_cpp.llama_speculative"):
        monkeypatch.setitem(sys.modules, name, None)   # import fails: the extra is missing
    monkeypatch.delitem(sys.modules, "edgespec.backends.llama", raising=False)
    with pytest.raises(ExtraNotInstalledError) as e:
        backends.open_backend("llama", tiny_vocab_path)
    assert "\n" not in str(e.value) and "pip install 'edgespec[llama]'" in str(e.value)
    with pytest.raises(PeerError) as e:
        LlamaCppPython("llama-cpp-python", tiny_vocab_path, threads=1, n_ctx=64, rss=None)
    assert "pip install 'edgespec[llama]'" in str(e.value)
    # the native engine's tokenizer needs none of it, and a mixture-of-experts
    # file goes to the native engine rather than to the missing llama backend
    with Vocab.load(tiny_vocab_path) as v:
        assert v.tokenize("hi", add_special=False)
    write_tiny_qwen3moe(tmp_path / "moe.gguf", tiny_vocab_path)
    assert backends.default_backend(tmp_path / "moe.gguf") == "native"
    monkeypatch.undo()
    assert backends.default_backend(tmp_path / "moe.gguf") == "llama"
