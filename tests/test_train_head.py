"""`edgespec drafter train-head` end to end on the tiny llama: the target's
features collected (text and its own continuations), checksummed and
resumable; the head trained (PyTorch) and exported; the C head computing
what was trained; the trained head drafting with output identical to plain
decoding and accepted more than an untrained one; a run killed with -9
going on from its checkpoint; bad input as one line, exit 2.

Training text is tests/data/routing (real text, see its SOURCES.txt)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgespec import Engine
from edgespec.backends import native, open_backend
from edgespec.costs import MAX_BATCH, DraftCost
from edgespec.drafters import head as head_drafter
from edgespec.drafters.head import DRAFT_VOCAB_KEY, random_head, recipe
from edgespec.errors import DrafterError, IncompatibleDraftModelError, InvalidArgumentError
from edgespec.models.gguf import GGUFFile
from edgespec.planner import Planner
from edgespec.training import head, network
from edgespec.training.train import load_checkpoint
from processes import killed_when
from test_drafter_train import run_cli

TEXT = str(Path(__file__).parent / "data" / "routing" / "python.txt")
# A head small enough to train in seconds: the tiny llama's width, a narrow feed-forward.
SMALL = dict(lang="python", sources=[TEXT], ctx=64, n_ff=64, quant="f16", window=32, batch_rows=256,
             draft_vocab=1 << 20, threads=1)
# A batch cost curve on which drafting pays, so that the planner drafts from the first step.
CHEAP_BATCHES = [0.0] + [1.0 + 0.05 * (k - 1) for k in range(1, MAX_BATCH + 1)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama_path) -> Path:
    """A head trained for 20 s on the tiny llama's features of python.txt."""
    out = tmp_path_factory.mktemp("head") / "py.gguf"
    head.train_head_model(str(tiny_llama_path), out, head.HeadParams(**SMALL, minutes=1 / 3), progress=False)
    return out


def test_features_are_the_targets_hidden_states(trained, tiny_llama_path):
    data = head.FeatureSet(trained.with_suffix(".data"))
    data.verify()
    seqs = data.sequences()
    assert len(seqs) == data.manifest["sequences"] > 10 and all(s.start == 0 for s in seqs)
    assert data.manifest["tokens"] == sum(len(s.tokens) for s in seqs)
    with open_backend("native", tiny_llama_path, n_ctx=64, n_batch=64, threads=1) as target:
        want = target.hidden_states([seqs[3].tokens.tolist()])[0]
    np.testing.assert_allclose(seqs[3].features.astype(np.float32), want, rtol=2e-3, atol=2e-3)


def best_trained_head(trained: Path, tiny_llama_path: Path):
    """The PyTorch head of ``trained``'s checkpoint's best state, a sequence
    of its features and the target's token embeddings (n_vocab, n_embd)."""
    seq = head.FeatureSet(trained.with_suffix(".data")).sequences()[5]
    with GGUFFile(tiny_llama_path) as f:
        shape = replace(network.read_shape(f), n_layer=1, n_ff=64)
        embd = f.tensor("token_embd.weight").dequantize()
    model = head.build_head(shape)
    model.load_state_dict(load_checkpoint(trained.with_suffix(".ckpt"))["progress"]["best_state"])
    return model, seq, embd


def test_the_c_head_computes_what_was_trained(trained, tiny_llama_path):
    """The exported file, run by the C core row by row (as it drafts), against
    the PyTorch head of the checkpoint's best state (f16 weights: close)."""
    torch = pytest.importorskip("torch")
    model, seq, embd = best_trained_head(trained, tiny_llama_path)
    tokens, features, n = seq.tokens.astype(np.int64), seq.features.astype(np.float32), 40
    with torch.no_grad():
        want = model(torch.from_numpy(features[:n])[None], torch.from_numpy(embd[tokens[1:n + 1]])[None])[0].numpy()
    with open_backend("native", tiny_llama_path, n_ctx=128, n_batch=64, threads=1) as target:
        h = target.open_head(trained)
        for i in range(n):
            h.decode(features[i:i + 1], tokens[i + 1:i + 2].tolist(), 0)
            np.testing.assert_allclose(h.hidden()[-1], want[i], atol=0.02 * np.abs(want[i]).max())


