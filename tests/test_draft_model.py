"""The model drafter: paired draft models, same-vocabulary and cross-tokenizer
modes, draft KV rollback, the planner declining a draft model that does not
pay, and exact sampling with a deterministic (re-tokenized) proposal.

The fast tier uses the tiny random models: a second tiny tokenizer with fewer
merges gives a draft model whose vocabulary differs from the target's. The
built-in models (``models`` marker) check greedy identity past 256
positions on the native backend."""
from __future__ import annotations

import time

import numpy as np
import pytest

from edgespec import Engine
from edgespec.backends import open_backend
from edgespec.backends.vocab import Vocab
from edgespec.config import EngineConfig
from edgespec.costs import DraftCost
from edgespec.drafters import DrafterConfig, Verified, auto_members
from edgespec.drafters import model as model_drafter
from edgespec.errors import IncompatibleDraftModelError, InvalidArgumentError, ModelFetchError
from edgespec.models import registry
from edgespec.sampling import Sampler, SamplingParams
from edgespec.text import complete_utf8
from tiny_gguf import SPECIAL_TOKENS, write_tiny_llama, write_tiny_vocab, write_trimmed_drafter

LONG_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
             "The target model verifies the drafted tokens in one batch. ") * 6


@pytest.fixture(scope="module")
def other_vocab_llama(tmp_path_factory):
    """A tiny random llama over another tokenizer: the same byte-level BPE
    with 64 merges instead of 256 (other token ids, other splits)."""
    folder = tmp_path_factory.mktemp("tiny-other")
    vocab = folder / "vocab-64.gguf"
    write_tiny_vocab(vocab, n_merges=64)
    path = folder / "tiny-llama-64.gguf"
    write_tiny_llama(path, vocab, seed=1)
    return path


def _trimmed_keep(tiny_vocab_path) -> list[int]:
    """Target ids a trimmed drafter keeps, in an order of its own: the special
    tokens, the byte tokens backwards, every other of the first merges."""
    n_special = len(SPECIAL_TOKENS)
    with Vocab.load(tiny_vocab_path) as v:
        n = v.n_vocab
    merges = range(n_special + 256, min(n, n_special + 256 + 200), 2)
    return [*range(n_special), *reversed(range(n_special, n_special + 256)), *merges]


@pytest.fixture(scope="module")
def trimmed_llama(tmp_path_factory, tiny_vocab_path):
    """A specialized drafter for the tiny target: a tiny random llama keeping
    about 360 of its tokens."""
    path = tmp_path_factory.mktemp("tiny-trimmed") / "trimmed.gguf"
    write_trimmed_drafter(path, tiny_vocab_path, _trimmed_keep(tiny_vocab_path))
    return path


def _drafter(target, draft_path):
    cfg = DrafterConfig(n_vocab=target.n_vocab, target=target,
                        options=EngineConfig(draft_model=str(draft_path), threads=1), n_ctx=512)
    return model_drafter.ModelDrafter(cfg)


# -- paired draft models ------------------------------------------------------


def test_the_manifest_pairs_the_coder_models():
    assert registry.paired_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert registry.paired_draft(registry.cached_path(registry.builtin_model("qwen2.5-coder-1.5b"))) \
        == "qwen2.5-coder-0.5b"
    assert registry.paired_draft("smollm2-135m") is None
    assert registry.paired_draft("/no/such/model.gguf") is None


def test_auto_weighs_a_paired_draft_model_and_leaves_recycling_out():
    assert auto_members(DrafterConfig(n_vocab=1, paired_draft="d")) == ["ngram", "model"]
    assert auto_members(DrafterConfig(n_vocab=1, options=EngineConfig(draft_model="d", ngram_cache="c"))) == \
        ["ngram", "cache", "model"]
    assert auto_members(DrafterConfig(n_vocab=1)) == ["ngram"]


