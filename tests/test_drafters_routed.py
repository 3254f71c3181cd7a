"""Specialized drafter sets and routing: the profile router on real text in
several languages, ``auto`` routing each request to one drafter of a set
(greedy output unchanged), the user's folder as a target's set, and
``edgespec drafter list`` with a drafter made for another target.

The drafters are tiny llamas over the tiny target's vocabulary cut down,
with the target's own weights (rows of the dropped tokens removed), so they
draft what the target would and the planner uses them; their profiles come
from real text (tests/data/routing, see SOURCES.txt)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec import Engine
from edgespec.backends.vocab import Vocab
from edgespec.config import EngineConfig
from edgespec.costs import MAX_BATCH, DraftCost
from edgespec.drafters import DrafterConfig, auto_members, routed, specialized
from edgespec.drafters import model as model_drafter
from edgespec.drafters.router import ProfileRouter, Router, open_router, script_shares
from edgespec.errors import InvalidArgumentError
from edgespec.planner import Planner
from tiny_gguf import SPECIAL_TOKENS, write_trimmed_drafter

DATA = Path(__file__).parent / "data" / "routing"
LANGS = ("python", "deu", "jpn", "eng")
RECIPE = {"command": "edgespec drafter train --model tiny --data d --lang deu", "steps": 300}

PYTHON = ("import json\n\ndef load_config(path):\n    with open(path) as f:\n        data = json.load(f)\n"
          "    return {k: v for k, v in data.items() if v is not None}\n")
GERMAN = ("Schreibe eine kurze Geschichte über einen alten Fischer, der jeden Morgen bei Sonnenaufgang "
          "mit seinem Boot auf den See hinausfährt.")
JAPANESE = "日本の四季について、それぞれの季節の特徴と行事を短い文章で説明してください。"
RUSSIAN = "Напишите короткий рассказ о старом рыбаке, который каждое утро выходит в море."


@pytest.fixture(autouse=True)
def opening_is_free(monkeypatch):
    """Opening a tiny drafter priced at nothing: its file is large against the
    tiny target's sub-millisecond steps, unlike a real drafter beside a real
    target (the planner's charge for it: tests/test_planner.py)."""
    monkeypatch.setattr(model_drafter, "open_seconds", lambda path: 0.0)


@pytest.fixture(scope="module")
def profiles() -> dict[str, list[str]]:
    return {k: specialized.char_profile([(DATA / f"{k}.txt").read_text("utf-8")]) for k in LANGS}


def _keep(tiny_vocab_path) -> list[int]:
    """All target ids but every fifth merge, the merges in reverse order."""
    n_fixed = len(SPECIAL_TOKENS) + 256
    with Vocab.load(tiny_vocab_path) as v:
        n = v.n_vocab
    return [*range(n_fixed), *(t for t in reversed(range(n_fixed, n)) if t % 5)]


@pytest.fixture(scope="module")
def drafter_set(tmp_path_factory, tiny_vocab_path, tiny_llama_path, profiles) -> Path:
    """A folder of four drafters for the tiny llama (python, deu, jpn, eng),
    one trained for another target and one plain model."""
    folder = tmp_path_factory.mktemp("drafters")
    keep = _keep(tiny_vocab_path)
    for lang in LANGS:
        write_trimmed_drafter(folder / f"{lang}.gguf", tiny_vocab_path, keep, weights_of=tiny_llama_path,
                              keys={specialized.KEY_LANGS: [lang], specialized.KEY_PROFILE: profiles[lang],
                                    specialized.KEY_RECIPE: json.dumps({**RECIPE, "lang": lang})})
    write_trimmed_drafter(folder / "other.gguf", tiny_vocab_path, keep,
                          keys={specialized.KEY_TARGET: "gemma3-270m", specialized.KEY_TARGET_VOCAB: "0" * 64})
    (folder / "plain.gguf").write_bytes(Path(tiny_llama_path).read_bytes())
    return folder


def _infos(profiles):
    return [routed.DrafterInfo(path=Path(f"{k}.gguf"), name=k, profile=tuple(p)) for k, p in profiles.items()]


# -- the router ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, lang", [
    (PYTHON, "python"),
    (GERMAN, "deu"),
    (JAPANESE, "jpn"),
    ("Write a short essay about the history of the printing press and how it changed the spread of "
     "knowledge in Europe.", "eng"),
    # mixed: code with German names and comments; German asking for code; Japanese with English names
    ("def mittelwert(werte):\n    # Berechnet den Mittelwert der Liste\n    if not werte:\n        return 0.0\n"
     "    return sum(werte) / len(werte)\n\nclass Konto:\n    def __init__(self, inhaber):\n"
     "        self.inhaber = inhaber\n        self.saldo = 0\n", "python"),
    ("Schreibe eine Funktion in Python, die aus einer Liste von Wörtern die häufigsten zehn zurückgibt, "
     "und erkläre kurz, wie sie funktioniert.", "deu"),
    ("PythonでWebサーバーを作る方法を教えてください。Flaskを使った簡単な例もお願いします。", "jpn"),
    # a Python function whose docstring is English prose: its answer is code
    ('def count_vowels(sentence: str) -> dict:\n    """Given a sentence of words separated by spaces, return '
     'a dictionary that\n    maps each word to the number of vowels it contains. The words keep the order in '
     'which\n    they appear in the sentence, and a word that appears more than once is counted once.\n'
     '    >>> count_vowels("the quick brown fox")\n    {\'the\': 1, \'quick\': 2, \'brown\': 1, \'fox\': 1}\n'
     '    """\n', "python"),
    # no drafter of this script
    (RUSSIAN, None),
    ("", None),
])
def test_the_router_picks_the_drafter_of_the_prompts_language(profiles, text, lang):
    chosen, scores = ProfileRouter().choose(text, _infos(profiles))
    assert (chosen.name if chosen else None) == lang, scores
    assert set(scores) == set(LANGS)


