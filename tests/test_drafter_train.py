"""Specialized drafters made by edgespec itself: `edgespec drafter distill`
(the target's top-k soft labels, checksummed shards, resumable, benchmark
text held out) and `edgespec drafter train` (PyTorch: text, then the labels;
checkpoints; a llama GGUF out), end to end on the tiny random target:
distil -> train -> export -> load in the native engine and in llama.cpp ->
speculate with output identical to plain decoding.

Training text is tests/data/routing (real text, see its SOURCES.txt)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import edgespec
from edgespec import Engine, cli
from edgespec.backends import open_backend
from edgespec.capi import ffi
from edgespec.drafters import specialized
from edgespec.training import corpus, distill, train
from edgespec.drafters.model import target_fingerprint
from edgespec.errors import DrafterError, InvalidArgumentError
from edgespec.models.gguf import GGUFFile
from processes import killed_when

DATA = Path(__file__).parent / "data" / "routing"
TEXT = str(DATA / "python.txt")
# A drafter small enough to train in seconds.
TINY_SHAPE = ["--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--n-head-kv", "2", "--n-ff", "64",
              "--vocab", "300", "--ctx", "64"]


def run_cli(monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["edgespec", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out = capsys.readouterr()
    return exit_.value.code or 0, out.out, out.err


def distil(monkeypatch, capsys, target, out, *extra) -> dict:
    code, _, err = run_cli(monkeypatch, capsys, "drafter", "distill", "--model", str(target), "--lang", "python",
                           "--source", TEXT, "--out", str(out), "--ctx", "64", "--top-k", "8", "--threads", "1",
                           *extra)
    assert code == 0, err
    return json.loads((out / distill.MANIFEST).read_text())


def records(folder) -> list[tuple]:
    return [(r.tokens.tolist(), r.ids.tolist(), r.probs.tolist()) for r in distill.DistillSet(folder).records()]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, tiny_llama_path) -> Path:
    """The tiny llama's labels of tests/data/routing/python.txt, made by the library."""
    folder = tmp_path_factory.mktemp("distilled") / "py"
    with open_backend("native", tiny_llama_path, n_ctx=64, n_batch=64, threads=1) as target:
        distill.distill(target, "tiny", folder, distill.DistillParams(lang="python", sources=[TEXT], top_k=8, ctx=64),
                        fingerprint=target_fingerprint(target), progress=False)
    return folder


# -- distill ------------------------------------------------------------------------------

def test_distill_keeps_the_targets_top_k(distilled, tiny_llama_path):
    """Every position's ids are the target's k likeliest tokens, likeliest
    first, with their softmax probabilities."""
    manifest = distill.DistillSet(distilled).manifest
    assert manifest["tokens"] == manifest["tokens_total"] > 500
    assert manifest["sequences"] == sum(s["sequences"] for s in manifest["shards"])
    recs = list(distill.DistillSet(distilled).records())
    assert sum(len(r.tokens) for r in recs) == manifest["tokens"]
    with open_backend("native", tiny_llama_path, n_ctx=64, n_batch=64, threads=1) as target:
        for r in (recs[0], recs[-1]):
            assert r.ids.shape == (len(r.tokens), 8)
            target.clear()
            addr = target.decode(r.tokens.tolist(), logits_from=0)
            logits = np.frombuffer(ffi.buffer(ffi.cast("float *", addr), 4 * len(r.tokens) * target.n_vocab),
                                   dtype=np.float32).reshape(len(r.tokens), -1)
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            assert np.array_equal(np.sort(r.ids, 1), np.sort(np.argsort(-p, 1, kind="stable")[:, :8], 1))
            assert np.allclose(r.probs.astype(np.float32), np.take_along_axis(p, r.ids, 1), atol=2e-3)
            assert (np.diff(r.probs.astype(np.float32), axis=1) <= 0).all()