def test_model_drafter_without_a_pair_names_the_option(tiny_llama_path):
    with pytest.raises(InvalidArgumentError, match="--draft-model"):
        Engine(str(tiny_llama_path), threads=1, n_ctx=256, drafter="model")


def test_a_paired_draft_model_that_cannot_be_fetched_says_how_to_get_it(tiny_llama_path, monkeypatch):
    import edgespec.engine as engine_module

    def offline(name, ref):
        if ref == "some-draft":
            raise ModelFetchError("pip could not download some-draft-part1==1.0: No matching distribution")
        return real(name, ref)

    real = model_drafter.resolve_model
    monkeypatch.setattr(model_drafter, "resolve_model", offline)
    monkeypatch.setattr(engine_module.registry, "paired_draft", lambda ref: "some-draft")
    with pytest.raises(ModelFetchError, match="draft model some-draft .*edgespec models pull some-draft"):
        Engine(str(tiny_llama_path), threads=1, n_ctx=256, drafter="model")


def test_a_paired_draft_model_is_used_without_draft_model(tiny_llama_path, monkeypatch):
    import edgespec.engine as engine_module

    monkeypatch.setattr(engine_module.registry, "paired_draft", lambda ref: str(tiny_llama_path))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=256, drafter="model") as engine:
        prompt = "Write a sentence about the sea."
        plain = engine.generate(prompt, max_tokens=24, drafter="none")
        spec = engine.generate(prompt, max_tokens=24)
        assert spec.tokens == plain.tokens
        # self-drafting: every draft of the paired model is accepted, and the
        # stats say which drafter produced the accepted tokens
        by = spec.stats.spec.per_drafter
        assert by["model"]["accepted"] == by["model"]["drafted"] > 0
        assert spec.stats.spec.drafters["model"]["mode"] == model_drafter.SAME_VOCAB
        # auto weighs the same pair alongside the n-gram drafter
        auto = engine.generate(prompt, max_tokens=24, drafter="auto")
        assert auto.tokens == plain.tokens
        assert set(auto.stats.spec.drafters) == {"ngram", "model"}


# -- tokenizer check ------------------------------------------------------------


class _LossyVocab:
    """A tokenizer that turns every non-ASCII character into one <unk> token."""

    def __init__(self, n_vocab):
        self.n_vocab = n_vocab

    def metadata(self, key):
        return "lossy"

    def tokenize(self, text, add_special=True, parse_special=False):
        return [ord(c) if ord(c) < 128 else 128 for c in text]

    def piece(self, t):
        return b"<unk>" if t == 128 else bytes([t])


def test_tokenizer_check_chooses_the_mode_and_refuses_a_lossy_tokenizer(tiny_vocab_path, other_vocab_llama):
    with Vocab.load(tiny_vocab_path) as target, Vocab.load(other_vocab_llama) as other:
        assert model_drafter.check_tokenizers(target, target, "same") == (model_drafter.SAME_VOCAB, None)
        mode, why = model_drafter.check_tokenizers(target, other, "other")
        assert mode == model_drafter.CROSS_TOKENIZER and "vocabulary of" in why
        with pytest.raises(IncompatibleDraftModelError, match="cannot stand in .* re-tokenizes to .*<unk>"):
            model_drafter.check_tokenizers(target, _LossyVocab(129), "lossy")


def test_larger_draft_model_is_accepted_with_a_warning(tiny_llama_path, tiny_vocab_path, tmp_path):
    bigger = tmp_path / "bigger.gguf"
    write_tiny_llama(bigger, tiny_vocab_path, n_embd=128, n_ff=256)
    with open_backend("native", tiny_llama_path, n_ctx=512, threads=1) as target:
        with pytest.warns(UserWarning, match="larger than the target"):
            d = _drafter(target, bigger)
        d.close()


# -- draft KV rollback -------------------------------------------------------------