def test_chain_steps_are_trained_as_the_head_drafts_them(tiny_llama_path):
    """Step j of the training's chains (all rows at once, under a mask) is
    what the head computes drafting a chain from one root: the real rows up
    to the root, then its own guesses, causally."""
    torch = pytest.importorskip("torch")
    with GGUFFile(tiny_llama_path) as f:
        shape = replace(network.read_shape(f), n_layer=1, n_ff=64)
    torch.manual_seed(0)
    model = head.build_head(shape)
    T, D = 12, shape.n_embd
    f, e = torch.randn(1, T, D), torch.randn(1, T, D)
    seen = {}
    real = model.forward

    def spy(features, embeddings, start=0, past=None, keep_kv=False):
        out = real(features, embeddings, start, past, keep_kv)
        seen[start] = (out[0] if keep_kv else out).detach()
        return out

    model.forward = spy
    with torch.no_grad():
        head._losses(model, torch.randn(5, D), f, e, torch.randn(1, T, D), torch.ones(1, T, dtype=torch.bool), 0.0, 3)
        model.forward = real
        for root in (0, 4, 8):
            g2 = real(torch.cat([f[:, :root + 1], seen[0][:, root:root + 1]], 1), e[:, :root + 2])[:, -1]
            torch.testing.assert_close(seen[1][:, root], g2, atol=1e-5, rtol=1e-4)
            g3 = real(torch.cat([f[:, :root + 1], seen[0][:, root:root + 1], g2[:, None]], 1), e[:, :root + 3])[:, -1]
            torch.testing.assert_close(seen[2][:, root], g3, atol=1e-5, rtol=1e-4)


def test_bfloat16_products_give_float32_s_losses(trained, tiny_llama_path):
    """Where the CPU multiplies bfloat16 (network.bf16_matmuls) the head
    trains under autocast: on the same rows its losses and gradient are
    float32's within bfloat16's rounding; the recipe says which it was."""
    torch = pytest.importorskip("torch")
    model, seq, embd = best_trained_head(trained, tiny_llama_path)
    tokens, n = seq.tokens.astype(np.int64), 40
    f = torch.from_numpy(seq.features[:n + 1].astype(np.float32))[None]
    e = torch.from_numpy(embd[tokens[1:n + 1]])[None]
    W = torch.from_numpy(embd[:200])
    runs = []
    for bf16 in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            reg, tok, _, _ = head._losses(model, W, f[:, :-1], e, f[:, 1:], torch.ones(1, n, dtype=torch.bool), 0.0, 2)
        (reg + head.TOKEN_LOSS_WEIGHT * tok).backward()
        runs.append((reg.item(), tok.item(), model.blk[0].ffn_down.weight.grad.clone()))
    (reg32, tok32, g32), (reg16, tok16, g16) = runs
    assert reg16 == pytest.approx(reg32, rel=0.03) and tok16 == pytest.approx(tok32, rel=0.03)
    assert float(torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0)) > 0.98
    assert recipe(trained)["precision"] == ("bf16" if network.bf16_matmuls() else "f32")


def test_the_file_says_how_it_was_made(trained):
    r = recipe(trained)
    assert r["lang"] == "python" and r["mode"] == "text" and r["steps"] > 0 and r["rows_seen"] > 0
    assert r["data"][0]["tokens"] == head.FeatureSet(trained.with_suffix(".data")).manifest["tokens"]
    assert 0 < r["held_out_agreement"] <= 1 and r["curve"][-1][0] <= r["rows_seen"]
    with GGUFFile(trained) as f:
        assert f.get(DRAFT_VOCAB_KEY) is None   # trained on every row: the drafter computes every row


def test_a_trained_head_drafts_losslessly_and_beats_an_untrained_one(trained, tiny_llama_path, tmp_path):
    untrained = tmp_path / "random.gguf"
    random_head(tiny_llama_path, untrained, n_ff=64, seed=1)
    prompt = Path(TEXT).read_text()[-300:]
    accepted = {}
    for name, path in (("trained", trained), ("untrained", untrained)):
        with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, head=str(path),
                    draft_max=4) as engine:
            plain = engine.generate(prompt, max_tokens=300, drafter="none")
            engine.lanes[0].planner = Planner(CHEAP_BATCHES)
            spec = engine.generate(prompt, max_tokens=300, drafter="head")
        assert spec.tokens == plain.tokens   # past 256 positions of the head's cache
        accepted[name] = spec.stats.spec.accepted
    assert accepted["trained"] > 2 * accepted["untrained"] + 5, accepted