def test_distill_resumes_where_it_stopped(monkeypatch, capsys, tmp_path, tiny_llama_path, distilled):
    """A run cut short by --tokens, then one to the end, gives the records one
    run gives; a run on a finished folder adds nothing."""
    out = tmp_path / "d"
    first = edgespec.distill_model(str(tiny_llama_path), out, edgespec.DistillParams(
        lang="python", sources=[TEXT], top_k=8, ctx=64, max_tokens=200), threads=1, progress=False)
    assert 200 <= first["tokens"] < first["tokens_total"]
    second = distil(monkeypatch, capsys, tiny_llama_path, out)
    assert second["tokens"] == second["tokens_total"]
    assert records(out) == records(distilled)
    third = distil(monkeypatch, capsys, tiny_llama_path, out)
    assert third["shards"] == second["shards"]


def test_interrupted_distill_keeps_what_was_labelled(tmp_path, tiny_llama_path, distilled, monkeypatch):
    with open_backend("native", tiny_llama_path, n_ctx=64, n_batch=64, threads=1) as target:
        params = distill.DistillParams(lang="python", sources=[TEXT], top_k=8, ctx=64)
        calls = []
        real = target.decode

        def decode(*a, **k):
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(target, "decode", decode)
        with pytest.raises(KeyboardInterrupt):
            distill.distill(target, "tiny", tmp_path, params, fingerprint=target_fingerprint(target), progress=False)
        assert distill.DistillSet(tmp_path).manifest["sequences"] == 3
        monkeypatch.setattr(target, "decode", real)
        distill.distill(target, "tiny", tmp_path, params, fingerprint=target_fingerprint(target), progress=False)
    assert records(tmp_path) == records(distilled)


def test_a_distill_killed_with_9_resumes_from_its_last_shard(tmp_path, tiny_llama_path, distilled):
    # A shard every 0.2 s, a sequence every 0.1 s: killed after a few shards.
    script = """if True:
        import sys, time
        from edgespec.backends import open_backend, native
        from edgespec.training import distill
        from edgespec.drafters.model import target_fingerprint
        distill.CHECKPOINT_SECONDS = 0.2
        real = native.BACKEND.decode
        native.BACKEND.decode = lambda self, *a, **k: (time.sleep(0.1), real(self, *a, **k))[1]
        with open_backend("native", sys.argv[1], n_ctx=64, n_batch=64, threads=1) as target:
            distill.distill(target, "tiny", sys.argv[2], distill.DistillParams(
                lang="python", sources=[sys.argv[3]], top_k=8, ctx=64),
                fingerprint=target_fingerprint(target), progress=False)
    """
    manifest = tmp_path / distill.MANIFEST
    killed_when(script, lambda: manifest.exists() and json.loads(manifest.read_text())["sequences"] >= 3,
                 tiny_llama_path, tmp_path, TEXT)
    kept = distill.DistillSet(tmp_path).manifest["sequences"]
    assert 3 <= kept < distill.DistillSet(distilled).manifest["sequences"]
    with open_backend("native", tiny_llama_path, n_ctx=64, n_batch=64, threads=1) as target:
        params = distill.DistillParams(lang="python", sources=[TEXT], top_k=8, ctx=64)
        distill.distill(target, "tiny", tmp_path, params, fingerprint=target_fingerprint(target), progress=False)
    assert records(tmp_path) == records(distilled)


def test_damaged_shards_are_reported_with_file_and_position(monkeypatch, capsys, tmp_path, distilled,
                                                            tiny_llama_path):
    for damage, says in (("flip", "record 1 at byte"), ("cut", "truncated")):
        folder = tmp_path / damage
        shutil.copytree(distilled, folder)
        shard = folder / "shard-00000.bin"
        data = bytearray(shard.read_bytes())
        first = next(iter(distill.read_shard(shard)))
        second_record = len(distill.encode_record(first))   # where the second record starts
        if damage == "flip":
            data[second_record + 40] ^= 0x55
        else:
            data = data[:second_record + 40]
        shard.write_bytes(bytes(data))
        with pytest.raises(DrafterError, match=f"{shard}.*{says}" if damage == "flip" else f"{shard}"):
            distill.DistillSet(folder).verify()
        with pytest.raises(DrafterError, match="truncated|checksum"):
            list(distill.read_shard(shard))
        # the CLI: one line, exit 2, the data left as it was (nothing appended past the damage)
        code, _, err = run_cli(monkeypatch, capsys, "drafter", "distill", "--model", str(tiny_llama_path),
                               "--lang", "python", "--source", TEXT, "--out", str(folder), "--ctx", "64",
                               "--top-k", "8", "--threads", "1")
        assert code == 2 and err.startswith("error: ") and str(shard) in err and len(err.splitlines()) == 1
        assert shard.read_bytes() == bytes(data)