def test_draft_cache_rolls_back_exactly_what_the_target_rejected(tiny_llama_path):
    with open_backend("native", tiny_llama_path, n_ctx=512, threads=1) as target:
        d = _drafter(target, tiny_llama_path)
        try:
            context = target.tokenize(LONG_TEXT[:120])
            d.begin(context, SamplingParams())
            draft = d.draft(context, 6)
            assert len(draft) == 6
            # the chain's last token is sampled, never evaluated
            assert d.backend.cached_tokens == context + draft.tokens[:5]
            # the target accepts two draft tokens and then picks a token of its own
            own = next(t for t in range(target.n_vocab) if t != draft.tokens[2])
            d.accept(Verified(draft, 2, draft.tokens[:2] + [own], 0, []))
            assert d.backend.cached_tokens == context + draft.tokens[:2]
            # the next draft evaluates only the target's token before drafting on
            context = context + draft.tokens[:2] + [own]
            before = d.n_evaluated
            nxt = d.draft(context, 3)
            assert d.n_evaluated - before == 1 + 2
            assert d.backend.cached_tokens == context + nxt.tokens[:2]
            # a fully accepted chain whose bonus token equals the next draft token keeps that cell
            d.accept(Verified(nxt, 1, nxt.tokens[:2], 0, []))
            assert d.backend.cached_tokens == context + nxt.tokens[:2]
        finally:
            d.close()


# -- cross-tokenizer drafting -------------------------------------------------------


@pytest.mark.parametrize("backend", ["native", "llama"])
def test_cross_tokenizer_greedy_identity_past_256_positions(tiny_llama_path, other_vocab_llama, backend):
    with Engine(str(tiny_llama_path), backend=backend, threads=1, n_ctx=512, drafter="model",
                draft_model=str(other_vocab_llama), draft_max=4) as engine:
        prompt = LONG_TEXT[:600]
        plain = engine.generate(prompt, max_tokens=96, drafter="none")
        spec = engine.generate(prompt, max_tokens=96)
        assert len(engine.tokenize(prompt)) + len(plain.tokens) > 256
        assert spec.tokens == plain.tokens and spec.text == plain.text
        stats = spec.stats.spec
        assert stats.drafters["model"]["mode"] == model_drafter.CROSS_TOKENIZER
        assert stats.drafted > 0


def test_text_bridge_retokenizes_incrementally_and_keeps_the_anchor(tiny_llama_path, other_vocab_llama):
    with Vocab.load(tiny_llama_path) as target, Vocab.load(other_vocab_llama) as draft:
        bridge = model_drafter._TextBridge(target, draft)
        tokens = target.tokenize(LONG_TEXT)
        for end in (50, 51, 57, 90, 85, len(tokens)):   # growing, and rolled back
            assert bridge.update(tokens[:end])
            text = b"".join(target.piece(t) for t in tokens[:end])
            assert bytes(bridge.text) == text
            assert bridge.d_tokens == draft.tokenize(text.decode("utf-8"), parse_special=True)
        # a continuation re-tokenizes into the target's own tokens of the longer text
        head, tail = tokens[:60], tokens[60:80]
        bridge.update(head)
        continuation = b"".join(target.piece(t) for t in tail)
        proposal = bridge.target_tokens(continuation)
        assert proposal[:-1] == tail[:len(proposal) - 1] and len(proposal) >= len(tail) - 1


def test_complete_utf8_cuts_a_split_character():
    text = "aé🙂".encode()
    assert complete_utf8(text) == len(text)
    assert complete_utf8(text[:-1]) == 3
    assert complete_utf8(text[:2]) == 1
    assert complete_utf8(b"") == 0


# -- exact sampling with a deterministic proposal ------------------------------------

V = 5
CHI2_DF24_P001 = 51.18   # chi-square critical value, 24 degrees of freedom, p = 0.001