def test_generate_mode_learns_the_targets_own_continuations(tmp_path, tiny_llama_path):
    out = tmp_path / "g.gguf"
    p = head.HeadParams(**{**SMALL, "ctx": 48}, mode="generate", prompt_tokens=16, tokens=400, minutes=0.02)
    head.train_head_model(str(tiny_llama_path), out, p, progress=False)
    seqs = head.FeatureSet(out.with_suffix(".data")).sequences()
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=128, drafter="none") as engine:
        for s in seqs[:2]:
            prompt = s.tokens[:s.start + 1].tolist()
            assert s.start == 15
            assert s.tokens[s.start + 1:].tolist() == engine.generate(prompt, max_tokens=48 - 16,
                                                                      temperature=0).tokens


def test_questions_mode_answers_the_targets_own_questions_batched(tmp_path, tiny_llama_path):
    """questions: each sequence is the target's answer, through its chat
    template, to a question it wrote itself about the text (or, when no
    question came, to a request about the text); collected
    COLLECT_PARALLEL at a time, exactly what one at a time collects."""
    p = head.HeadParams(**{**SMALL, "ctx": 64}, mode="questions", prompt_tokens=16, tokens=500, minutes=0.01)
    sets = {}
    for parallel in (head.COLLECT_PARALLEL, 1):
        with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=128, drafter="none",
                    parallel=parallel) as engine:
            sets[parallel] = head.collect(engine, "tiny", tmp_path / f"p{parallel}", p, progress=False).sequences()
    together, alone = sets[head.COLLECT_PARALLEL], sets[1]
    assert len(together) == len(alone) >= head.COLLECT_PARALLEL + 1
    for a, b in zip(together, alone):
        assert a.start == b.start and a.tokens.tolist() == b.tokens.tolist()
        assert np.array_equal(a.features, b.features)
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=128, drafter="none") as engine:
        for i, s in enumerate(alone[:3]):
            prompt = s.tokens[:s.start + 1].tolist()
            # one user message through the template (the text without its special tokens: user\n...\nassistant\n)
            shown = engine.detokenize(prompt)
            assert shown.startswith("user\n") and shown.endswith("\nassistant\n"), shown
            assert prompt == head._chat(engine, shown[len("user\n"):-len("\nassistant\n")])
            assert s.tokens[s.start + 1:].tolist() == engine.generate(prompt, max_tokens=64 - len(prompt),
                                                                      temperature=0).tokens


def test_the_question_is_the_first_line_of_the_targets_answer():
    assert head.first_question('  "What makes bread rise?"\nIt is the yeast.') == "What makes bread rise?"
    assert head.first_question("**Why is the sea salty?**") == "Why is the sea salty?"
    assert head.first_question("Why?\nBecause the question above is too short.") is None
    assert head.first_question("") is None


def test_a_collection_killed_with_9_resumes_from_its_last_shard(tmp_path, tiny_llama_path):
    script = """if True:
        import sys, time
        from edgespec.backends import native
        from edgespec.training import head
        head.CHECKPOINT_SECONDS = 0.2
        real = native.BACKEND.hidden_states
        native.BACKEND.hidden_states = lambda self, *a: (time.sleep(0.1), real(self, *a))[1]
        head.train_head_model(sys.argv[1], sys.argv[2], head.HeadParams(lang="python", sources=[sys.argv[3]],
                              ctx=64, threads=1), progress=False)
    """
    out = tmp_path / "k.gguf"
    manifest = out.with_suffix(".data") / head.MANIFEST
    killed_when(script, lambda: manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2,
                 tiny_llama_path, out, TEXT)
    done = head.FeatureSet(out.with_suffix(".data"))
    done.verify()
    n = done.manifest["sequences"]
    assert 0 < n < done.manifest["sequences_total"]
    head.train_head_model(str(tiny_llama_path), out, head.HeadParams(**SMALL, minutes=0.01), progress=False)
    whole = head.FeatureSet(out.with_suffix(".data"))
    assert whole.manifest["sequences"] == whole.manifest["sequences_total"]
    assert whole.manifest["shards"][:len(done.manifest["shards"])] == done.manifest["shards"]


