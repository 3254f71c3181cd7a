"""Draft heads (EAGLE-1, the C core's es_head; the head drafter).

On the tiny llama with an untrained head of its width (drafters.head.random_head):
the head's C forward against a numpy reference of the same layer, and a
drafted chain against the reference's greedy chain; the head's rows the same
whatever the batch; greedy output identical to plain decoding past 256
positions; sampled output keeping the target's distribution (chi-square);
and the files refused: another target (width, tokenizer), a file cut short,
a wrong digest."""
from __future__ import annotations

import ctypes
import math
import shutil

import numpy as np
import pytest

from edgespec import Engine
from edgespec.backends import open_backend
from edgespec.config import EngineConfig
from edgespec.costs import MAX_BATCH
from edgespec.drafters import DrafterConfig, auto_members
from edgespec.drafters.head import measure_head_cost, random_head, write_head
from edgespec.errors import IncompatibleDraftModelError, InvalidArgumentError, ModelFormatError
from edgespec.models.gguf import GGUFFile
from edgespec.planner import Planner
from edgespec.sampling import SamplingParams
from gguf import GGMLQuantizationType as Q
from tiny_gguf import copy_gguf, write_tiny_llama, write_tiny_vocab

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
# A batch cost curve on which drafting pays, so that the planner drafts from the first step.
CHEAP_BATCHES = [0.0] + [1.0 + 0.05 * (k - 1) for k in range(1, MAX_BATCH + 1)]


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_llama_path):
    """(path, float tensors) of an untrained head for the tiny llama."""
    path = tmp_path_factory.mktemp("head") / "head.gguf"
    return path, random_head(tiny_llama_path, path, seed=3, gain=2.0)


@pytest.fixture(scope="module")
def target(tiny_llama_path):
    with open_backend("native", tiny_llama_path, n_ctx=512, n_batch=64, threads=1) as b:
        b.keep_features()
        yield b


def rows(address: int, n: int, width: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * (n * width)).from_address(address)).reshape(n, width).copy()


# -- the forward, against numpy ----------------------------------------------------