def test_sampling_with_a_deterministic_proposal_is_exact():
    """A cross-tokenizer draft is a point mass: tokens chosen by another model,
    independent of the target's random draws. Verified with probs=None, the
    first two tokens of the text must follow the target's joint distribution
    p(a) p(b | a) whatever the proposals (here drawn from a skewed r)."""
    rng = np.random.default_rng(7)
    root = rng.normal(size=V).astype(np.float32)
    second = rng.normal(size=(V, V)).astype(np.float32) * 1.5   # p(b | a) = softmax(second[a])
    p1 = np.exp(root) / np.exp(root).sum()
    p2 = np.exp(second) / np.exp(second).sum(axis=1, keepdims=True)
    expected = p1[:, None] * p2
    r = np.array([0.6, 0.1, 0.1, 0.1, 0.1])   # the proposal's own (wrong) distribution
    n = 20000
    counts = np.zeros((V, V))
    with Sampler(SamplingParams(temperature=1.0, seed=11), V) as sampler:
        for _ in range(n):
            x1, x2 = rng.choice(V, p=r), rng.choice(V, p=r)
            rows = np.stack([root, second[x1], rng.normal(size=V).astype(np.float32)])  # row 3: unused here
            out = sampler.verify(rows.ctypes.data, [int(x1), int(x2)])
            if len(out) == 1:   # rejected at once: the next step samples plainly
                out += sampler.verify(np.ascontiguousarray(second[out[0]]).ctypes.data, [])
            counts[out[0], out[1]] += 1
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum()
    assert chi2 < CHI2_DF24_P001, f"chi-square {chi2:.1f} over 25 cells"


# -- the planner declines a draft model that costs more than it saves -------------------


def test_a_draft_model_measured_slow_at_load_is_never_asked(tiny_llama_path, monkeypatch, tmp_path):
    """What the draft model costs is measured when it opens: where a drafted
    token costs more than it can save, auto never asks it, not even once."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setattr(model_drafter, "draft_cost", lambda target, draft: DraftCost(per_token=20.0, catch_up=5.0))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                draft_model=str(tiny_llama_path)) as engine:
        prompt = "Write a sentence about the sea."
        plain = engine.generate(prompt, max_tokens=64, drafter="none")
        spec = engine.generate(prompt, max_tokens=64)
        assert spec.tokens == plain.tokens
        assert spec.stats.spec.drafters["model"]["drafts"] == 0
        assert spec.stats.spec.drafters["model"]["draft_tokens_evaluated"] == 0


def test_planner_stops_asking_a_draft_model_slower_than_measured(tiny_llama_path, monkeypatch, tmp_path):
    """Self-drafting accepts everything, and the load-time measurement says
    drafting is nearly free; but each drafted token here takes 20 ms, about
    20 target steps: the planner's own timings overrule the measurement
    within a few drafts, and the output stays plain decoding's."""
    from edgespec.planner import MIN_SAMPLES

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setattr(model_drafter, "draft_cost", lambda target, draft: DraftCost(per_token=0.01, catch_up=0.001))
    monkeypatch.setattr(model_drafter, "open_seconds", lambda path: 0.0)   # drafting time alone is at stake
    real = model_drafter.ModelDrafter.draft

    def slow(self, context, max_tokens):
        draft = real(self, context, max_tokens)
        time.sleep(0.02 * len(draft))
        return draft

    monkeypatch.setattr(model_drafter.ModelDrafter, "draft", slow)
    # Verification is held nearly free (a fixed curve; a timed step of n tokens counts
    # as curve[n] one-token steps): the drafter's own timings are the only thing that
    # may stop the planner asking it, however the tiny model's batches scale here.
    from edgespec import engine as engine_module
    from edgespec.costs import MAX_BATCH
    from edgespec.planner import Planner
    curve = [0.0] + [1.0 + 0.02 * (n - 1) for n in range(1, MAX_BATCH + 1)]
    record = Planner.record_step_time
    monkeypatch.setattr(engine_module, "batch_costs", lambda backend, remeasure=False: curve)
    monkeypatch.setattr(Planner, "record_step_time", lambda self, seconds, n_tokens, **io:
                        record(self, seconds / curve[min(n_tokens, MAX_BATCH)], 1, **io))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                draft_model=str(tiny_llama_path)) as engine:
        prompt = "Write a sentence about the sea."
        plain = engine.generate(prompt, max_tokens=64, drafter="none")
        spec = engine.generate(prompt, max_tokens=64)
        assert spec.tokens == plain.tokens
        asked = spec.stats.spec.drafters["model"]["drafts"]
        assert MIN_SAMPLES <= asked <= MIN_SAMPLES + 2, f"the slowed draft model was asked {asked} times"
        assert engine.lanes[0].planner.drafter_cost("model").per_token > 1.0


