"""Drafters grown from a model with the target's tokenizer (`edgespec drafter
train --init MODEL`), on tiny fixtures: the PyTorch network computes the
init model's logits before any training (llama and qwen2: Q/K/V biases,
NEOX RoPE, RMS epsilon, GQA, tied or untied output), the layers kept are
the most influential ones, the head is trimmed to the kept tokens, and the
distilled drafter, exported quantized in the init's architecture, is loaded
by the native engine and llama.cpp and speculates with output identical to
plain decoding past 256 positions; a killed training resumes; routing picks
the language's grown drafter; bad input is one line and exit 2.

The target is the tiny llama; the init models are tiny qwen2s over the same
tokenizer (as large as the target, so the 8% size cap of a grown drafter is
lifted here, except in the test of the cap itself)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgespec import Engine
from edgespec.backends import open_backend
from edgespec.capi import ffi
from edgespec.drafters import specialized
from edgespec.drafters.model import target_fingerprint
from edgespec.models.gguf import GGUFFile
from edgespec.training import distill, network, train
from processes import killed_when
from test_drafter_train import distilled, run_cli  # noqa: F401 (distilled: a fixture)
from tiny_gguf import Q, copy_gguf, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen2

torch = pytest.importorskip("torch")
DATA = Path(__file__).parent / "data" / "routing"
IDLE = 2   # the layer of `init_model` whose block adds nothing to the hidden state


@pytest.fixture(autouse=True)
def no_size_cap(monkeypatch):
    monkeypatch.setattr(train, "MAX_GROWN_SHARE", 100.0)


@pytest.fixture(scope="module")
def init_model(tmp_path_factory, tiny_vocab_path) -> Path:
    """A 4-layer tiny qwen2 over the tiny tokenizer whose layer IDLE has zero
    attention-output and down projections: that block is the identity."""
    folder = tmp_path_factory.mktemp("init")
    write_tiny_qwen2(folder / "full.gguf", tiny_vocab_path, n_layer=4, seed=5)
    zero = {f"blk.{IDLE}.attn_output.weight", f"blk.{IDLE}.ffn_down.weight"}
    reader = gguf.GGUFReader(str(folder / "full.gguf"))
    copy_gguf(folder / "full.gguf", folder / "init.gguf", drop=zero,
              add={t.name: np.zeros(t.data.shape, np.float32) for t in reader.tensors if t.name in zero})
    return folder / "init.gguf"


def grow(monkeypatch, capsys, target, data, out, *extra, lang="python") -> str:
    code, stdout, err = run_cli(monkeypatch, capsys, "drafter", "train", "--model", str(target), "--data", str(data),
                                "--lang", lang, "--out", str(out), "--threads", "1", "--ctx", "64", *extra)
    assert code == 0, err
    return stdout


def logits_of(path, tokens) -> np.ndarray:
    with open_backend("native", path, n_ctx=512, n_batch=512, threads=1) as b:
        addr = b.decode(tokens, logits_from=0)
        return np.frombuffer(ffi.buffer(ffi.cast("float *", addr), 4 * len(tokens) * b.n_vocab),
                             dtype=np.float32).reshape(len(tokens), -1).copy()


def network_logits(net, tokens) -> np.ndarray:
    net.eval()
    with torch.no_grad():
        return net(torch.tensor([tokens]))[0].numpy()


# -- the network ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2-tied"])
def test_the_network_computes_the_init_models_logits(tmp_path, tiny_vocab_path, kind):
    """Every layer, every row: the native engine's logits (F16 KV cache, its
    activation rounding) within float tolerance over 300 positions; a subset of
    layers and rows: exactly the full network's of those layers, those columns."""
    path = tmp_path / "m.gguf"
    if kind == "llama":
        write_tiny_llama(path, tiny_vocab_path, norm_noise=0.1)
    else:
        write_tiny_qwen2(path, tiny_vocab_path, dtype=Q.F32, tied=kind == "qwen2-tied")
    tokens = np.random.default_rng(1).integers(0, 515, 300).tolist()
    net = network.read_gguf(path)
    assert net.shape.arch == kind.split("-")[0] and net.shape.tied == (kind == "qwen2-tied")
    assert net.shape.qkv_bias == (kind != "llama")
    want, got = network_logits(net, tokens), logits_of(path, tokens)
    assert np.abs(got - want).max() < 0.01 * np.abs(want).max()
    assert (got.argmax(1) == want.argmax(1)).mean() > 0.98
    keep = np.arange(3, 515, 2)
    one, ref = network.read_gguf(path, [1], keep), network.read_gguf(path, [1])
    assert one.shape.n_vocab == len(keep) and one.shape.n_layer == 1
    drafted = np.arange(0, 200, 5)   # drafter ids
    assert np.allclose(network_logits(one, drafted.tolist()), network_logits(ref, keep[drafted].tolist())[:, keep],
                       atol=1e-5)