def test_distill_bad_input(monkeypatch, capsys, tmp_path, tiny_llama_path, distilled):
    base = ["drafter", "distill", "--model", str(tiny_llama_path), "--out", str(tmp_path / "x")]
    for args, says in ((["--lang", "python", "--source", str(tmp_path / "missing.txt")], "unknown source"),
                       (["--lang", "deu", "--source", "python-stdlib"], "python-stdlib is Python"),
                       (["--lang", "py thon"], "--lang"),
                       (["--lang", "python", "--source", TEXT, "--top-k", "0"], "--top-k"),
                       (["--lang", "python", "--source", TEXT, "--ctx", "8"], "--ctx")):
        code, _, err = run_cli(monkeypatch, capsys, *base, *args)
        assert code == 2 and says in err and len(err.splitlines()) == 1, err
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00abc")
    code, _, err = run_cli(monkeypatch, capsys, *base, "--lang", "python", "--source", str(binary))
    assert code == 2 and "not UTF-8" in err
    # another folder's options: refused, the folder untouched
    before = (distilled / distill.MANIFEST).read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, "drafter", "distill", "--model", str(tiny_llama_path), "--lang",
                           "python", "--source", TEXT, "--out", str(distilled), "--ctx", "64", "--top-k", "4")
    assert code == 2 and "top_k" in err
    assert (distilled / distill.MANIFEST).read_bytes() == before


def test_benchmark_text_is_held_out(tmp_path):
    from edgespec.bench import prompts

    prompt = prompts.load_suite("code")[3].prompt
    own = "def tidy(rows):\n    return [r.strip() for r in rows if r.strip()]\n"
    docs, dropped = corpus.documents([("f", own + "\n\n" + prompt + "\n\n" + own)], corpus.HeldOut.suites())
    text = "".join(d.text for d in docs)
    assert dropped >= 1 and "def tidy" in text
    assert not corpus.HeldOut([text]).overlaps(prompt)
    docs, dropped = corpus.documents([("f", own + "\n\n" + prompt)], None)
    assert dropped == 0 and prompt.strip()[:60] in "".join(d.text for d in docs)


# -- train ----------------------------------------------------------------------------------

def test_train_export_load_and_speculate(monkeypatch, capsys, tmp_path, distilled, tiny_llama_path):
    """distil -> train -> a GGUF the native engine and llama.cpp load as a
    trimmed-vocabulary draft model; greedy output stays the target's."""
    out = tmp_path / "py.gguf"
    code, stdout, err = run_cli(monkeypatch, capsys, "drafter", "train", "--model", str(tiny_llama_path),
                                "--data", str(distilled), "--lang", "python", "--out", str(out),
                                "--minutes", "0.05", "--threads", "1", *TINY_SHAPE)
    assert code == 0, err
    assert stdout.startswith(f"wrote {out}:") and "held-out acceptance" in stdout
    with GGUFFile(out) as f:
        keep = f.get(specialized.KEY_TOKEN_MAP)
        assert f.get(specialized.KEY_LANGS) == ["python"]
        assert 259 <= len(keep) <= 300 and keep == sorted(keep)
        recipe = json.loads(f.get(specialized.KEY_RECIPE))
        assert recipe["steps"] >= 1 and recipe["data"]["tokens"] == distill.DistillSet(distilled).tokens
        assert "drafter train" in recipe["command"]
    prompt = "def load_config(path):\n"
    with Engine(tiny_llama_path, backend="native", threads=1) as plain:
        want = plain.generate(prompt, max_tokens=40, temperature=0).text
    for draft_backend in ("native", "llama"):
        with Engine(tiny_llama_path, backend="native", threads=1, drafter="model", draft_model=str(out),
                    draft_backend=draft_backend) as eng:
            got = eng.generate(prompt, max_tokens=40, temperature=0)
        assert got.text == want
        assert got.stats.spec.drafted > 0