def test_draft_cost_is_measured_once_and_cached(tiny_llama_path, monkeypatch, tmp_path):
    """A draft model as large as its target (itself): one drafted token costs
    about one target step, a caught-up token less (it is evaluated in a
    batch); measured once, then read from the cache."""
    from edgespec import costs

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    calls = []
    real = costs.measure_draft_cost
    monkeypatch.setattr(costs, "measure_draft_cost", lambda t, d: calls.append(1) or real(t, d))
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as target, \
            open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as draft:
        cost = costs.draft_cost(target, draft)
        assert costs.draft_cost(target, draft) == cost
    assert len(calls) == 1
    assert 0.3 < cost.per_token < 3.0
    assert 0 < cost.catch_up < cost.per_token
    assert (tmp_path / costs.DRAFT_COST_FILE).is_file()


# -- the built-in models, native backend, past 256 positions ---------------------------

# A code prompt of ~250 tokens: with 24 generated tokens the text passes 256 positions.
CODE_PROMPT = ("Add a docstring to each function of this Python code and return the full code:\n\n"
               + "".join(f"def f{i}(x, y):\n    z = x * {i} + y\n    return z - {i}\n\n" for i in range(10)))


def _identical_past_256(engine, drafter, **options):
    plain = engine.generate(CODE_PROMPT, max_tokens=24, drafter="none", chat=True, **options)
    spec = engine.generate(CODE_PROMPT, max_tokens=24, drafter=drafter, chat=True, **options)
    assert plain.stats.prompt_tokens + len(plain.tokens) > 256
    assert spec.tokens == plain.tokens and spec.text == plain.text
    return spec


def test_paired_draft_model_greedy_identity(qwen_coder_15b_path, qwen_coder_05b_path):
    with Engine("qwen2.5-coder-1.5b", backend="native", threads=2, n_ctx=1024, drafter="model") as engine:
        spec = _identical_past_256(engine, "model")
        drafter = spec.stats.spec.drafters["model"]
        assert drafter["draft_model"] == "qwen2.5-coder-0.5b" and drafter["mode"] == model_drafter.SAME_VOCAB
        assert engine.lanes[0].drafters["model"].backend.name == "native"
        assert spec.stats.spec.per_drafter["model"]["accepted"] > 0


def test_cross_tokenizer_greedy_identity_on_built_in_models(qwen_coder_05b_path, smollm2_path):
    with Engine("qwen2.5-coder-0.5b", backend="native", threads=2, n_ctx=1024, drafter="model",
                draft_model="smollm2-135m") as engine:
        spec = _identical_past_256(engine, "model")
        assert spec.stats.spec.drafters["model"]["mode"] == model_drafter.CROSS_TOKENIZER
        assert spec.stats.spec.per_drafter["model"]["accepted"] > 0
        # sampled: a valid text, drafted and verified as a point-mass proposal
        r = engine.generate(CODE_PROMPT, max_tokens=16, chat=True, temperature=0.8, seed=3)
        assert all(0 <= t < engine.backend.n_vocab for t in r.tokens)
        assert r.stats.spec.drafted > 0