def test_scripts_of_letters():
    assert script_shares("Abc ひらがな 漢字 123 !") == pytest.approx({"LATIN": 3 / 9, "HIRAGANA": 4 / 9, "HAN": 2 / 9})
    assert script_shares("123 !?") == {}


class Always(Router):
    """A router of the user's own: always the Japanese drafter."""

    name = "always-jpn"

    def choose(self, text, drafters):
        return next(d for d in drafters if d.name == "jpn"), {}


def test_routers_are_found_by_name():
    assert isinstance(open_router("profile"), ProfileRouter)
    assert isinstance(open_router(f"{__name__}:Always"), Always)
    for bad, match in (("nope", "unknown router 'nope'"), ("no.such.module:X", "cannot be loaded"),
                       ("json:dumps", "not a subclass")):
        with pytest.raises(InvalidArgumentError, match=match):
            open_router(bad)


# -- sets and auto -------------------------------------------------------------------------


def test_auto_weighs_a_set_between_the_cheap_drafters_and_the_draft_model():
    assert auto_members(DrafterConfig(n_vocab=1, specialized=(Path("a.gguf"),), paired_draft="d",
                                      options=EngineConfig(ngram_cache="c"))) == ["ngram", "cache", "routed", "model"]
    assert auto_members(DrafterConfig(n_vocab=1, specialized=(Path("a.gguf"),))) == ["ngram", "routed"]