def test_the_layers_kept_are_the_most_influential(init_model, distilled):
    records = [r.tokens for r in distill.DistillSet(distilled).records()][:4]
    influence = network.block_influence(init_model, records)
    assert influence.shape == (4,)
    assert influence[IDLE] < 1e-6 and all(influence[il] > 1e-3 for il in range(4) if il != IDLE)
    assert network.choose_layers(influence, 3) == [il for il in range(4) if il != IDLE]
    assert network.choose_layers(influence, 1) == [int(np.argmax(influence))]


def test_grown_distilled_exported_loaded_and_speculating(monkeypatch, capsys, tmp_path, tiny_llama_path, init_model,
                                                         distilled):
    out = tmp_path / "py.gguf"
    stdout = grow(monkeypatch, capsys, tiny_llama_path, distilled, out, "--init", str(init_model), "--layers", "3",
                  "--vocab", "300", "--minutes", "0.05")
    assert stdout.startswith(f"wrote {out}:") and "tokens/s" in stdout
    with GGUFFile(out) as f:
        assert f.get("general.architecture") == "qwen2" and f.get("qwen2.block_count") == 3
        assert f.get("qwen2.rope.freq_base") == 1e6 and f.get("qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
        keep = f.get(specialized.KEY_TOKEN_MAP)
        assert len(keep) == 300 == len(f.get("tokenizer.ggml.tokens")) and keep == sorted(keep)
        assert f.tensor("output.weight").shape == (64, 300) and f.tensor("blk.2.attn_q.bias") is not None
        assert {t.type_name for t in f.tensors if len(t.shape) == 2} == {"Q8_0"}
        recipe = json.loads(f.get(specialized.KEY_RECIPE))
    assert recipe["grown"]["layers"] == [il for il in range(4) if il != IDLE]
    assert recipe["grown"]["init"] == "init" and len(recipe["grown"]["influence"]) == 4
    assert recipe["steps"] >= 1 and recipe["params"]["quant"] == "q8_0" and "--init" in recipe["command"]
    # past 256 positions, both engines drafting with it: the target's own greedy output
    prompt = "def load_config(path):\n"
    with Engine(tiny_llama_path, backend="native", threads=1) as plain:
        want = plain.generate(prompt, max_tokens=300, temperature=0)
    assert want.stats.prompt_tokens + len(want.tokens) > 256
    for draft_backend in ("native", "llama"):
        with Engine(tiny_llama_path, backend="native", threads=1, drafter="model", draft_model=str(out),
                    draft_backend=draft_backend) as eng:
            got = eng.generate(prompt, max_tokens=300, temperature=0)
        assert got.tokens == want.tokens
        assert got.stats.spec.drafted > 0 and got.stats.spec.drafters["model"]["mode"] == "trimmed-vocabulary"


def test_the_exported_drafter_computes_what_was_trained(monkeypatch, capsys, tmp_path, tiny_llama_path, init_model,
                                                        distilled):
    """F16 export of the trained state: both engines' logits are the network's
    (the NEOX rotation, biases and untied head carried over)."""
    out = tmp_path / "f.gguf"
    grow(monkeypatch, capsys, tiny_llama_path, distilled, out, "--init", str(init_model), "--layers", "0,3",
         "--vocab", "256", "--minutes", "0.02", "--quant", "f16")
    saved = train.load_checkpoint(out.with_suffix(".ckpt"))
    assert saved["grown"] == {"layers": [0, 3], "influence": None}
    net = network.build(network.NetShape(**saved["net"]))
    net.load_state_dict(saved["progress"]["best"])
    with GGUFFile(out) as f:
        to_draft = {t: i for i, t in enumerate(f.get(specialized.KEY_TOKEN_MAP))}
        unk = f.get(specialized.KEY_UNK)
    tokens = [to_draft.get(t, unk) for t in next(distill.DistillSet(distilled).records()).tokens[:48].tolist()]
    want = network_logits(net, tokens)
    for backend in ("native", "llama"):
        with open_backend(backend, out, n_ctx=64, n_batch=64, threads=1) as drafter:
            addr = drafter.decode(tokens, logits_from=0)
            got = np.frombuffer(ffi.buffer(ffi.cast("float *", addr), 4 * len(tokens) * drafter.n_vocab),
                                dtype=np.float32).reshape(len(tokens), -1).copy()
        assert np.abs(got - want).max() < 0.02 * np.abs(want).max(), backend
        assert (got.argmax(1) == want.argmax(1)).mean() > 0.9


def test_a_grown_training_killed_with_9_resumes_from_its_checkpoint(tmp_path, tiny_llama_path, init_model, distilled):
    script = """if True:
        import sys
        from pathlib import Path
        from edgespec.training import train
        train.CHECKPOINT_SECONDS, train.MAX_GROWN_SHARE = 0.3, 100.0
        params = train.TrainParams(lang="python", minutes=5, init=sys.argv[4], layers=2, vocab=300, ctx=64,
                                   threads=1)
        train.train(Path(sys.argv[1]), "tiny", Path(sys.argv[2]), Path(sys.argv[3]), params, progress=False)
    """
    out = tmp_path / "k.gguf"
    ckpt = out.with_suffix(".ckpt")
    killed_when(script, ckpt.exists, tiny_llama_path, distilled, out, init_model)
    saved = train.load_checkpoint(ckpt)
    layers = saved["grown"]["layers"]
    assert saved["progress"]["step"] > 0 and layers == network.choose_layers(np.array(saved["grown"]["influence"]), 2)
    params = train.TrainParams(lang="python", minutes=(saved["progress"]["seconds"] + 1) / 60, init=str(init_model),
                               layers=2, vocab=300, ctx=64, threads=1)
    resumed = train.train(tiny_llama_path, "tiny", distilled, out, params, progress=False)
    assert resumed.steps > saved["progress"]["step"] and resumed.seconds >= saved["progress"]["seconds"] + 0.5
    with GGUFFile(out) as f:
        assert json.loads(f.get(specialized.KEY_RECIPE))["grown"]["layers"] == layers


def test_routing_picks_the_languages_grown_drafter(monkeypatch, capsys, tmp_path, tiny_llama_path, init_model,
                                                   distilled):
    folder = tmp_path / "set"
    folder.mkdir()
    german = tmp_path / "deu"
    with open_backend("native", tiny_llama_path, n_ctx=64, n_batch=64, threads=1) as target:
        distill.distill(target, "tiny", german, distill.DistillParams(
            lang="deu", sources=[str(DATA / "deu.txt")], top_k=8, ctx=64),
            fingerprint=target_fingerprint(target), progress=False)
    for lang, data in (("python", distilled), ("deu", german)):
        grow(monkeypatch, capsys, tiny_llama_path, data, folder / f"{lang}.gguf", "--init", str(init_model),
             "--layers", "1", "--vocab", "300", "--minutes", "0.01", lang=lang)
    code, out, err = run_cli(monkeypatch, capsys, "drafter", "list", "--model", str(tiny_llama_path), "--drafters",
                             str(folder), "--json")
    infos = {i["name"]: i for i in map(json.loads, out.splitlines())}
    assert code == 0 and {k: (i["langs"], i["problem"]) for k, i in infos.items()} == {
        "python": (["python"], None), "deu": (["deu"], None)}
    with Engine(str(tiny_llama_path), backend="native", threads=1, drafter="auto", drafter_dir=str(folder)) as e:
        for prompt, lang in (("import json\n\ndef load_config(path):\n    with open(path) as f:\n", "python"),
                             ("Schreibe eine kurze Geschichte über einen alten Fischer, der jeden Morgen", "deu")):
            assert e.generate(prompt, max_tokens=8, temperature=0).stats.spec.specialized == lang


def test_grow_bad_input(monkeypatch, capsys, tmp_path, tiny_llama_path, init_model, distilled, tiny_vocab_path):
    from tiny_gguf import write_tiny_vocab

    other = tmp_path / "other"
    other.mkdir()
    write_tiny_vocab(other / "v.gguf", fim=True)
    write_tiny_qwen2(other / "q.gguf", other / "v.gguf")
    write_tiny_gemma3(tmp_path / "g.gguf", tiny_vocab_path)
    out = str(tmp_path / "a.gguf")
    base = ["drafter", "train", "--model", str(tiny_llama_path), "--data", str(distilled), "--lang", "python",
            "--out", out, "--minutes", "0.01", "--threads", "1", "--vocab", "300"]
    for args, says in (
            (["--init", str(other / "q.gguf")], "its tokenizer is not tiny-llama's (vocabulary fingerprint"),
            (["--init", str(tmp_path / "g.gguf")], "cannot be grown from a gemma3 model"),
            (["--init", str(init_model), "--layers", "5"], "--layers 5: init.gguf has 4 layers (0 to 3)"),
            (["--init", str(init_model), "--layers", "0,4"], "--layers 0,4: init.gguf has 4 layers"),
            (["--init", str(init_model), "--layers", "1,1"], "--layers must be a count"),
            (["--init", str(init_model), "--layers", "0"], "--layers must be a count N >= 1"),
            (["--init", str(init_model), "--layers", "two"], "--layers must be a count"),
            (["--init", str(init_model), "--vocab", "255"], "--vocab must be in [256, "),
            (["--init", str(init_model), "--vocab", "600"], "--vocab 600 is above the target's vocabulary of 515"),
            (["--init", str(init_model), "--n-layer", "2"], "--n-layer is for a drafter trained from scratch"),
            (["--init", str(init_model), "--quant", "q5_1"], "--quant must be f16, q8_0, q4_0"),
            (["--layers", "2"], "--layers is for a drafter grown from a model"),
            (["--init", str(tmp_path / "missing.gguf")], "missing.gguf")):
        code, _, err = run_cli(monkeypatch, capsys, *base, *args)
        assert code == 2 and says in err and len(err.splitlines()) == 1, (args, err)
        assert not Path(out).exists()


def test_a_grown_drafter_over_the_size_cap_is_refused_before_training(monkeypatch, capsys, tmp_path, tiny_llama_path,
                                                                      init_model, distilled):
    monkeypatch.setattr(train, "MAX_GROWN_SHARE", 0.08)
    code, _, err = run_cli(monkeypatch, capsys, "drafter", "train", "--model", str(tiny_llama_path), "--data",
                           str(distilled), "--lang", "python", "--out", str(tmp_path / "a.gguf"), "--init",
                           str(init_model), "--layers", "1", "--vocab", "256", "--minutes", "0.01")
    assert code == 2 and "over the" in err and "8% of the target's" in err and "--quant q4_0" in err, err
    assert not list(tmp_path.glob("a.*"))


def test_a_grown_drafter_for_another_target_is_refused_at_load_with_both_names(
        monkeypatch, capsys, tmp_path, tiny_llama_path, init_model, distilled, tiny_vocab_path):
    out = tmp_path / "py.gguf"
    grow(monkeypatch, capsys, tiny_llama_path, distilled, out, "--init", str(init_model), "--layers", "1",
         "--vocab", "256", "--minutes", "0.01")
    from tiny_gguf import write_tiny_vocab

    write_tiny_vocab(tmp_path / "v.gguf", fim=True)
    write_tiny_llama(tmp_path / "fim-llama.gguf", tmp_path / "v.gguf")
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hello", "--model", str(tmp_path / "fim-llama.gguf"),
                           "--drafter", "model", "--draft-model", str(out), "-n", "4")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "trained for tiny-llama, whose vocabulary differs from the target's, fim-llama" in err
