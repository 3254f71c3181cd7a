"""The ngram, recycle and cache drafters on plain token lists and numpy logits,
the n-gram cache builder with a fake tokenizer, and `edgespec drafter ngram`
on the built-in SmolLM2's tokenizer."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import edgespec.cli.drafter  # noqa: F401  (registers `drafter ngram`)
from edgespec import cli
from edgespec.config import EngineConfig
from edgespec.drafters import Draft, DrafterConfig, Verified, open_drafter
from edgespec.drafters.cache import NgramCache, build_ngram_cache
from edgespec.errors import DrafterError, InvalidArgumentError
from edgespec.sampling import SamplingParams

GREEDY = SamplingParams()

VOCAB = 100


def config(**options) -> DrafterConfig:
    return DrafterConfig(n_vocab=VOCAB, options=EngineConfig(**options))


def step(tokens, logits=None, row_tokens=()) -> Verified:
    """A verified step appending ``tokens``; logits: (n_rows, n_vocab) float32 or None."""
    addr = 0 if logits is None else logits.ctypes.data
    return Verified(Draft(), len(tokens) - 1, list(tokens), addr, list(row_tokens))


# ---------------------------------------------------------------------------
# ngram: prompt lookup
# ---------------------------------------------------------------------------


def test_ngram_copies_the_continuation():
    d = open_drafter("ngram", config())
    prompt = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    d.begin(prompt, GREEDY)
    draft = d.draft(prompt, 4)
    assert draft.tokens == [4, 5, 9, 1] and draft.parents is None and draft.source == "ngram"
    # up to the end of the text, never past it
    assert d.draft(prompt, 50).tokens == [4, 5, 9, 1, 2, 3]
    assert d.stats() == {"drafts": 2, "matches": 2, "mean_match_len": 3.0, "drafted_tokens": 10}
    d.close()


def test_ngram_no_match_is_an_empty_draft():
    d = open_drafter("ngram", config())
    d.begin([1, 2, 3, 4], GREEDY)
    draft = d.draft([1, 2, 3, 4], 8)
    assert len(draft) == 0 and draft.source == "ngram"
    assert d.draft([1, 2, 3, 4], 0).tokens == []
    assert d.stats()["matches"] == 0


def test_ngram_follows_the_text():
    d = open_drafter("ngram", config())
    prompt = [7, 8, 9, 10, 11]
    d.begin(prompt, GREEDY)
    # the first token (sampled from the prompt's row) arrives only with the
    # context; a one-token match is a draft of its own acceptance bucket
    first = d.draft(prompt + [7], 4)
    assert first.tokens == [8, 9, 10, 11] and first.key == "ngram:1"
    d.accept(step([8, 9]))
    assert d.draft(prompt + [7, 8, 9], 3).tokens == [10, 11, 7]
    # a new generation starts from scratch
    d.begin([1, 2], GREEDY)
    assert d.draft([1, 2], 4).tokens == []


# ---------------------------------------------------------------------------
# recycle: token recycling trees
# ---------------------------------------------------------------------------


def ranked_rows(*best_per_row) -> np.ndarray:
    """(n_rows, VOCAB) float32 logits, all 0 but each row's listed tokens: 10, 9, 8, ..."""
    rows = np.zeros((len(best_per_row), VOCAB), dtype=np.float32)
    for r, best in enumerate(best_per_row):
        rows[r, best] = 10.0 - np.arange(len(best))
    return rows


def test_recycle_tree_holds_the_recycled_top_tokens():
    d = open_drafter("recycle", config())
    d.begin([1, 2, 7], GREEDY)
    assert len(d.draft([1, 2, 7], 8)) == 0  # nothing learned yet

    # the step evaluated root 7 and node 11: after 7 came 11 12 13 14 15, after 11 came 20 21
    logits = ranked_rows([11, 12, 13, 14, 15], [20, 21])
    d.accept(step([11, 20], logits, row_tokens=[7, 11]))
    draft = d.draft([1, 2, 7], 8)
    assert draft.source == "recycle" and draft.parents is not None
    # the root's 4 best, then 2 children of each node with candidates (only 11 has)
    assert draft.tokens == [11, 12, 13, 14, 20, 21]
    assert draft.parents == [-1, -1, -1, -1, 0, 0]
    assert draft.depth == 2
    # max_tokens caps the nodes
    assert len(d.draft([1, 2, 7], 3)) == 3
    assert d.stats()["rows_learned"] == 2
    d.close()