class NumpyHead:
    """The head's layer in float64 (a llama target: RoPE on adjacent pairs, SwiGLU)."""

    def __init__(self, tensors: dict, target_path):
        self.w = {k: v.astype(np.float64) for k, v in tensors.items()}
        with GGUFFile(target_path) as f:
            self.embd = f.tensor("token_embd.weight").dequantize().astype(np.float64)
            out = f.tensor("output.weight")
            self.out = (out if out is not None else f.tensor("token_embd.weight")).dequantize().astype(np.float64)
            self.n_head = f.get("llama.attention.head_count")
            self.n_head_kv = f.get("llama.attention.head_count_kv")
            self.eps = f.get("llama.attention.layer_norm_rms_epsilon")

    def norm(self, x, g):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):   # x (n, heads, hd)
        hd = x.shape[-1]
        theta = pos[:, None] * 10000.0 ** (-2.0 * np.arange(hd // 2) / hd)
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def forward(self, features: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(hidden (n, D), logits (n, V)) of rows 0..n-1 at positions 0..n-1."""
        w, n = self.w, len(tokens)
        x = features.astype(np.float64) @ w["fc_feature.weight"].T + self.embd[tokens] @ w["fc_token.weight"].T
        h = self.norm(x, w["blk.0.attn_norm.weight"])
        hd = x.shape[1] // self.n_head
        pos = np.arange(n, dtype=np.float64)
        q = self.rope((h @ w["blk.0.attn_q.weight"].T).reshape(n, self.n_head, hd), pos)
        k = self.rope((h @ w["blk.0.attn_k.weight"].T).reshape(n, self.n_head_kv, hd), pos)
        v = (h @ w["blk.0.attn_v.weight"].T).reshape(n, self.n_head_kv, hd)
        group = self.n_head // self.n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        att = np.einsum("hts,shd->thd", p, v).reshape(n, -1)
        x = x + att @ w["blk.0.attn_output.weight"].T
        h = self.norm(x, w["blk.0.ffn_norm.weight"])
        g, u = h @ w["blk.0.ffn_gate.weight"].T, h @ w["blk.0.ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w["blk.0.ffn_down.weight"].T
        return x, x @ self.out.T


def test_head_forward_matches_a_numpy_reference(target, head, tiny_llama_path):
    path, tensors = head
    tokens = target.tokenize(TEXT)[:24]
    target.clear()
    target.decode(tokens, logits_from=0)
    features = target.features()                      # (24, D): feature at p, then token p + 1
    with target.open_head(path) as h:
        address = h.decode(features[:-1], tokens[1:], 0)
        got_logits, got_hidden = rows(address, 23, target.n_vocab), h.hidden()
    want_hidden, want_logits = NumpyHead(tensors, tiny_llama_path).forward(features[:-1], tokens[1:])
    scale = np.abs(want_hidden).max()
    assert np.abs(got_hidden - want_hidden).max() < 2e-2 * scale
    assert np.abs(got_logits - want_logits).max() < 2e-2 * np.abs(want_logits).max()
    # Most rows' greedy token is the reference's (F16 rounding may swap near ties).
    assert (got_logits.argmax(1) == want_logits.argmax(1)).mean() > 0.9


def test_head_rows_do_not_depend_on_the_batch(target, head):
    path, _ = head
    tokens = target.tokenize(TEXT)[:20]
    target.clear()
    target.decode(tokens, logits_from=0)
    features = target.features()
    with target.open_head(path) as h:
        batch = rows(h.decode(features[:-1], tokens[1:], 0), 19, target.n_vocab)
        hidden = h.hidden()
        h.truncate(0)
        for i in range(19):
            one = rows(h.decode(features[i:i + 1], tokens[i + 1:i + 2], 0), 1, target.n_vocab)
            assert np.array_equal(one[0], batch[i]) and np.array_equal(h.hidden()[0], hidden[i])


def test_drafted_chain_is_the_references_greedy_chain(target, head, tiny_llama_path):
    """The drafter's chain: each token the argmax of the head's logits, each
    next row the head's own output with that token (the reference computes
    the same chain, all rows at once, causal)."""
    path, tensors = head
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="head",
                head=str(path), draft_max=6) as engine:
        prompt = engine.tokenize(TEXT)[:16]
        lane = engine.lanes[0]
        drafter = lane.open_drafters("head")[0]
        drafter.begin(prompt, SamplingParams(temperature=0.0))
        engine.backend.clear()
        engine.backend.decode(prompt)                   # the prefill: its last row's feature
        feature = engine.backend.features()[-1:]
        context = prompt + [5]
        draft = drafter.draft(context, 6)
    ref = NumpyHead(tensors, tiny_llama_path)
    feats, toks = [feature[0].astype(np.float64)], [context[-1]]
    chain, confidence = [], []
    for _ in range(6):
        hidden, logits = ref.forward(np.array(feats), toks)
        chain.append(int(logits[-1].argmax()))
        z = np.exp(logits[-1] - logits[-1].max())
        confidence.append(float(z.max() / z.sum()))
        feats.append(hidden[-1])
        toks.append(chain[-1])
    assert draft.tokens == chain
    # what the planner cuts the chain by: the head's probability of each token
    assert np.allclose(draft.confidence, confidence, atol=0.02)   # the kernels quantize activations


# -- through the engine --------------------------------------------------------------


# gemma3 scales its embeddings by sqrt(n_embd): a head of the others' gain
# would be certain of every token, and add no runner-up leaves.
@pytest.mark.parametrize("target_path, gain", [("tiny_llama_path", 2.0), ("tiny_qwen2_path", 2.0),
                                               ("tiny_gemma3_path", 0.02)])
def test_greedy_output_is_plain_decodings_past_256_positions(request, tmp_path, target_path, gain):
    """On each architecture's tiny model (qwen2: NEOX RoPE; gemma3: Q/K norms,
    post-norms, GELU, the embedding scale, the soft-cap), with a head of its
    own, its chains widened into trees by every runner-up where it is unsure."""
    target_path = request.getfixturevalue(target_path)
    path = tmp_path / "head.gguf"
    random_head(target_path, path, seed=4, gain=gain)
    with Engine(str(target_path), backend="native", threads=1, n_ctx=512, drafter="head",
                head=str(path), draft_max=4) as engine:
        prompt = TEXT * 7
        assert len(engine.tokenize(prompt)) > 200
        plain = engine.generate(prompt, max_tokens=120, drafter="none")
        planner = engine.lanes[0].planner = Planner(CHEAP_BATCHES)
        planner.widen = lambda key, n_chain, gains: len(gains)   # every runner-up a leaf
        spec = engine.generate(prompt, max_tokens=120)
        assert spec.stats.prompt_tokens + len(spec.tokens) > 256
        assert spec.tokens == plain.tokens
        assert spec.stats.spec.drafted > 0
        assert spec.stats.spec.drafters["head"]["drafts"] > 0
        assert spec.stats.spec.drafters["head"]["trees"] > 0   # runner-up leaves where the head was unsure


def test_sampling_keeps_the_targets_distribution(tiny_llama_path, head):
    """The second and third tokens of many seeded runs (the third drafted by
    the head, verified against the target's row) against the target's own
    probabilities, by Pearson's chi-square (as tests/test_verify.py)."""
    path, _ = head
    top_k, trials = 3, 400
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="head",
                head=str(path), draft_max=2) as engine:
        engine.lanes[0].planner = Planner(CHEAP_BATCHES)
        prompt = engine.tokenize(TEXT)[:12]
        counts: dict[tuple, int] = {}
        drafted = 0
        for seed in range(trials):
            r = engine.generate(prompt, max_tokens=3, temperature=1.0, top_k=top_k, seed=seed)
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
            drafted += r.stats.spec.drafted
        assert drafted > trials // 2
        b = engine.backend

        def probs(context):
            b.clear()
            z = rows(b.decode(context), 1, b.n_vocab)[0].astype(np.float64)
            kth = np.sort(z)[-top_k]
            e = np.where(z >= kth, np.exp(z - z.max()), 0.0)
            return e / e.sum()

        cells, expected = [], []
        p1 = probs(prompt)
        for t1 in np.flatnonzero(p1):
            p2 = probs(prompt + [int(t1)])
            for t2 in np.flatnonzero(p2):
                p3 = probs(prompt + [int(t1), int(t2)])
                for t3 in np.flatnonzero(p3):
                    cells.append((int(t1), int(t2), int(t3)))
                    expected.append(p1[t1] * p2[t2] * p3[t3])
    assert set(counts) <= set(cells), "a token outside the kept set"
    c = np.array([counts.get(cell, 0) for cell in cells], dtype=np.float64)
    e = np.array(expected) * trials
    small = e < 5
    c, e = np.append(c[~small], c[small].sum()), np.append(e[~small], e[small].sum())
    c, e = c[e > 0], e[e > 0]
    stat, k = float(((c - e) ** 2 / e).sum()), len(e) - 1
    crit = k * (1 - 2 / (9 * k) + 3.719 * math.sqrt(2 / (9 * k))) ** 3   # p = 1e-4
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}"


