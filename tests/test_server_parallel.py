"""Several clients at once against one model (``serve --parallel N``, issue
30 item 5), through the official ``openai`` client: two streams at once
each equal their serial answer (greedy), their steps decoded in shared
batches; a client that leaves mid-stream leaves the other running and
correct; /slots, /props and /metrics show the generations running."""
from __future__ import annotations

import json
import threading

import pytest

from edgespec import Engine

from test_server_platform import request, start, stop

openai = pytest.importorskip("openai")

PROMPTS = ["Once upon a time", "The lighthouse keeper climbed"]


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    with Engine(str(tiny_llama_path), backend="native", threads=2, parallel=2, drafter="ngram") as engine:
        server, thread = start(engine)
        yield server, engine
        stop(server, thread)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed(server, prompt: str, max_tokens: int, out: dict, key, stop_after: int | None = None) -> None:
    """The text of a streamed greedy completion into out[key] (a client that
    leaves after ``stop_after`` chunks: what it got until then)."""
    text = []
    with client(server).completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True) as stream:
        for i, chunk in enumerate(stream):
            text.append(chunk.choices[0].text if chunk.choices else "")
            if stop_after is not None and i + 1 >= stop_after:
                break
    out[key] = "".join(text)


def at_once(*calls) -> None:
    threads = [threading.Thread(target=streamed, args=args) for args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


def test_two_clients_at_once_each_get_their_serial_answer(served):
    server, engine = served
    serial = {}
    for p in PROMPTS:
        streamed(server, p, 48, serial, p)
        assert serial[p] == engine.generate(p, max_tokens=48, temperature=0).text
    assert all(len(t) > 20 for t in serial.values())
    together = {}
    at_once(*[(server, p, 48, together, p) for p in PROMPTS])
    assert together == serial


@pytest.mark.models
def test_two_clients_at_once_share_batches_on_a_real_model(smollm2_path):
    """On a real model the two streams overlap for sure: their steps are batched."""
    with Engine(str(smollm2_path), backend="native", threads=2, parallel=2, drafter="ngram") as engine:
        server, thread = start(engine)
        try:
            serial = {}
            for p in PROMPTS:
                streamed(server, p, 64, serial, p)
            batches, steps = engine.batcher.batches, engine.batcher.batched_steps
            together = {}
            at_once(*[(server, p, 64, together, p) for p in PROMPTS])
            assert together == serial and all(len(t) > 40 for t in serial.values())
            assert engine.batcher.batched_steps - steps > engine.batcher.batches - batches   # shared batches
        finally:
            stop(server, thread)


def test_a_client_that_leaves_leaves_the_other_running_and_correct(served):
    server, engine = served
    want = engine.generate(PROMPTS[1], max_tokens=64, temperature=0).text
    got = {}
    at_once((server, PROMPTS[0], 400, got, "left", 3), (server, PROMPTS[1], 64, got, "stayed"))
    assert got["stayed"] == want
    assert len(got["left"]) < len(engine.generate(PROMPTS[0], max_tokens=400, temperature=0).text)


def test_slots_props_and_metrics_show_the_generations_running(served):
    server, engine = served
    status, _, data = request(server, "GET", "/props")
    assert status == 200 and json.loads(data)["parallel"] == 2 and json.loads(data)["total_slots"] >= 2
    seen = {}
    started = threading.Event()

    def long_stream():
        with client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=300, temperature=0,
                                               stream=True) as stream:
            for i, _ in enumerate(stream):
                if i == 1:
                    started.set()
                    _, _, slots = request(server, "GET", "/slots")
                    seen["slots"] = json.loads(slots)
                    _, _, metrics = request(server, "GET", "/metrics")
                    seen["metrics"] = metrics.decode()
                    break

    t = threading.Thread(target=long_stream)
    t.start()
    t.join(timeout=120)
    assert started.is_set()
    assert sum(s["is_processing"] for s in seen["slots"]) == 1
    assert 'edgespec_generations_running{model="tiny"} 1.0' in seen["metrics"]