def test_the_set_is_the_shipped_folder_and_the_users(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    shipped, user = routed.set_folders("some-model")
    assert shipped.parts[-3:] == ("models", "drafters", "some-model") and shipped.parent.parent.name == "models"
    assert user == tmp_path / "drafters" / "some-model"
    user.mkdir(parents=True)
    (user / "a.gguf").write_bytes(b"")
    (user / "notes.txt").write_text("not a drafter")
    assert routed.set_files("some-model") == [user / "a.gguf"]
    explicit = tmp_path / "mine"
    (explicit / "some-model").mkdir(parents=True)
    (explicit / "b.gguf").write_bytes(b"")
    (explicit / "some-model" / "c.gguf").write_bytes(b"")
    assert routed.set_files("some-model", explicit) == [explicit / "b.gguf", explicit / "some-model" / "c.gguf"]
    with pytest.raises(InvalidArgumentError, match="no such folder"):
        routed.set_files("some-model", tmp_path / "missing")


def _generate(engine, request, **kw):
    chat = isinstance(request, list) and isinstance(request[0], dict)
    prompt, messages = (None, request) if chat else (request, None)
    return engine.generate(prompt, messages=messages, max_tokens=24, temperature=0, **kw)


def test_auto_routes_each_request_to_one_drafter_and_keeps_greedy_output(tiny_llama_path, drafter_set,
                                                                          monkeypatch, stated_costs):
    # The drafters here are as large as the target; the planner is told they
    # cost what a real specialized drafter does (a few percent of it), and
    # batches nearly nothing (as on a bandwidth-bound model).
    monkeypatch.setattr(model_drafter, "draft_cost", lambda target, draft: DraftCost(per_token=0.03, catch_up=0.005))
    for method in ("record_draft_time", "record_catch_up"):
        real = getattr(Planner, method)
        monkeypatch.setattr(Planner, method, lambda self, key, seconds, n, real=real: real(
            self, key, seconds * (0.03 if key.startswith(routed.PREFIX) else 1.0), n))
    german_chat = [{"role": "system", "content": "You are a helpful assistant. Answer in the user's language."},
                   {"role": "user", "content": GERMAN}]
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                drafter_dir=str(drafter_set)) as e:
        e.lanes[0].planner = Planner([0.0] + [1.0 + 0.02 * (k - 1) for k in range(1, MAX_BATCH + 1)])
        for request, lang in ((PYTHON, "python"), (GERMAN, "deu"), (JAPANESE, "jpn"), (german_chat, "deu"),
                              (e.prompt_tokens(PYTHON), "python"), (RUSSIAN, None)):
            spec = _generate(e, request)
            plain = _generate(e, request, drafter="none")
            assert spec.tokens == plain.tokens
            stats = spec.stats.spec
            assert stats.specialized == lang
            assert stats.to_dict()["specialized"] == lang
            if lang is None:
                assert not any(name.startswith(routed.PREFIX) for name in stats.per_drafter)
                continue
            name = routed.PREFIX + lang
            assert stats.drafters[name]["mode"] == "trimmed-vocabulary"
            assert stats.drafters[name]["scores"][lang] == max(stats.drafters[name]["scores"].values())
            assert set(stats.per_drafter) <= {"ngram", name}
            # the planner drafted with it (it drafts what the target would)
            assert stats.per_drafter.get(name, {}).get("accepted", 0) > 0, (request, stats.per_drafter, stats.drafters)


def test_a_router_of_the_users_own_and_the_users_folder(tiny_llama_path, drafter_set, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    user = tmp_path / "drafters" / Path(tiny_llama_path).stem
    user.mkdir(parents=True)
    for name in ("deu.gguf", "jpn.gguf", "other.gguf"):
        (user / name).write_bytes((drafter_set / name).read_bytes())
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto") as e:
        assert _generate(e, GERMAN).stats.spec.specialized == "deu"
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                router=f"{__name__}:Always") as e:
        assert _generate(e, GERMAN).stats.spec.specialized == "jpn"
    with pytest.raises(InvalidArgumentError, match="unknown router"):
        Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=256, router="nope")


def test_a_set_without_a_drafter_for_the_target_warns_and_drafts_nothing_special(tiny_llama_path, drafter_set,
                                                                                  tmp_path):
    (tmp_path / "other.gguf").write_bytes((drafter_set / "other.gguf").read_bytes())
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="none",
                drafter_dir=str(tmp_path)) as e:
        with pytest.warns(UserWarning, match="other.gguf: .*trained for gemma3-270m, whose vocabulary differs"):
            r = _generate(e, GERMAN, drafter="auto")
        assert r.stats.spec.specialized is None and set(r.stats.spec.drafters) == {"ngram", "specialized"}


# -- edgespec drafter list / generate ------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=300)