def test_training_raises_held_out_acceptance(tmp_path, distilled, tiny_llama_path):
    params = edgespec.TrainParams(lang="python", minutes=0.15, n_embd=32, n_layer=1, n_head=2, n_head_kv=2, n_ff=64,
                               vocab=300, ctx=64, threads=1)
    result = edgespec.train_model(str(tiny_llama_path), distilled, tmp_path / "a.gguf", params, progress=False)
    state = train.load_checkpoint(tmp_path / "a.ckpt")
    import torch

    torch.manual_seed(0)
    from edgespec.backends.vocab import Vocab
    from edgespec.models.gguf_write import read_gguf

    with Vocab.load(tiny_llama_path) as vocab:
        data = train.prepare_data(vocab, read_gguf(tiny_llama_path), distill.DistillSet(distilled), params,
                                  progress=False)
    fresh = train.build_scratch(train.check_params(params), len(data.token_map))
    before = train.held_out_acceptance(fresh, data.kd_held_out)
    assert result.held_out_acceptance == state["progress"]["best_acceptance"] > before


def test_train_resumes_from_its_checkpoint(tmp_path, distilled, tiny_llama_path):
    params = train.TrainParams(lang="python", minutes=0.03, n_embd=32, n_layer=1, n_head=2, n_head_kv=2, n_ff=64,
                               vocab=300, ctx=64, threads=1)
    out = tmp_path / "r.gguf"
    first = train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    params.minutes = 0.06
    second = train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    assert second.steps > first.steps and second.seconds >= first.seconds + 0.5
    # spent budget: nothing more to train, the best state exported again
    third = train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    assert third.steps == second.steps
    # other options: refused, not mixed into the checkpoint
    params.n_ff = 96
    with pytest.raises(InvalidArgumentError, match="--restart"):
        train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    train.train(tiny_llama_path, "tiny", distilled, out, params, restart=True, progress=False)
    assert train.load_checkpoint(out.with_suffix(".ckpt"))["shape"]["n_ff"] == 96


def test_a_training_killed_with_9_resumes_from_its_checkpoint(tmp_path, distilled, tiny_llama_path):
    script = """if True:
        import sys
        from pathlib import Path
        from edgespec.training import train
        train.CHECKPOINT_SECONDS = 0.3
        params = train.TrainParams(lang="python", minutes=5, n_embd=32, n_layer=1, n_head=2, n_head_kv=2,
                                   n_ff=64, vocab=300, ctx=64, threads=1)
        train.train(*map(Path, sys.argv[1:2]), "tiny", *map(Path, sys.argv[2:4]), params, progress=False)
    """
    out = tmp_path / "k.gguf"
    ckpt = out.with_suffix(".ckpt")
    killed_when(script, ckpt.exists, tiny_llama_path, distilled, out)
    saved = train.load_checkpoint(ckpt)["progress"]
    assert saved["step"] > 0
    params = train.TrainParams(lang="python", minutes=(saved["seconds"] + 1) / 60, n_embd=32, n_layer=1,
                               n_head=2, n_head_kv=2, n_ff=64, vocab=300, ctx=64, threads=1)
    resumed = train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    assert resumed.steps > saved["step"] and resumed.seconds >= saved["seconds"] + 0.5