def test_a_training_killed_with_9_resumes_from_its_checkpoint(tmp_path, tiny_llama_path, trained):
    script = """if True:
        import sys
        from pathlib import Path
        from edgespec.training import head
        head.CHECKPOINT_SECONDS = 0.3
        p = head.HeadParams(lang="python", sources=[sys.argv[3]], ctx=64, n_ff=64, quant="f16", window=32,
                            batch_rows=256, draft_vocab=1 << 20, threads=1, minutes=5)
        head.train_head_model(sys.argv[1], sys.argv[2], p, data=sys.argv[4], progress=False)
    """
    out = tmp_path / "k.gguf"
    ckpt = out.with_suffix(".ckpt")
    killed_when(script, ckpt.exists, tiny_llama_path, out, TEXT, trained.with_suffix(".data"))
    saved = load_checkpoint(ckpt)["progress"]
    assert saved["step"] > 0
    p = head.HeadParams(**SMALL, minutes=(saved["seconds"] + 1) / 60)
    resumed = head.train_head_model(str(tiny_llama_path), out, p, data=trained.with_suffix(".data"), progress=False)
    assert resumed.steps > saved["step"] and resumed.seconds >= saved["seconds"] + 0.5
    with pytest.raises(InvalidArgumentError, match="other options or data"):
        head.train_head_model(str(tiny_llama_path), out, replace(p, n_ff=96), data=trained.with_suffix(".data"),
                              progress=False)


def test_a_training_stopped_with_sigterm_keeps_and_exports_its_work(tmp_path, tiny_llama_path, trained):
    """kill (SIGTERM), as a background run is stopped: the checkpoint and the
    head of the best state so far are written before it exits."""
    script = """if True:
        import sys
        from edgespec.training import head
        p = head.HeadParams(lang="python", sources=[sys.argv[3]], ctx=64, n_ff=64, quant="f16", window=32,
                            batch_rows=256, draft_vocab=1 << 20, threads=1, minutes=5)
        head.train_head_model(sys.argv[1], sys.argv[2], p, data=sys.argv[4], progress=False)
    """
    out = tmp_path / "t.gguf"
    proc = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama_path), str(out), TEXT,
                             str(trained.with_suffix(".data"))])
    try:
        time.sleep(8)
        assert proc.poll() is None
        proc.terminate()
        assert proc.wait(60) == -signal.SIGINT   # an uncaught KeyboardInterrupt, after the finally
    finally:
        proc.kill()
    assert load_checkpoint(out.with_suffix(".ckpt"))["progress"]["step"] > 0
    with open_backend("native", tiny_llama_path, n_ctx=64, threads=1) as target:
        target.open_head(out).close()


def test_damaged_features_are_refused(tmp_path, trained):
    folder = tmp_path / "d"
    folder.mkdir()
    src = trained.with_suffix(".data")
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    shard = folder / head.FeatureSet(folder).manifest["shards"][0]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    with pytest.raises(DrafterError, match=f"{shard}: its size or sha256 differs"):
        head.FeatureSet(folder).verify()


def test_a_head_over_30_mb_is_refused():
    qwen_15b = network.NetShape(arch="qwen2", n_vocab=151936, n_embd=1536, n_layer=1, n_head=12, n_head_kv=2,
                                n_ff=8960, eps=1e-6, rope_base=1e6, qkv_bias=True)
    head.check_size(qwen_15b, head.HeadParams(lang="eng", n_ff=2048, quant="q8_0"))   # the default: 21 MB
    with pytest.raises(InvalidArgumentError, match="takes 55 MB, over 30 MB"):
        head.check_size(qwen_15b, head.HeadParams(lang="eng", n_ff=8960, quant="q8_0"))


