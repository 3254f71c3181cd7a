"""EnginePool: models by name, loaded on first use, the least recently used
idle one unloaded when a load would pass the memory budget."""
from __future__ import annotations

import shutil
import threading

import pytest

from edgespec import Engine
from edgespec.errors import InvalidArgumentError, ModelNotFoundError
from edgespec.pool import EnginePool, PoolFullError, model_bytes, model_name


@pytest.fixture
def three_models(tmp_path, tiny_llama_path, tiny_qwen2_path):
    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"]
    shutil.copy(tiny_llama_path, paths[0])
    shutil.copy(tiny_qwen2_path, paths[1])
    shutil.copy(tiny_llama_path, paths[2])
    return [str(p) for p in paths]


OPTIONS = dict(threads=1, n_ctx=256, slots=2)


def cost(path) -> int:
    from pathlib import Path
    return model_bytes(Path(path), OPTIONS["n_ctx"], OPTIONS["slots"] + 1)


def loaded(pool) -> list[str]:
    return [m["name"] for m in pool.models() if m["loaded"]]


def test_models_load_on_first_use(three_models):
    with EnginePool(three_models, max_loaded_bytes=0, **OPTIONS) as pool:
        assert pool.names == ["a", "b", "c"] and pool.default == "a"
        assert loaded(pool) == []
        with pool.engine("b") as engine:
            assert isinstance(engine, Engine) and engine.backend.metadata("general.architecture") == "qwen2"
            assert engine.generate("Hello", max_tokens=3, temperature=0).stats.n_tokens == 3
        with pool.engine() as engine:     # the default: the first
            assert engine.backend.metadata("general.architecture") == "llama"
        assert loaded(pool) == ["a", "b"]
        assert all(m["bytes"] > 0 for m in pool.models() if m["loaded"])


def test_least_recently_used_idle_model_is_unloaded_under_the_budget(three_models):
    budget = cost(three_models[0]) + cost(three_models[1]) + 1   # two fit, not three
    with EnginePool(three_models, max_loaded_bytes=budget, **OPTIONS) as pool:
        with pool.engine("a"):
            pass
        with pool.engine("b") as b:
            pass
        with pool.engine("a"):            # a is now the most recently used
            pass
        with pool.engine("c"):
            assert loaded(pool) == ["a", "c"]   # b went
        with pytest.raises(Exception):
            b.generate("x", max_tokens=1)       # closed
        with pool.engine("b"):
            assert loaded(pool) == ["b", "c"]   # a went: c was used after it


def test_models_in_use_are_never_unloaded(three_models):
    budget = cost(three_models[0]) + cost(three_models[1]) // 2
    with EnginePool(three_models, max_loaded_bytes=budget, **OPTIONS) as pool:
        with pool.engine("a") as a:
            with pytest.raises(PoolFullError, match="memory budget"):
                with pool.engine("b"):
                    pass
            assert a.generate("Hi", max_tokens=2, temperature=0).stats.n_tokens == 2
            assert loaded(pool) == ["a"]
        with pool.engine("b"):               # a is idle now
            assert loaded(pool) == ["b"]


def test_a_model_over_the_whole_budget_is_refused(three_models):
    with EnginePool(three_models, max_loaded_bytes=1000, **OPTIONS) as pool:
        with pytest.raises(PoolFullError, match="whole budget"):
            with pool.engine("a"):
                pass
        assert [m["bytes"] for m in pool.models()] == [0, 0, 0]


def test_concurrent_first_requests_load_once(three_models):
    opened = []

    def opener(path, **kw):
        opened.append(path)
        return Engine(path, **kw)

    with EnginePool(three_models, max_loaded_bytes=0, opener=opener, **OPTIONS) as pool:
        barrier = threading.Barrier(3)

        def ask():
            barrier.wait()
            with pool.engine("a") as e:
                e.generate("Hi", max_tokens=2, temperature=0)

        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(opened) == 1


def test_an_unknown_name_lists_the_available_ones(three_models):
    with EnginePool(three_models, max_loaded_bytes=0, **OPTIONS) as pool:
        with pytest.raises(ModelNotFoundError, match=r"'nope' is not served here \(available: a, b, c\)"):
            with pool.engine("nope"):
                pass
    with EnginePool(three_models, pull=False, max_loaded_bytes=0, **OPTIONS) as pool:
        with pytest.raises(ModelNotFoundError, match="available: a, b, c"):
            with pool.engine("smollm2-135m"):   # built-in, but pulling is off
                pass


def test_pool_arguments_are_checked(three_models):
    with pytest.raises(InvalidArgumentError, match="served as 'a'"):
        EnginePool([three_models[0], three_models[0]])
    with pytest.raises(InvalidArgumentError, match="at least one"):
        EnginePool([])
    with pytest.raises(InvalidArgumentError, match="max_loaded_bytes"):
        EnginePool(three_models, max_loaded_bytes=-1)
    assert model_name("smollm2-135m") == "smollm2-135m"
    assert model_name("hf:owner/repo/x-Q4.gguf") == "x-Q4"