# -- refused files ----------------------------------------------------------------------


def test_a_head_for_another_width_is_refused_with_both_names(tmp_path, tiny_llama_path, tiny_vocab_path, target):
    other = tmp_path / "wide.gguf"
    write_tiny_llama(other, tiny_vocab_path, n_embd=128, n_head=4, n_head_kv=2)
    random_head(other, tmp_path / "wide-head.gguf")
    with pytest.raises(IncompatibleDraftModelError) as e:
        target.open_head(tmp_path / "wide-head.gguf")
    text = str(e.value)
    assert "128 wide" in text and "64 wide" in text and "tiny-random-llama" in text and "\n" not in text


def test_a_head_for_another_tokenizer_is_refused(tmp_path, tiny_llama_path, target):
    vocab = tmp_path / "vocab.gguf"
    write_tiny_vocab(vocab, n_merges=255)   # another tokenizer of about the same size
    other = tmp_path / "other.gguf"
    write_tiny_llama(other, vocab)
    random_head(other, tmp_path / "other-head.gguf")
    with pytest.raises(IncompatibleDraftModelError, match="made for .*not for the target"):
        target.open_head(tmp_path / "other-head.gguf")


def test_a_head_for_a_model_of_the_same_shape_is_refused(tmp_path, tiny_vocab_path, target):
    """Same tokenizer, width and layers, other weights: the digest tells them apart."""
    other = tmp_path / "seed1.gguf"
    write_tiny_llama(other, tiny_vocab_path, seed=1)
    random_head(other, tmp_path / "seed1-head.gguf")
    with pytest.raises(IncompatibleDraftModelError, match="token embeddings or tokenizers differ"):
        target.open_head(tmp_path / "seed1-head.gguf")


def test_a_cut_short_or_damaged_head_is_refused(tmp_path, head, target):
    path, _ = head
    data = path.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-100])
    with pytest.raises(ModelFormatError):
        target.open_head(short)
    damaged = tmp_path / "damaged.gguf"
    shutil.copy(path, damaged)
    with open(damaged, "r+b") as f:   # one byte of the last tensor's data
        f.seek(len(data) - 40)
        byte = f.read(1)
        f.seek(len(data) - 40)
        f.write(bytes([byte[0] ^ 0x55]))
    with pytest.raises(ModelFormatError, match="eagle.digest"):
        target.open_head(damaged)
    with pytest.raises(ModelFormatError, match="not a draft head"):
        target.open_head(target.path)


