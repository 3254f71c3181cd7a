"""Mutated model files through the CLI: `edgespec models info` and `generate`
on the native and the llama backend end every one with exit status 0 or 2,
never an abort, a crash, a traceback or a hang, and give one verdict (a file
`models info` accepts, each backend runs or declines as unsupported; the
backends answer alike).

Seeded mutants (tests/gguf_mutants.py: header counts, metadata keys and
values, the vocabulary, tensor infos, alignment, norm weights and quantized
blocks' scales, cut files) of a tiny quantized model of every built-in
architecture: llama (smollm2-135m), gemma3 (gemma3-270m), qwen2
(qwen2.5-coder). A few hundred here; ``pytest --fuzz-long`` runs thousands.
benchmarks/probe_hardening.py runs the same over the built-in models.
"""
from __future__ import annotations

import pytest

from gguf_mutants import probe
from tiny_gguf import Q, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen2

MUTANTS, LONG_MUTANTS = 100, 1000   # per architecture
# (writer, weight type, size): widths of 256 for the K-quants' super-blocks.
ARCHS = {
    "llama": (write_tiny_llama, Q.Q4_1, {}),
    "gemma3": (write_tiny_gemma3, Q.Q4_K, {"n_embd": 256, "n_ff": 256, "head_dim": 64}),
    "qwen2": (write_tiny_qwen2, Q.Q8_0, {}),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_mutated_models_end_in_exit_0_or_2_with_one_verdict(arch, request, tmp_path, tiny_vocab_path):
    write, dtype, size = ARCHS[arch]
    model = tmp_path / f"tiny-{arch}.gguf"
    write(model, tiny_vocab_path, dtype=dtype, **size)
    n = LONG_MUTANTS if request.config.getoption("--fuzz-long") else MUTANTS
    runs = probe(model, tmp_path / "work", seed=31, n=n, timeout=120)

    problems = [f"{r.mutant}: {p}" for r in runs for p in r.problems]
    assert problems == [], "\n".join(problems[:40])
    # Not vacuous: most mutants ran, and both verdicts were reached.
    ran = [r for r in runs if r.outcomes]
    codes = {o.code for r in ran for o in r.outcomes.values()}
    assert len(ran) >= 0.95 * n and codes == {0, 2}, (len(ran), codes)
    accepted = sum(r.outcomes["llama"].code == 0 for r in ran)
    assert 0.05 * n < accepted < 0.9 * n, accepted