def test_recycle_tree_invariants_on_random_logits():
    rng = np.random.default_rng(0)
    d = open_drafter("recycle", config())
    tokens = list(range(VOCAB))
    logits = rng.standard_normal((VOCAB, VOCAB)).astype(np.float32)
    d.accept(step([0], logits, row_tokens=tokens))
    for max_tokens in (1, 5, 16, 40):
        draft = d.draft([3], max_tokens)
        assert 1 <= len(draft) <= max_tokens and draft.depth <= max_tokens
        for i, p in enumerate(draft.parents):
            assert -1 <= p < i
        siblings = [(p, t) for p, t in zip(draft.parents, draft.tokens)]
        assert len(set(siblings)) == len(siblings)
    # the root's first child is the argmax of the row computed after it
    assert d.draft([3], 1).tokens == [int(np.argmax(logits[3]))]


# ---------------------------------------------------------------------------
# cache: static corpus cache + the session's dynamic cache
# ---------------------------------------------------------------------------


class FakeTokenizer:
    """Whitespace words to ids, assigned in order of first sight."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]


CORPUS = "the cat sat on the mat\n" * 3 + "the dog ran\n\nthe cat sat on the mat\n"


@pytest.fixture
def built(tmp_path):
    """(tokenizer, cache path, build stats) for CORPUS with n_max 4."""
    tok = FakeTokenizer()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    out = tmp_path / "cache" / "corpus.esng"
    stats = build_ngram_cache(tok, [corpus], out, n_max=4, progress=False)
    return tok, out, stats


def test_build_stats_and_round_trip(built, tmp_path):
    tok, out, stats = built
    assert stats["tokens"] == len(CORPUS.split()) and stats["files"] == 1 and stats["n_max"] == 4
    assert stats["bytes"] == out.stat().st_size and stats["path"] == str(out)
    assert [p.name for p in out.parent.iterdir()] == ["corpus.esng"]  # no temporary left over
    with NgramCache.load(out) as cache:
        assert len(cache) == stats["contexts"] > 0
        again = tmp_path / "again.esng"
        cache.save(again)
        assert again.read_bytes() == out.read_bytes()
        assert cache.draft(tok("the cat"), 4) == tok("sat on the mat")


def test_cache_drafter_drafts_from_the_corpus(built):
    tok, out, _ = built
    d = open_drafter("cache", config(ngram_cache=str(out)))
    prompt = tok("so the cat")
    d.begin(prompt, GREEDY)
    draft = d.draft(prompt, 4)
    assert draft.tokens == tok("sat on the mat") and draft.source == "cache"
    s = d.stats()
    assert s["drafts"] == 1 and s["static_contexts"] > 0 and s["session_contexts"] > 0
    d.close()


def test_cache_drafter_prefers_the_session_text(built):
    tok, out, _ = built
    d = open_drafter("cache", config(ngram_cache=str(out)))
    prompt = tok("the cat sat under the table the cat")
    d.begin(prompt, GREEDY)
    # [the cat] -> sat in both; then [the cat sat] -> under from the session, not on
    assert d.draft(prompt, 2).tokens == tok("sat under")
    # accepted tokens, and the tail of the context, are learned as well
    d.begin(tok("the cat"), GREEDY)
    d.accept(step(tok("sat quietly")))
    assert d.draft(tok("the cat sat quietly the cat sat"), 1).tokens == tok("quietly")


def test_cache_drafter_cuts_ids_outside_the_vocabulary(built):
    tok, out, _ = built
    # the cache would go on with "mat", whose id is the first one past this vocabulary
    d = open_drafter("cache", DrafterConfig(n_vocab=tok("mat")[0], options=EngineConfig(ngram_cache=str(out))))
    prompt = tok("the cat")
    d.begin(prompt, GREEDY)
    assert d.draft(prompt, 4).tokens == tok("sat on the")


def test_cache_drafter_needs_the_option():
    with pytest.raises(InvalidArgumentError, match="--ngram-cache"):
        open_drafter("cache", config())


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "missing"])
def test_cache_drafter_rejects_a_bad_file(built, damage):
    _, out, _ = built
    data = bytearray(out.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        out.write_bytes(bytes(data))
    elif damage == "truncate":
        out.write_bytes(bytes(data[:-3]))
    elif damage == "empty":
        out.write_bytes(b"")
    else:
        out.unlink()
    with pytest.raises(DrafterError, match=str(out)):
        open_drafter("cache", config(ngram_cache=str(out)))


def test_build_rejects_bad_corpora(tmp_path):
    out = tmp_path / "x.esng"
    with pytest.raises(InvalidArgumentError, match="no such file"):
        build_ngram_cache(FakeTokenizer(), [tmp_path / "nope.txt"], out, progress=False)
    with pytest.raises(InvalidArgumentError, match="n_max"):
        build_ngram_cache(FakeTokenizer(), [tmp_path / "nope.txt"], out, n_max=9, progress=False)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(DrafterError, match="not UTF-8"):
        build_ngram_cache(FakeTokenizer(), [latin1], out, progress=False)
    assert list(tmp_path.iterdir()) == [latin1]


def test_interrupted_build_leaves_the_old_cache(built, monkeypatch):
    _, out, _ = built
    before = out.read_bytes()
    corpus = out.parent / "more.txt"
    corpus.write_text("a b c\n\nd e f\n", encoding="utf-8")

    def interrupt(*args):
        raise KeyboardInterrupt

    # while tokenizing, and after the temporary file is written, before the rename
    with pytest.raises(KeyboardInterrupt):
        build_ngram_cache(interrupt, [corpus], out, progress=False)
    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        build_ngram_cache(FakeTokenizer(), [corpus], out, progress=False)
    monkeypatch.undo()
    assert out.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus.esng", "more.txt"]


# ---------------------------------------------------------------------------
# `edgespec drafter ngram` with a real tokenizer
# ---------------------------------------------------------------------------


def run_cli(monkeypatch, *argv) -> int:
    monkeypatch.setattr(sys, "argv", ["edgespec", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    return exit_.value.code


def test_cli_builds_a_cache_with_the_model_tokenizer(smollm2_path, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "notes.txt"
    corpus.write_text("Speculative decoding drafts tokens cheaply.\n\n"
                      "The target model verifies the drafted tokens in one batch.\n", encoding="utf-8")
    out = tmp_path / "notes.esng"
    code = run_cli(monkeypatch, "drafter", "ngram", str(corpus), "--model", str(smollm2_path),
                   "--out", str(out), "--n-max", "3")
    captured = capsys.readouterr()
    assert code in (0, None), captured.err
    [summary] = captured.out.strip().splitlines()
    assert summary.startswith(f"wrote {out}:") and "n_max 3" in summary
    with NgramCache.load(out) as cache:
        assert len(cache) > 10

    # the cache drafts the corpus's own continuation in the model's token ids
    from edgespec.backends.vocab import Vocab

    with Vocab.load(smollm2_path) as vocab:
        n_vocab = vocab.n_vocab
        ids = vocab.tokenize("The target model verifies the drafted tokens", add_special=False)
    d = open_drafter("cache", DrafterConfig(n_vocab=n_vocab, options=EngineConfig(ngram_cache=str(out))))
    d.begin(ids[:3], GREEDY)
    assert d.draft(ids[:3], 3).tokens == ids[3:6]


def test_cli_missing_corpus_exits_2(smollm2_path, tmp_path, monkeypatch, capsys):
    code = run_cli(monkeypatch, "drafter", "ngram", str(tmp_path / "nope.txt"),
                   "--model", str(smollm2_path), "--out", str(tmp_path / "x.esng"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nope.txt" in err[0]
    assert not (tmp_path / "x.esng").exists()
