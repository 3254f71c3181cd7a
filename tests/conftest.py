"""Session-wide model files: the two built-in models (pulled into the edgespec
cache on first use, see edgespec.registry) and a tiny random llama that
shares SmolLM2's tokenizer."""
from __future__ import annotations

import pytest

from edgespec import registry
from tiny_gguf import write_tiny_llama


@pytest.fixture(scope="session")
def smollm2_path():
    return registry.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def gemma_path():
    return registry.resolve("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path):
    """A 2-layer, 64-wide random llama (F16, ~14 MB) with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_llama(path, smollm2_path)
    return path