def test_runner_up_leaves_on_a_cheap_cost_curve_keep_greedy_identity(tiny_llama_path, tiny_vocab_path, tmp_path):
    """Another random model over the same tokenizer drafts; with batches
    nearly free the planner widens uncertain positions into trees, which
    verification walks exactly."""
    from edgespec.costs import MAX_BATCH
    from edgespec.planner import Planner

    other = tmp_path / "other-seed.gguf"
    write_tiny_llama(other, tiny_vocab_path, seed=5)
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="model",
                draft_model=str(other), draft_max=6) as engine:
        engine.lanes[0].planner = Planner([0.0] + [1.0 + 0.02 * (k - 1) for k in range(1, MAX_BATCH + 1)])
        plain = engine.generate(LONG_TEXT[:200], max_tokens=48, drafter="none")
        spec = engine.generate(LONG_TEXT[:200], max_tokens=48)
        assert spec.tokens == plain.tokens
        assert spec.stats.spec.drafters["model"]["trees"] > 0


def test_the_server_reports_which_drafter_produced_the_accepted_tokens(tiny_llama_path, monkeypatch):
    import http.client
    import json
    import threading

    import edgespec.engine as engine_module
    from edgespec.server import make_server

    monkeypatch.setattr(engine_module.registry, "paired_draft", lambda ref: str(tiny_llama_path))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=256, drafter="model") as engine:
        server = make_server(engine, port=0, quiet=True, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            host, port = server.server_address[:2]
            conn = http.client.HTTPConnection(host, port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(
                {"model": "tiny", "prompt": "Write a sentence about the sea.", "max_tokens": 16, "temperature": 0}),
                {"Content-Type": "application/json"})
            body = json.loads(conn.getresponse().read())
            spec = body["edgespec"]["spec"]
            assert spec["per_drafter"]["model"]["accepted"] > 0
            assert spec["drafters"]["model"]["mode"] == model_drafter.SAME_VOCAB
        finally:
            server.shutdown()
            server.server_close()


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square critical value at p = 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.fixture
def head_ranking(tiny_llama_path, tmp_path, monkeypatch):
    """A token ranking of the tiny vocabulary (a seeded shuffle) in a fresh
    EDGESPEC_HOME, for draft heads trimmed to its top."""
    from edgespec.drafters import ranks

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    with Vocab.load(tiny_llama_path) as vocab:
        order = np.random.default_rng(0).permutation(vocab.n_vocab).astype(np.int32)
        path = ranks.user_folder() / ranks.rank_name(model_drafter.target_fingerprint(vocab))
    path.parent.mkdir(parents=True)
    np.save(path, order)
    return order


@pytest.mark.parametrize("draft, draft_vocab", [("other_vocab_llama", None), ("trimmed_llama", None),
                                                ("tiny_llama_path", 256)])
def test_sampling_with_drafts_follows_the_target_distribution(tiny_llama_path, draft, draft_vocab, request):
    """End to end on the tiny models: the first four tokens sampled with
    cross-tokenizer drafts (a deterministic proposal), a trimmed
    vocabulary's drafts (q zero outside its tokens) or a draft head trimmed
    to 256 of the 515 tokens (--draft-vocab: q zero outside them, often
    where the target's token is) follow the target's own distribution,
    computed exactly from its sampler probabilities along every prefix."""
    params = SamplingParams(temperature=0.8, top_k=3)
    kw = dict(temperature=params.temperature, top_k=params.top_k)
    if draft_vocab:
        request.getfixturevalue("head_ranking")
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=256, drafter="model",
                draft_model=str(request.getfixturevalue(draft)), draft_vocab=draft_vocab) as engine:
        prompt = "def fibonacci(n):\n    if n < 2:\n"
        context = engine.prompt_tokens(prompt)
        backend = engine.backend
        exact: dict[tuple, float] = {}
        with Sampler(params, backend.n_vocab) as sampler:
            def walk(prefix, prob):
                if len(prefix) == 4:
                    exact[tuple(prefix)] = prob
                    return
                backend.clear()
                p = sampler.probs(backend.decode(context + prefix))
                for t in map(int, np.nonzero(p)[0]):
                    if backend.is_eog(t):
                        exact[(*prefix, "eos")] = exact.get((*prefix, "eos"), 0.0) + prob * float(p[t])
                    else:
                        walk(prefix + [t], prob * float(p[t]))
            walk([], 1.0)
        assert abs(sum(exact.values()) - 1.0) < 1e-4
        n, counts, drafted = 1200, {}, 0
        for seed in range(n):
            r = engine.generate(prompt, max_tokens=4, seed=seed, **kw)
            key = (*r.tokens, "eos") if r.stats.stop_reason == "eos" else tuple(r.tokens)
            counts[key] = counts.get(key, 0) + 1
            drafted += r.stats.spec.drafted
    # (random models: most of their text merges into the context's last tokens or is not UTF-8)
    assert drafted > n // 20, f"only {drafted} draft tokens in {n} generations"
    assert set(counts) <= set(exact)
    # cells expected fewer than 5 times go into one bin
    big = [k for k, p in exact.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    expected = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < _chi2_critical(len(cells) - 1), f"chi-square {chi2:.1f} over {len(cells)} cells"


# -- specialized drafters: a trimmed vocabulary ----------------------------------------


@pytest.mark.parametrize("target, backend", [("tiny_llama_path", "native"), ("tiny_llama_path", "llama"),
                                             ("tiny_qwen2_path", "native")])
def test_a_trimmed_drafter_proposes_target_ids(target, trimmed_llama, backend, request):
    """Its proposals are the target ids of its tokens, fed the target's text
    through the map; on the batch-invariant native engine greedy output is
    the plain output (a llama target, and a qwen2 one over the same tokenizer)."""
    with Engine(str(request.getfixturevalue(target)), backend=backend, threads=1, n_ctx=512, drafter="model",
                draft_model=str(trimmed_llama)) as e:
        spec = e.generate(LONG_TEXT[:200], max_tokens=48, temperature=0)
        plain = e.generate(LONG_TEXT[:200], max_tokens=48, temperature=0, drafter="none")
        model = spec.stats.spec.drafters["model"]
        assert model["mode"] == model_drafter.TRIMMED and spec.stats.spec.drafted > 0
        if backend == "native":
            assert spec.tokens == plain.tokens


def test_a_trimmed_drafter_maps_ids_both_ways(tiny_llama_path, trimmed_llama, tiny_vocab_path):
    keep = _trimmed_keep(tiny_vocab_path)
    with open_backend("native", tiny_llama_path, n_ctx=512, threads=1) as target:
        d = _drafter(target, trimmed_llama)
        try:
            m = d._map
            assert m.target_ids(range(len(keep))) == keep
            assert m.drafter_ids(keep) == list(range(len(keep)))
            dropped = next(t for t in range(target.n_vocab) if t not in set(keep))
            assert m.drafter_ids([dropped]) == [0]   # unk_id
            d.begin(target.tokenize(LONG_TEXT[:120]), SamplingParams(temperature=0))
            draft = d.draft(target.tokenize(LONG_TEXT[:120]), 4)
            assert len(draft) and set(draft.tokens) <= set(keep)
        finally:
            d.close()


@pytest.mark.parametrize("keys, match", [
    ({"edgespec.drafter.target_vocab": "0" * 64, "edgespec.drafter.target": "some-model"},
     "trained for some-model, whose vocabulary differs from the target's, tiny-llama "),
    ({"edgespec.drafter.unk_id": 100000}, "unk_id must be one of its token ids"),
])
def test_a_trimmed_drafter_for_another_vocabulary_or_with_bad_keys_is_refused(
        tiny_llama_path, tiny_vocab_path, tmp_path, keys, match):
    path = tmp_path / "bad.gguf"
    write_trimmed_drafter(path, tiny_vocab_path, _trimmed_keep(tiny_vocab_path), keys=keys)
    with open_backend("native", tiny_llama_path, n_ctx=512, threads=1) as target:
        with pytest.raises(IncompatibleDraftModelError, match=match):
            _drafter(target, path)


@pytest.mark.parametrize("edit, match", [
    (lambda keep: keep[:-1] + [keep[0]], "names a target token twice"),
    (lambda keep: keep[:-1] + [10 ** 6], "outside the target's vocabulary"),
])
def test_a_bad_token_map_is_refused(tiny_llama_path, tiny_vocab_path, tmp_path, edit, match):
    keep = _trimmed_keep(tiny_vocab_path)
    path = tmp_path / "bad-map.gguf"
    write_trimmed_drafter(path, tiny_vocab_path, keep, keys={"edgespec.drafter.token_map": edit(keep)})
    with open_backend("native", tiny_llama_path, n_ctx=512, threads=1) as target:
        with pytest.raises(IncompatibleDraftModelError, match=match):
            _drafter(target, path)


def test_a_trimmed_draft_head_drafts_only_its_tokens_and_keeps_greedy_output(tiny_llama_path, head_ranking):
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="model",
                draft_model=str(tiny_llama_path), draft_vocab=256, draft_max=4) as engine:
        kept = set(head_ranking[:256].tolist())
        drafted = []
        real = model_drafter.ModelDrafter.draft

        def spy(self, context, max_tokens):
            d = real(self, context, max_tokens)
            drafted.extend(d.tokens)
            return d

        model_drafter.ModelDrafter.draft = spy
        try:
            plain = engine.generate(LONG_TEXT[:200], max_tokens=48, drafter="none")
            spec = engine.generate(LONG_TEXT[:200], max_tokens=48)
        finally:
            model_drafter.ModelDrafter.draft = real
        assert spec.tokens == plain.tokens
        assert drafted and set(drafted) <= kept
        assert engine.lanes[0].drafters["model"].backend.output_rows == 256


