"""KV-cache slots: several contexts over one loaded model, a generation going
to the slot holding the longest prefix of its prompt (else an empty one, else
the least recently used), so conversations keep their prefixes. Asserted on
the reuse counters, not timings (benchmarks/slots_ttft.py times them)."""
from __future__ import annotations

import threading

import pytest

from edgespec import Engine
from edgespec.errors import InvalidArgumentError

SYSTEM = "You are a helpful assistant who answers in one short sentence."
TOPICS = ["Tell me about the ocean and its tides.", "Write a poem about mountains in winter.",
          "Explain how a bicycle gear works."]


def turn(engine, history: list[dict], question: str):
    history.append({"role": "user", "content": question})
    result = engine.chat(history, max_tokens=6, temperature=0)
    history.append({"role": "assistant", "content": result.text})
    return result


@pytest.fixture(params=["llama", "native"])
def backend(request):
    return request.param


def open_engine(path, backend, slots):
    return Engine(str(path), backend=backend, threads=1, n_ctx=512, slots=slots)


def test_interleaved_conversations_keep_their_prefixes(tiny_llama_path, backend):
    with open_engine(tiny_llama_path, backend, 2) as e:
        a, b = [{"role": "system", "content": SYSTEM}], [{"role": "system", "content": SYSTEM}]
        a1, b1 = turn(e, a, TOPICS[0]), turn(e, b, TOPICS[1])
        assert a1.stats.slot != b1.stats.slot     # b shares only the system prompt with a's slot
        a2, b2 = turn(e, a, "And why?"), turn(e, b, "And why?")
        assert (a2.stats.slot, b2.stats.slot) == (a1.stats.slot, b1.stats.slot)
        # the whole first turn (its prompt and answer) is reused
        assert a2.stats.cached_tokens >= a1.stats.prompt_tokens
        assert b2.stats.cached_tokens >= b1.stats.prompt_tokens
        stats = e.slot_stats()
        assert [s["uses"] for s in stats] == [2, 2] and [s["prefix_hits"] for s in stats] == [1, 1]
        assert sum(s["reused"] for s in stats) == a2.stats.cached_tokens + b2.stats.cached_tokens


def test_one_slot_evicts_the_other_conversation(tiny_llama_path, backend):
    with open_engine(tiny_llama_path, backend, 1) as e:
        a, b = [], []
        a1 = turn(e, a, TOPICS[0])
        turn(e, b, TOPICS[1])
        a2 = turn(e, a, "And why?")
        assert a2.stats.cached_tokens < a1.stats.prompt_tokens // 2


def test_two_concurrent_conversations_keep_their_prefixes(tiny_llama_path, backend):
    with open_engine(tiny_llama_path, backend, 2) as e:
        results: dict[int, list] = {}
        start = threading.Barrier(2)

        def conversation(k):
            history = [{"role": "system", "content": SYSTEM}]
            start.wait()
            results[k] = [turn(e, history, TOPICS[k]), turn(e, history, "Go on."),
                          turn(e, history, "Once more.")]

        threads = [threading.Thread(target=conversation, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for turns in results.values():
            for before, after in zip(turns, turns[1:]):
                assert after.stats.cached_tokens >= before.stats.prompt_tokens
        assert {results[0][-1].stats.slot, results[1][-1].stats.slot} == {0, 1}


def test_least_recently_used_slot_is_reused(tiny_llama_path, backend):
    with open_engine(tiny_llama_path, backend, 2) as e:
        a, b, c = [], [], []
        a1, b1 = turn(e, a, TOPICS[0]), turn(e, b, TOPICS[1])
        c1 = turn(e, c, TOPICS[2])
        assert c1.stats.slot == a1.stats.slot          # a's slot was the least recently used
        b2 = turn(e, b, "And why?")
        assert b2.stats.slot == b1.stats.slot and b2.stats.cached_tokens >= b1.stats.prompt_tokens
        a2 = turn(e, a, "And why?")                     # evicted: goes to the LRU slot, c's
        assert a2.stats.slot == c1.stats.slot and a2.stats.cached_tokens < a1.stats.prompt_tokens // 2


def test_every_slot_gives_the_same_output(tiny_llama_path, backend):
    prompts = ["The cat sat on", "A story about a dragon:", "Numbers: 1, 2, 3,"]
    with open_engine(tiny_llama_path, backend, 1) as one:
        expected = [one.generate(p, max_tokens=12, temperature=0, drafter="ngram").tokens for p in prompts]
        one.forget_prefix()
    with open_engine(tiny_llama_path, backend, 3) as e:
        got = [e.generate(p, max_tokens=12, temperature=0, drafter="ngram") for p in prompts]
        assert sorted(r.stats.slot for r in got) == [0, 1, 2]
        assert [r.tokens for r in got] == expected
        again = [e.generate(p, max_tokens=12, temperature=0) for p in prompts]
        assert [r.tokens for r in again] == expected
        assert [r.stats.slot for r in again] == [r.stats.slot for r in got]
        e.forget_prefix()
        assert all(s["tokens"] == 0 for s in e.slot_stats())


def test_slots_are_checked(tiny_llama_path):
    with pytest.raises(InvalidArgumentError, match="slots"):
        Engine(str(tiny_llama_path), slots=0)
    with pytest.raises(InvalidArgumentError, match="onnx"):
        Engine(str(tiny_llama_path), backend="onnx", slots=2)
