"""Session-wide model files: the two built-in models (pulled into the edgespec
cache on first use, see edgespec.models.registry) and a tiny random llama and
qwen2 that share SmolLM2's tokenizer."""
from __future__ import annotations

import pytest

from edgespec.models import registry
from tiny_gguf import Q, write_tiny_llama, write_tiny_qwen2


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


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, smollm2_path):
    """A 2-layer, 64-wide random qwen2 with Q/K/V biases (F32, ~26 MB) and
    SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf"
    write_tiny_qwen2(path, smollm2_path, dtype=Q.F32)
    return path


@pytest.fixture(scope="session")
def native_lib_path(tmp_path_factory):
    """The C core as a shared library (CMake, optimized, no sanitizers, so
    ctypes can load it; CMake keeps internal symbols such as es_matvec
    visible). Built once per session."""
    import pathlib
    import shutil
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    cmake = shutil.which("cmake")
    assert cmake, "cmake is a build requirement of edgespec"
    build = tmp_path_factory.mktemp("native-build")
    subprocess.run([cmake, "-S", str(root), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(build), "-j2", "--target", "edgespec"],
                   check=True, capture_output=True)
    libs = sorted(build.glob("libedgespec.*"))
    assert libs, "CMake built no libedgespec"
    return libs[0]
