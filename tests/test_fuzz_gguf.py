"""Fuzzing the C GGUF reader (csrc/native/gguf.c) with libFuzzer under ASan and UBSan.

The target csrc/fuzz/fuzz_gguf.c opens every input with es_gguf_open_buffer
and reads every tensor and key it reports; it crashes on any out-of-bounds
read, undefined behaviour, or broken promise (a tensor outside the input, an
error without a message). The seed corpus is a handful of small valid GGUFs:
tiny llama, Mixtral-style and qwen3moe models from tests/tiny_gguf.py over a
32-token vocabulary, and an image with every metadata value type (nested
arrays included) and tensors of many ggml types.

Needs clang with libFuzzer (Debian: clang, libclang-rt-NN-dev; .ci/run
installs them). Where it is missing the test skips, unless
EDGESPEC_REQUIRE_FUZZ=1 (set by CI), where it fails.
EDGESPEC_FUZZ_SECONDS sets the fuzzing time (default 60).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import gguf
import numpy as np
import pytest

from tiny_gguf import write_tiny_llama, write_tiny_qwen3moe

ROOT = pathlib.Path(__file__).resolve().parent.parent
Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def _fuzzer_toolchain(tmp_path: pathlib.Path) -> str | None:
    """Why clang cannot build a libFuzzer target here, or None when it can."""
    clang = shutil.which("clang")
    if not clang:
        return "clang is not installed"
    src = tmp_path / "probe.c"
    src.write_text("#include <stddef.h>\n#include <stdint.h>\n"
                   "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n")
    probe = subprocess.run([clang, "-fsanitize=fuzzer,address,undefined", str(src),
                            "-o", str(tmp_path / "probe")], capture_output=True, text=True)
    if probe.returncode:
        return probe.stderr.strip()[-500:] or "clang -fsanitize=fuzzer failed"
    return None


# ---- seed corpus ----------------------------------------------------------------------

def _write_vocab(path: pathlib.Path) -> None:
    """A GGUF holding only a 32-token BPE tokenizer: the tokenizer source for
    tiny models small enough to be fuzz seeds."""
    w = gguf.GGUFWriter(path, "llama")
    tokens = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "cd", "Ġa", "\n"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_every_type(path: pathlib.Path) -> None:
    """Every metadata value type, nested arrays, alignment 64, and tensors of
    plain, legacy, K- and I-quant types (random bytes: only sizes matter)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    scalars = {V.UINT8: 200, V.INT8: -5, V.UINT16: 60000, V.INT16: -300, V.UINT32: 4_000_000_000,
               V.INT32: -70000, V.FLOAT32: 0.5, V.BOOL: True, V.STRING: "text",
               V.UINT64: 2**64 - 1, V.INT64: -(2**63), V.FLOAT64: -1.25}
    for vtype, value in scalars.items():
        w.add_key_value(f"k.{vtype.name.lower()}", value, vtype)
    w.add_key_value("k.arr_i32", [1, -2, 3], V.ARRAY, V.INT32)
    w.add_key_value("k.arr_f32", [0.5, 1.5], V.ARRAY, V.FLOAT32)
    w.add_key_value("k.arr_bool", [True, False], V.ARRAY, V.BOOL)
    w.add_key_value("k.arr_str", ["a", "", "ccc"], V.ARRAY, V.STRING)
    w.add_key_value("k.arr_arr", [[1, 2], [3]], V.ARRAY, V.ARRAY)
    w.add_key_value("k.arr_deep", [[[["four levels, the most the reader takes"]]]], V.ARRAY, V.ARRAY)
    rng = np.random.default_rng(0)
    for qtype, cols in [(Q.F32, 8), (Q.F16, 8), (Q.BF16, 8), (Q.Q4_0, 32), (Q.Q4_1, 32),
                        (Q.Q5_0, 32), (Q.Q8_0, 64), (Q.Q2_K, 256), (Q.Q4_K, 256), (Q.Q6_K, 256),
                        (Q.IQ4_NL, 32), (Q.IQ2_XXS, 256), (Q.MXFP4, 32)]:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(2, cols // block * block_bytes), dtype=np.uint8)
        w.add_tensor(f"t.{qtype.name.lower()}", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_seeds(seeds: pathlib.Path) -> list[pathlib.Path]:
    seeds.mkdir()
    vocab = seeds / "vocab.gguf"
    _write_vocab(vocab)
    small = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ctx=64)
    write_tiny_llama(seeds / "llama.gguf", vocab, n_ff=32, **small)
    write_tiny_llama(seeds / "mixtral.gguf", vocab, n_ff=32, dtype=Q.Q8_0, n_expert=2,
                     n_expert_used=1, **small)
    write_tiny_qwen3moe(seeds / "qwen3moe.gguf", vocab, head_dim=16, n_expert=2,
                        n_expert_used=1, n_ff_exp=32, **small)
    _write_every_type(seeds / "every-type.gguf")
    return sorted(seeds.iterdir())


# ---- the test -------------------------------------------------------------------------

def test_gguf_reader_survives_fuzzing(tmp_path):
    missing = _fuzzer_toolchain(tmp_path)
    if missing:
        if os.environ.get("EDGESPEC_REQUIRE_FUZZ") == "1":
            pytest.fail(f"EDGESPEC_REQUIRE_FUZZ=1 but libFuzzer is unavailable: {missing}")
        pytest.skip(f"libFuzzer is unavailable ({missing}); install clang to run this test")

    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_C_COMPILER=clang",
                    "-DEDGESPEC_FUZZ=ON", "-DCMAKE_BUILD_TYPE=Debug"], check=True, capture_output=True)
    # The whole library under ASan and UBSan: minutes on one core, so on all of them.
    subprocess.run(["cmake", "--build", str(build), "--target", "fuzz_gguf", "--parallel", str(os.cpu_count() or 1)],
                   check=True, capture_output=True)
    fuzzer = build / "fuzz_gguf"

    seeds = write_seeds(tmp_path / "seeds")
    assert all(0 < p.stat().st_size < 64 * 1024 for p in seeds), [p.stat().st_size for p in seeds]
    # The seeds are valid for gguf-py too: the fuzzer starts from deep inside the format.
    for p in seeds:
        gguf.GGUFReader(p)

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seconds = int(os.environ.get("EDGESPEC_FUZZ_SECONDS", "60"))
    # One allocation over 512 MB is a finding (with its stack and input), and so
    # is the process growing past libFuzzer's default 2 GB. libFuzzer reads its
    # size as getrusage's peak, which a process spawned from pytest inherits:
    # Linux carries the spawning process's peak across vfork and exec (a CI
    # run's pytest had reached 4.2 GB, so its fuzzer "used" that much at its
    # first input). A shell between them forks the fuzzer, whose peak is then
    # its own.
    run = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh",
                          str(fuzzer), f"-max_total_time={seconds}", "-timeout=10",
                          "-max_len=65536", "-print_final_stats=1",
                          "-malloc_limit_mb=512", "-rss_limit_mb=2048",
                          f"-artifact_prefix={tmp_path}/", str(corpus), str(tmp_path / "seeds")],
                         capture_output=True, text=True, timeout=seconds + 120)
    log = run.stdout + run.stderr
    crashes = [p.name for p in tmp_path.iterdir() if re.match(r"(crash|leak|timeout|oom)-", p.name)]
    assert run.returncode == 0 and not crashes, f"{crashes}\n{log[-6000:]}"
    executed = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
    assert executed and int(executed.group(1)) > 1000, log[-3000:]