def test_greedy_output_through_a_context_shift(tiny_llama_path, head):
    """A shift begins the drafters again on the shortened text: the head
    starts its cache there and drafts on."""
    path, _ = head
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=96, context_shift=True, drafter="head",
                head=str(path), draft_max=4) as engine:
        plain = engine.generate(TEXT, max_tokens=160, drafter="none")
        engine.lanes[0].planner = Planner(CHEAP_BATCHES)
        spec = engine.generate(TEXT, max_tokens=160)
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == 160 and spec.stats.spec.drafted > 0


# -- options --------------------------------------------------------------------------


def test_auto_has_the_head_only_when_one_is_given(tiny_llama_path):
    assert "head" not in auto_members(DrafterConfig(n_vocab=10))
    assert "head" in auto_members(DrafterConfig(n_vocab=10, options=EngineConfig(head="h.gguf")))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=128) as engine:
        with pytest.raises(InvalidArgumentError, match="--head FILE"):
            engine.generate(TEXT, max_tokens=2, drafter="head")
    with Engine(str(tiny_llama_path), backend="llama", threads=1, n_ctx=128, head="h.gguf") as engine:
        with pytest.raises(InvalidArgumentError, match="native backend"):
            engine.generate(TEXT, max_tokens=2, drafter="head")


def test_a_head_that_computes_the_targets_choice_is_always_accepted(tmp_path, tiny_vocab_path):
    """A one-layer target whose attention adds nothing (attn_v zero) chooses
    each token from the last one alone; a head with that layer over the
    token (fc_token the identity, fc_feature zero) chooses the same tokens
    (its output is the target's before the final norm, whose weights are
    ones: the same argmax), so its chains are accepted whole: the head is
    fed each position's next token, and its own guesses while drafting."""
    base, target_path = tmp_path / "base.gguf", tmp_path / "bigram.gguf"
    write_tiny_llama(base, tiny_vocab_path, n_layer=1, dtype=Q.F32)
    with GGUFFile(base) as f:
        layer = {t.name: t.dequantize() for t in f.tensors if t.name.startswith("blk.0.")}
        n_head, n_head_kv, n_ff = (f.get(f"llama.{k}") for k in ("attention.head_count", "attention.head_count_kv",
                                                                  "feed_forward_length"))
    layer["blk.0.attn_v.weight"] = np.zeros_like(layer["blk.0.attn_v.weight"])
    copy_gguf(base, target_path, drop=["blk.0.attn_v.weight"], add={"blk.0.attn_v.weight": layer["blk.0.attn_v.weight"]})
    n_embd = layer["blk.0.attn_norm.weight"].shape[0]
    write_head(tmp_path / "head.gguf", target_path, {
        "fc_feature.weight": np.zeros((n_embd, n_embd), np.float32),
        "fc_token.weight": np.eye(n_embd, dtype=np.float32), **layer},
        n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff)
    with Engine(str(target_path), backend="native", threads=1, n_ctx=256, drafter="head",
                head=str(tmp_path / "head.gguf"), draft_max=4) as engine:
        plain = engine.generate(TEXT, max_tokens=60, drafter="none")
        engine.lanes[0].planner = Planner(CHEAP_BATCHES)
        spec = engine.generate(TEXT, max_tokens=60)
    assert spec.tokens == plain.tokens
    assert spec.stats.spec.drafted > 20 and spec.stats.spec.acceptance_rate > 0.9


# -- a real target (models tier) ---------------------------------------------------------


def test_a_head_on_qwen_coder_15b_is_lossless_and_cheap(tmp_path, qwen_coder_15b_path):
    """An untrained head of qwen2.5-coder-1.5b's width (a 4096-wide
    feed-forward, Q8_0) with its output trimmed to the 8192 most used tokens:
    greedy output is plain decoding's, and a drafted token costs at most 8%
    of a target token (issue 40; about 3.5% measured on a busy 2-core machine)."""
    path = tmp_path / "head.gguf"
    random_head(qwen_coder_15b_path, path, n_ff=4096, qtype=Q.Q8_0)
    with Engine(str(qwen_coder_15b_path), backend="native", threads=2, n_ctx=1024, drafter="head",
                head=str(path), draft_vocab=8192, draft_max=4) as engine:
        prompt = "def quicksort(items):\n"
        plain = engine.generate(prompt, max_tokens=32, drafter="none")
        engine.lanes[0].planner = Planner(CHEAP_BATCHES)
        spec = engine.generate(prompt, max_tokens=32)
        assert spec.tokens == plain.tokens and spec.stats.spec.drafted > 0
        drafter = engine.lanes[0].drafters["head"]
        assert drafter.head.output_rows == 8192
        assert measure_head_cost(engine.backend, drafter.head).per_token <= 0.08