def test_damaged_checkpoint_is_reported(tmp_path, distilled, tiny_llama_path, monkeypatch, capsys):
    params = train.TrainParams(lang="python", minutes=0.02, n_embd=32, n_layer=1, n_head=2, n_head_kv=2, n_ff=64,
                               vocab=300, ctx=64, threads=1)
    out = tmp_path / "c.gguf"
    train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    ckpt = out.with_suffix(".ckpt")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[:len(data) // 2])
    with pytest.raises(DrafterError, match=f"{ckpt}: truncated at byte {len(data) // 2}"):
        train.load_checkpoint(ckpt)
    ckpt.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    code, _, err = run_cli(monkeypatch, capsys, "drafter", "train", "--model", str(tiny_llama_path), "--data",
                           str(distilled), "--lang", "python", "--out", str(out), "--minutes", "0.03",
                           "--threads", "1", *TINY_SHAPE)
    assert code == 2 and f"{ckpt}: checksum mismatch" in err and len(err.splitlines()) == 1


def test_train_bad_input(monkeypatch, capsys, tmp_path, distilled, tiny_llama_path, other_vocab_target):
    base = ["drafter", "train", "--model", str(tiny_llama_path), "--minutes", "0.01", *TINY_SHAPE]
    for args, says in ((["--data", str(tmp_path), "--lang", "python", "--out", str(tmp_path / "a.gguf")],
                        "distill.json"),
                       (["--data", str(distilled), "--lang", "deu", "--out", str(tmp_path / "a.gguf")],
                        "distilled for --lang python"),
                       (["--data", str(distilled), "--lang", "python", "--out", str(tmp_path / "a.bin")], ".gguf"),
                       (["--data", str(distilled), "--lang", "python", "--out", str(tmp_path / "no" / "a.gguf")],
                        "no such folder"),
                       (["--data", str(distilled), "--lang", "python", "--out", str(tmp_path / "a.gguf"),
                         "--n-head-kv", "3"], "--n-head-kv"),
                       (["--data", str(distilled), "--lang", "python", "--out", str(tmp_path / "a.gguf"),
                         "--device", "tpu"], "--device")):
        code, _, err = run_cli(monkeypatch, capsys, *base, *args)
        assert code == 2 and says in err and len(err.splitlines()) == 1, err
    import torch

    if not torch.cuda.is_available():   # a GPU this machine lacks: said, not a crash
        code, _, err = run_cli(monkeypatch, capsys, *base, "--data", str(distilled), "--lang", "python",
                               "--out", str(tmp_path / "a.gguf"), "--device", "cuda")
        assert code == 2 and "no cuda device" in err
    # labels of another target (another vocabulary): refused with the reason
    code, _, err = run_cli(monkeypatch, capsys, "drafter", "train", "--model", str(other_vocab_target),
                           "--data", str(distilled), "--lang", "python", "--out", str(tmp_path / "a.gguf"),
                           "--minutes", "0.01", *TINY_SHAPE)
    assert code == 2 and "vocabulary differs" in err
    assert not list(tmp_path.glob("a.*"))
    # without PyTorch: how to install it
    monkeypatch.setitem(sys.modules, "torch", None)
    code, _, err = run_cli(monkeypatch, capsys, *base, "--data", str(distilled), "--lang", "python", "--out",
                           str(tmp_path / "a.gguf"))
    assert code == 2 and "pip install 'edgespec[train]'" in err


@pytest.fixture(scope="module")
def other_vocab_target(tmp_path_factory, tiny_vocab_path):
    """A tiny target whose vocabulary differs from the tiny llama's (FIM tokens added)."""
    from tiny_gguf import write_tiny_llama, write_tiny_vocab

    folder = tmp_path_factory.mktemp("other")
    write_tiny_vocab(folder / "v.gguf", fim=True)
    write_tiny_llama(folder / "t.gguf", folder / "v.gguf")
    return folder / "t.gguf"


@pytest.mark.models
def test_dataset_build_text_leaves_the_suites_prompts_out():
    """dataset-build (fetched with pip like the models) is where the
    multilingual suite's prompts come from: each language's suite excerpts are
    found in its text and none survives into the training documents."""
    from edgespec.bench import prompts

    for lang in ("deu", "jpn", "python"):
        texts = corpus.source_texts(lang, ["dataset-build"], progress=False)
        assert texts and all(name.startswith(f"dataset-build:{lang}/") for name, _ in texts)
        excerpts = [p.prompt for p in prompts.load_suite("multilingual") if p.lang == lang and not p.chat]
        whole = corpus.HeldOut(t for _, t in texts)
        assert excerpts and all(whole.overlaps(e) for e in excerpts)
        docs, dropped = corpus.documents(texts, corpus.HeldOut.suites())
        kept = corpus.HeldOut(d.text for d in docs)
        assert dropped >= 1 and not any(kept.overlaps(e) for e in excerpts)
        assert sum(len(d.text) for d in docs) > 0.8 * sum(len(t) for _, t in texts)


def test_generate_mode_labels_the_targets_own_continuations(tmp_path, tiny_llama_path):
    """Self-distillation: each record is a prompt from the text followed by
    the target's greedy continuation of it, labelled by the target (whose
    top token at each generated position is the next token)."""
    params = edgespec.DistillParams(lang="python", sources=[TEXT], top_k=4, ctx=48, max_tokens=150,
                                    mode="generate", prompt_tokens=16)
    manifest = edgespec.distill_model(str(tiny_llama_path), tmp_path, params, threads=1, progress=False)
    assert manifest["mode"] == "generate" and manifest["sequences"] >= 3
    recs = list(distill.DistillSet(tmp_path).records())
    with Engine(tiny_llama_path, backend="native", threads=1) as engine:
        for r in recs:
            prompt = r.tokens[:16].tolist()
            assert r.tokens.tolist() == prompt + engine.generate(prompt, max_tokens=32, temperature=0).tokens
            assert (r.ids[15:-1, 0] == r.tokens[16:]).all()
    # the text itself is not what was labelled
    plain = edgespec.distill_model(str(tiny_llama_path), tmp_path / "text", edgespec.DistillParams(
        lang="python", sources=[TEXT], top_k=4, ctx=48, max_tokens=150), threads=1, progress=False)
    assert records(tmp_path / "text")[0][0][:16] == recs[0].tokens[:16].tolist()
    assert records(tmp_path / "text")[0][0] != recs[0].tokens.tolist() and plain["mode"] == "text"


def test_exported_gguf_computes_what_was_trained(tmp_path, distilled, tiny_llama_path):
    """The native engine's and llama.cpp's logits of the exported drafter
    match the PyTorch network's best state (F16 weights: to about 1%), so the
    rotary convention, head layout and tied output carry over."""
    import torch

    params = train.TrainParams(lang="python", minutes=0.02, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96,
                               vocab=300, ctx=64, threads=1)
    out = tmp_path / "x.gguf"
    train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    with GGUFFile(out) as f:
        keep, unk = f.get(specialized.KEY_TOKEN_MAP), f.get(specialized.KEY_UNK)
    model = train.build_scratch(train.check_params(params), len(keep))
    model.load_state_dict(train.load_checkpoint(out.with_suffix(".ckpt"))["progress"]["best"])
    model.eval()
    to_draft = {t: i for i, t in enumerate(keep)}
    tokens = [to_draft.get(t, unk) for t in list(distill.DistillSet(distilled).records())[0].tokens[:40].tolist()]
    with torch.no_grad():
        want = model(torch.tensor([tokens]))[0].numpy()
    for backend in ("native", "llama"):
        with open_backend(backend, out, n_ctx=64, n_batch=64, threads=1) as drafter:
            addr = drafter.decode(tokens, logits_from=0)
            got = np.frombuffer(ffi.buffer(ffi.cast("float *", addr), 4 * len(tokens) * drafter.n_vocab),
                                dtype=np.float32).reshape(len(tokens), -1).copy()   # the buffer dies with the backend
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 0.02 * np.abs(want).max() + 1e-3, backend
        assert (got.argmax(1) == want.argmax(1)).mean() > 0.9


def test_interrupted_training_keeps_a_checkpoint_and_a_drafter(tmp_path, distilled, tiny_llama_path, monkeypatch):
    """Ctrl-C in the middle: the checkpoint and the best drafter so far are
    written; the next run goes on from that step."""
    params = train.TrainParams(lang="python", minutes=0.05, n_embd=32, n_layer=1, n_head=2, n_head_kv=2, n_ff=64,
                               vocab=300, ctx=64, threads=1)
    out = tmp_path / "i.gguf"
    real, calls = train._text_loss, []

    def text_loss(*a):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(train, "_text_loss", text_loss)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    assert out.is_file()
    assert train.load_checkpoint(out.with_suffix(".ckpt"))["progress"]["step"] == 5
    monkeypatch.setattr(train, "_text_loss", real)
    result = train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    assert result.steps > 5