def test_drafter_list_shows_each_drafter_and_why_one_is_left_out(tiny_llama_path, drafter_set, tiny_vocab_path):
    p = _cli("drafter", "list", "--model", str(tiny_llama_path), "--drafters", str(drafter_set))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    with Vocab.load(tiny_vocab_path) as v:
        n_keep, n_target = len(_keep(tiny_vocab_path)), v.n_vocab
    assert "4 of 6 usable" in out
    assert f"deu.gguf: langs deu, " in out and f"vocabulary {n_keep} of {n_target} tokens" in out
    assert "recipe: edgespec drafter train --model tiny --data d --lang deu" in out
    assert "other.gguf: incompatible: draft model other was trained for gemma3-270m, whose vocabulary differs" in out
    assert "plain.gguf: incompatible: not a specialized drafter" in out
    rows = [json.loads(line) for line in _cli("drafter", "list", "--model", str(tiny_llama_path), "--drafters",
                                              str(drafter_set), "--json").stdout.splitlines()]
    by = {r["name"]: r for r in rows}
    assert by["jpn"]["langs"] == ["jpn"] and by["jpn"]["problem"] is None and by["jpn"]["parameters"] > 0
    assert "differs" in by["other"]["problem"]
    bad = _cli("drafter", "list", "--model", str(tiny_llama_path), "--drafters", str(drafter_set / "missing"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: drafters folder") and "Traceback" not in bad.stderr


def test_generate_says_which_specialized_drafter_it_used(tiny_llama_path, drafter_set):
    p = _cli("generate", GERMAN, "--model", str(tiny_llama_path), "--backend", "native", "--threads", "1",
             "--max-tokens", "8", "--drafters", str(drafter_set), "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.splitlines()[-1])
    assert result["drafter"] == "auto" and result["spec"]["specialized"] == "deu"


class AlwaysPython(ProfileRouter):
    """The profile router's confidence, but the Python drafter whatever the text."""

    name = "always-python"

    def choose(self, text, drafters):
        return next(d for d in drafters if d.name == "python"), {"python": 1.0}


def test_the_routers_confidence_sets_the_prior_and_prose_does_not_run_a_code_drafter(profiles):
    infos = {i.name: i for i in _infos(profiles)}
    router = ProfileRouter()
    assert router.confidence(GERMAN, infos["python"], 0.6) == 0.0      # prose for a code drafter
    assert router.confidence(PYTHON, infos["deu"], 0.6) == 0.0         # code for a prose drafter
    assert router.confidence(PYTHON, infos["python"], 0.6) == 1.0
    assert router.confidence(RUSSIAN, infos["deu"], 0.1) == 0.0        # another script
    assert router.confidence(JAPANESE, infos["jpn"], 0.4) > 0.7


def test_a_code_drafter_routed_prose_is_given_a_prior_too_low_to_draft_and_opens_lazily(
        tiny_llama_path, drafter_set, monkeypatch, tmp_path, stated_costs):
    """A router sure of the Python drafter for a German request: its
    confidence in that is 0, so the drafter's prior is MIN_PRIOR and the
    planner never asks it (it stays unopened); on Python code it drafts."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setattr(model_drafter, "draft_cost", lambda target, draft: DraftCost(per_token=0.03, catch_up=0.005))
    with Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=512, drafter="auto",
                drafter_dir=str(drafter_set), router=f"{__name__}:AlwaysPython") as e:
        e.lanes[0].planner = Planner([0.0] + [1.0 + 0.02 * (k - 1) for k in range(1, MAX_BATCH + 1)])
        german = _generate(e, GERMAN)
        member = german.stats.spec.drafters[routed.PREFIX + "python"]
        assert member["confidence"] == 0.0 and member["drafts"] == 0 and not member["opened"]
        alpha = e.lanes[0].planner.summary()["alpha"]
        assert [a[0] for k, a in alpha.items() if k.startswith(routed.PREFIX)] == [routed.MIN_PRIOR]
        python = _generate(e, PYTHON)
        member = python.stats.spec.drafters[routed.PREFIX + "python"]
        assert member["confidence"] == 1.0 and member["drafts"] > 0 and member["opened"]


def test_a_draft_model_of_known_cost_opens_only_when_first_asked(tiny_llama_path, monkeypatch, tmp_path):
    """The draft model's cost measured once (the first engine opens it to
    measure); the next engine knows it from the cache by the draft file and
    does not open the model for a one-token answer."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    options = {"backend": "native", "threads": 1, "n_ctx": 512, "drafter": "auto", "draft_model": str(tiny_llama_path)}
    with Engine(str(tiny_llama_path), **options) as e:
        assert e.generate("Hello", max_tokens=1).stats.spec.drafters["model"]["opened"]
    with Engine(str(tiny_llama_path), **options) as e:
        r = e.generate("Hello", max_tokens=1)
        assert not r.stats.spec.drafters["model"]["opened"]
        assert r.stats.spec.drafters["model"]["mode"] == "same-vocabulary"