def test_train_head_bad_input(monkeypatch, capsys, tmp_path, tiny_llama_path, tiny_qwen3_path, trained):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    base = ["drafter", "train-head", "--model", str(tiny_llama_path), "--minutes", "0.01"]
    out = ["--out", str(tmp_path / "h.gguf")]
    for args, says in (
            (["--lang", "python", "--source", str(empty), *out], "hold no text"),
            (["--lang", "x y", "--source", TEXT, *out], "--lang must be"),
            (["--lang", "python", "--source", TEXT, "--mode", "poem", *out], "--mode must be one of"),
            (["--lang", "python", "--source", TEXT, "--out", str(tmp_path / "h.bin")], "--out must name a .gguf"),
            (["--lang", "python", "--source", TEXT, "--out", str(tmp_path / "no" / "h.gguf")], "no such folder"),
            (["--lang", "python", "--source", TEXT, "--ctx", "64", "--prompt-tokens", "60", "--mode", "chat", *out],
             "--prompt-tokens must be"),
            (["--lang", "python", "--source", TEXT, "--data", str(tmp_path), *out], "without features.json"),
            (["--lang", "python", "--source", TEXT, "--init", str(tmp_path / "none.ckpt"), *out], "no such file"),
            (["--lang", "python", "--source", TEXT, "--data", str(trained.with_suffix(".data")), "--init",
              TEXT, *out], "not an edgespec drafter checkpoint"),
            (["--lang", "python", "--source", TEXT, "--data", str(trained.with_suffix(".data")), "--init",
              str(tiny_llama_path), *out], "neither a draft head's checkpoint nor a head file"),
            (["--lang", "python", "--source", TEXT, "--data", str(trained.with_suffix(".data")), "--init",
              str(trained), *out], "a head of another shape"),
    ):
        code, _, err = run_cli(monkeypatch, capsys, *base, *args)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)
    code, _, err = run_cli(monkeypatch, capsys, "drafter", "train-head", "--model", str(tiny_qwen3_path),
                           "--lang", "python", "--source", TEXT, *out)
    assert code == 2 and "cannot be trained for a qwen3 model" in err, err


def test_auto_routes_a_request_to_the_head_of_its_language(trained, tiny_llama_path, tmp_path, monkeypatch):
    """A head in a target's drafter set is routed as a specialized drafter
    is: by its language's profile (python.txt's), drafting under its file's
    name; greedy output stays plain decoding's; German prose gets it with
    no confidence, so it never drafts. The head here is as costly as the tiny target; the planner is
    told it costs what a real one does beside a real target (3%)."""
    monkeypatch.setattr(head_drafter, "head_cost", lambda *a: DraftCost(per_token=0.03, catch_up=0.005))
    real = Planner.record_draft_time
    monkeypatch.setattr(Planner, "record_draft_time", lambda self, key, seconds, n: real(
        self, key, seconds * (0.03 if key.startswith("specialized:") else 1.0), n))
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "python.gguf").write_bytes(trained.read_bytes())
    german = (Path(TEXT).parent / "deu.txt").read_text()[:400]
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                drafter_dir=str(folder), draft_max=4) as engine:
        engine.lanes[0].planner = Planner(CHEAP_BATCHES)
        for prompt, code in ((Path(TEXT).read_text()[-300:], True), (german, False)):
            spec = engine.generate(prompt, max_tokens=120)
            assert spec.tokens == engine.generate(prompt, max_tokens=120, drafter="none").tokens
            stats = spec.stats.spec
            assert stats.specialized == "python" and stats.drafters["specialized:python"]["head"] == "python.gguf"
            if code:
                assert stats.per_drafter["specialized:python"]["accepted"] > 0
            else:   # the only member, but prose for a code head: a prior too low to draft
                assert stats.drafters["specialized:python"]["confidence"] == 0.0
                assert "specialized:python" not in stats.per_drafter


def test_a_head_of_known_cost_opens_only_when_first_asked(trained, tiny_llama_path, tmp_path, monkeypatch):
    """Heads in a drafter set cost nothing at load once their cost is known:
    a request routed elsewhere (or answered in one token) never opens one."""
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "python.gguf").write_bytes(trained.read_bytes())
    german = (Path(TEXT).parent / "deu.txt").read_text()[:400]
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                drafter_dir=str(folder)) as engine:
        engine.generate(german, max_tokens=2)   # measures its cost once (the cache)
    opened = []
    real = native.BACKEND.open_head
    monkeypatch.setattr(native.BACKEND, "open_head", lambda self, *a, **k: opened.append(a) or real(self, *a, **k))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                drafter_dir=str(folder)) as engine:
        engine.generate(german, max_tokens=8)
    assert opened == []