def test_draft_vocab_refusals(tiny_llama_path, other_vocab_llama, head_ranking, tmp_path, monkeypatch):
    with pytest.raises(InvalidArgumentError, match=r"draft_vocab \(--draft-vocab\) must be in \[256, 515\]"):
        Engine(str(tiny_llama_path), backend="native", threads=1, drafter="model",
               draft_model=str(tiny_llama_path), draft_vocab=600)
    with pytest.raises(InvalidArgumentError, match="cross-tokenizer draft"):
        Engine(str(tiny_llama_path), backend="native", threads=1, drafter="model",
               draft_model=str(other_vocab_llama), draft_vocab=256)
    with pytest.raises(InvalidArgumentError, match="needs the draft model on the native backend"):
        Engine(str(tiny_llama_path), backend="native", threads=1, drafter="model", draft_backend="llama",
               draft_model=str(tiny_llama_path), draft_vocab=256)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "empty"))
    with pytest.raises(InvalidArgumentError, match="edgespec drafter rank --model"):
        Engine(str(tiny_llama_path), backend="native", threads=1, drafter="model",
               draft_model=str(tiny_llama_path), draft_vocab=256)


def test_vocabulary_fingerprint_read_whole_equals_the_per_token_one(tiny_vocab_path):
    """The fingerprint hashed over the file's token bytes at once is
    specialized.vocab_fingerprint of the texts, as shipped drafters record it."""
    from edgespec.drafters import specialized

    with Vocab.load(tiny_vocab_path) as v:
        whole = model_drafter._Vocabulary(v)
        texts = [v.token_text(t) for t in range(v.n_vocab)]
    assert whole.fingerprint == specialized.vocab_fingerprint(texts) == specialized.vocab_fingerprint(whole.texts)