def test_a_head_trains_on_several_feature_sets(tmp_path, tiny_llama_path, trained):
    """--data repeatable: this run's collection (the first) and earlier ones,
    trained on together and named in the recipe; a set of another target's
    features is refused naming it."""
    out = tmp_path / "m.gguf"
    p = head.HeadParams(**{**SMALL, "ctx": 48}, mode="generate", prompt_tokens=16, tokens=300, minutes=0.02)
    head.train_head_model(str(tiny_llama_path), out, p, data=[tmp_path / "gen", trained.with_suffix(".data")],
                          progress=False)
    made = recipe(out)
    assert [(x["mode"], x["tokens"]) for x in made["data"]] == [
        ("generate", head.FeatureSet(tmp_path / "gen").manifest["tokens"]),
        ("text", head.FeatureSet(trained.with_suffix(".data")).manifest["tokens"])]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in trained.with_suffix(".data").iterdir():
        (foreign / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((foreign / head.MANIFEST).read_text())
    manifest.update(target="other", target_vocab="0" * 16)
    (foreign / head.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InvalidArgumentError, match=f"{foreign} holds features of other, not of"):
        head.train_head_model(str(tiny_llama_path), tmp_path / "f.gguf", p, data=[tmp_path / "gen", foreign],
                              progress=False)


def test_a_head_starts_from_another_runs_checkpoint(tmp_path, tiny_llama_path, trained):
    """--init: a new run (other data: the target's continuations) starts
    from the trained head's weights, not from scratch: with the same few
    steps it agrees with the target more than a run from scratch; the recipe
    names where it started; a killed --init run goes on from its own
    checkpoint; a checkpoint of another shape, or no checkpoint, is refused."""
    gen = [tmp_path / "gen", trained.with_suffix(".data")]
    p = head.HeadParams(**{**SMALL, "ctx": 48}, mode="generate", prompt_tokens=16, tokens=300, minutes=0.005)
    fresh = head.train_head_model(str(tiny_llama_path), tmp_path / "fresh.gguf", p, data=gen, progress=False)
    started = head.train_head_model(str(tiny_llama_path), tmp_path / "init.gguf", p, data=gen,
                                    init=trained.with_suffix(".ckpt"), progress=False)
    before = load_checkpoint(trained.with_suffix(".ckpt"))["progress"]
    assert started.held_out_agreement > fresh.held_out_agreement + 0.1, (started, fresh)
    made = recipe(tmp_path / "init.gguf")
    assert made["init"] == {"file": "py.ckpt", "lang": "python", "data_digest": load_checkpoint(
        trained.with_suffix(".ckpt"))["data"], "rows_seen": before["rows"],
        "held_out_agreement": round(before["best"], 4)}
    assert "init" not in recipe(tmp_path / "fresh.gguf")
    # Its own checkpoint now exists: a later run goes on from it, --init or not.
    again = head.train_head_model(str(tiny_llama_path), tmp_path / "init.gguf", replace(p, minutes=0.01),
                                  data=gen, init=trained.with_suffix(".ckpt"), progress=False)
    assert again.steps > started.steps and recipe(tmp_path / "init.gguf")["init"] == made["init"]
    with pytest.raises(InvalidArgumentError, match="a head of another shape"):
        head.train_head_model(str(tiny_llama_path), tmp_path / "wide.gguf", replace(p, n_ff=96), data=gen,
                              init=trained.with_suffix(".ckpt"), progress=False)
    with pytest.raises(InvalidArgumentError, match="no such file"):
        head.train_head_model(str(tiny_llama_path), tmp_path / "x.gguf", p, data=gen,
                              init=tmp_path / "missing.ckpt", progress=False)


def test_a_head_starts_from_a_head_file(tmp_path, tiny_llama_path, tiny_qwen2_path, trained):
    """--init HEAD.gguf (a shipped head, trained further): its weights,
    dequantized, are where the run starts; the recipe names the file and
    what its own recipe says; a head of another target is refused naming it."""
    gen = [tmp_path / "gen", trained.with_suffix(".data")]
    p = head.HeadParams(**{**SMALL, "ctx": 48}, mode="generate", prompt_tokens=16, tokens=300, minutes=0.005)
    fresh = head.train_head_model(str(tiny_llama_path), tmp_path / "fresh.gguf", p, data=gen, progress=False)
    started = head.train_head_model(str(tiny_llama_path), tmp_path / "more.gguf", p, data=gen, init=trained,
                                    progress=False)
    assert started.held_out_agreement > fresh.held_out_agreement + 0.1, (started, fresh)
    was = recipe(trained)
    assert recipe(tmp_path / "more.gguf")["init"] == {
        "file": trained.name, "lang": "python", "data_digest": was["data_digest"], "rows_seen": was["rows_seen"],
        "held_out_agreement": was["held_out_agreement"]}
    other = tmp_path / "other.gguf"
    random_head(tiny_qwen2_path, other, n_ff=SMALL["n_ff"])
    with pytest.raises(IncompatibleDraftModelError, match="made for .*, not tiny-llama.gguf"):
        head.train_head_model(str(tiny_llama_path), tmp_path / "o.gguf", p, data=gen, init=other, progress=False)


# -- the shipped heads (models tier) -----------------------------------------------------------

SHIPPED_HEAD_PROMPTS = {
    "eng": [{"role": "user", "content": "Why do leaves change colour in autumn? Explain it to a curious child."}],
    "deu": [{"role": "user", "content": "Translate the following text into English:\n\nDer Zug hatte zwanzig "
                                        "Minuten Verspätung, weil ein Baum auf die Gleise gefallen war. Die "
                                        "Reisenden warteten geduldig und tranken Kaffee am Bahnsteig."}],
    "zho": [{"role": "user", "content": "Translate the following text into English:\n\n昨天下午突然下起了大雨，街上的"
                                        "行人纷纷躲进商店。雨停以后，孩子们跑到公园里踩水坑，笑声传得很远。"}],
    "python": [{"role": "user", "content": "Finish this function:\n\ndef moving_average(values, window):\n"
                                           "    \"\"\"The mean of each run of `window` values, in order.\"\"\"\n"
                                           "    if window <= 0:\n        raise ValueError('window must be "
                                           "positive')\n    sums = [0]\n    for v in values:\n"}],
}


def test_shipped_heads_serve_qwen_coder(qwen_coder_15b_path, monkeypatch, capsys):
    """Every shipped head is listed for its target, under the 30 MB cap, with
    its recipe; auto routes a request of its language (our own, not a
    suite's) to it, and the output is plain decoding's."""
    code, out, err = run_cli(monkeypatch, capsys, "drafter", "list", "--model", "qwen2.5-coder-1.5b", "--json")
    assert code == 0, err
    heads = [json.loads(line) for line in out.splitlines() if "-head.gguf" in line]
    assert sorted(h["langs"][0] for h in heads) == sorted(SHIPPED_HEAD_PROMPTS)
    with Engine("qwen2.5-coder-1.5b", threads=2) as engine:
        for info in heads:
            assert info["problem"] is None and info["size"] <= head.MAX_HEAD_BYTES and "held-out" in info["recipe"]
            lang = info["langs"][0]
            plain = engine.generate(messages=SHIPPED_HEAD_PROMPTS[lang], max_tokens=48, drafter="none")
            routed = engine.generate(messages=SHIPPED_HEAD_PROMPTS[lang], max_tokens=48, drafter="auto")
            assert routed.tokens == plain.tokens
            assert routed.stats.spec.specialized == Path(info["file"]).stem, routed.stats.spec.drafters
        # A raw completion of Python (no chat template) goes to the Python head too.
        prompt = "def merge_intervals(intervals):\n    \"\"\"Merge overlapping [start, end] intervals.\"\"\"\n"
        plain = engine.generate(prompt, max_tokens=32, drafter="none")
        routed = engine.generate(prompt, max_tokens=32, drafter="auto")
        assert routed.tokens == plain.tokens and routed.stats.spec.specialized == "python-head"


def test_a_head_in_the_set_stays_out_of_auto_on_the_llama_backend(trained, tiny_llama_path, tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "python.gguf").write_bytes(trained.read_bytes())
    prompt = Path(TEXT).read_text()[-300:]
    with pytest.warns(UserWarning, match="native backend's features, not the llama backend's"):
        with Engine(str(tiny_llama_path), backend="llama", threads=1, n_ctx=512, drafter="auto",
                    drafter_dir=str(folder)) as engine:
            spec = engine.generate(prompt, max_tokens=24)
            assert spec.tokens == engine.generate(prompt, max_tokens=24, drafter="none").tokens
    assert spec.stats.spec.specialized is None
