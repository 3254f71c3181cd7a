"""Speculative verification (es_verify) through the raw cffi layer.

Greedy: on random rows and random trees, with a repetition penalty and ties,
the output must equal a numpy reference walk of plain greedy decoding.
Sampling: on a toy target whose logits depend on the position and the
previous token, the first two tokens of the text must follow the target's
own p0(x) * p1(y | x), whatever was drafted (chi-square test).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgespec.capi import ffi, lib


def make_sampler(n_vocab: int, temperature: float = 0.0, top_k: int = 0,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 0, seed: int = 0):
    """An es_sampler freed with its cdata."""
    c = lib.es_sampler_default_params()
    c.temperature = temperature
    c.top_k = top_k
    c.repeat_penalty = repeat_penalty
    c.repeat_last_n = repeat_last_n
    c.seed = seed
    out = ffi.new("es_sampler **")
    assert lib.es_sampler_init(ffi.addressof(c), n_vocab, out) == lib.ES_OK
    return ffi.gc(out[0], lib.es_sampler_free)


def f32(arr: np.ndarray):
    """Address of a C-contiguous float32 array, as the C core reads it (no copy)."""
    assert arr.dtype == np.float32 and arr.flags.c_contiguous
    return ffi.cast("const float *", arr.ctypes.data)


def i32(arr: np.ndarray):
    assert arr.dtype == np.int32 and arr.flags.c_contiguous
    return ffi.cast("const int32_t *", arr.ctypes.data)


class Verifier:
    """A reusable es_draft_tree and output buffers for drafts of up to max_nodes."""

    def __init__(self, smpl, max_nodes: int):
        self.smpl = smpl
        self.tree = ffi.new("es_draft_tree *")
        self.out_tokens = ffi.new("es_token[]", max_nodes + 1)
        self.out_path = ffi.new("int32_t[]", max_nodes)
        self.n_out = ffi.new("int32_t *")

    def __call__(self, logits, tokens, n_nodes: int, parents=ffi.NULL, probs=ffi.NULL):
        """Verify; logits, tokens, parents, probs are C pointers. Returns (tokens, path)."""
        self.tree.tokens = tokens
        self.tree.parents = parents
        self.tree.probs = probs
        self.tree.n_nodes = n_nodes
        rc = lib.es_verify(self.smpl, logits, self.tree, self.out_tokens, self.out_path, self.n_out)
        assert rc == lib.ES_OK, ffi.string(lib.es_status_str(rc)).decode()
        n = self.n_out[0]
        return ffi.unpack(self.out_tokens, n), ffi.unpack(self.out_path, n - 1)


# ---------------------------------------------------------------------------
# Greedy: random rows and trees against the sequential reference
# ---------------------------------------------------------------------------

def reference_greedy(rows, tokens, parents, history, penalty, last_n):
    """Plain greedy decoding along the tree: argmax of the penalized row (lowest
    id on ties), move to the first child (in node order) holding it, stop when
    none does. rows: (n_nodes + 1, V) float32. Returns (tokens, path)."""
    history = list(history)
    out, path, node = [], [], -1
    while True:
        x = rows[node + 1].copy()
        for t in set(history[-last_n:]):  # each distinct recent token once
            x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
        t = int(np.argmax(x))
        history.append(t)
        out.append(t)
        child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == t), None)
        if child is None:
            return out, path
        path.append(child)
        node = child


def random_tree(rng, rows, max_nodes):
    """Parents in [-1, i); each token is half the time the argmax of the parent's
    row (unpenalized, as a drafter unaware of the penalty guesses), else random,
    moved to the next token no sibling holds. Needs max_nodes < V."""
    V = rows.shape[1]
    n = int(rng.integers(0, max_nodes + 1))
    chain = rng.random() < 0.3
    tokens, parents = [], []
    for i in range(n):
        parent = i - 1 if chain else int(rng.integers(-1, i))
        t = int(np.argmax(rows[parent + 1])) if rng.random() < 0.5 else int(rng.integers(V))
        siblings = {tokens[j] for j in range(i) if parents[j] == parent}
        while t in siblings:
            t = (t + 1) % V
        tokens.append(t)
        parents.append(parent)
    return np.array(tokens, dtype=np.int32), np.array(parents, dtype=np.int32)


def test_greedy_matches_sequential_reference():
    V, max_nodes, last_n, penalty = 12, 10, 6, np.float32(1.5)
    rng = np.random.default_rng(7)
    smpl = make_sampler(V, repeat_penalty=float(penalty), repeat_last_n=last_n)
    verify = Verifier(smpl, max_nodes)
    for _ in range(2000):
        # integer logits in [-3, 5]: ties, and penalties that land on them
        rows = rng.integers(-3, 6, size=(max_nodes + 1, V)).astype(np.float32)
        tokens, parents = random_tree(rng, rows, max_nodes)
        history = [int(t) for t in rng.integers(V, size=last_n)]
        lib.es_sampler_reset(smpl)
        for t in history:
            lib.es_sampler_accept(smpl, t)
        got = verify(f32(rows), i32(tokens), len(tokens), parents=i32(parents))
        assert got == reference_greedy(rows, tokens.tolist(), parents.tolist(), history,
                                       penalty, last_n)


def test_drafter_rows_on_a_branching_tree_are_rejected():
    V = 4
    smpl = make_sampler(V, temperature=1.0)
    rows = np.zeros((3, V), dtype=np.float32)
    probs = np.full((2, V), 0.25, dtype=np.float32)
    tokens = np.array([1, 2], dtype=np.int32)
    parents = np.array([-1, -1], dtype=np.int32)
    tree = ffi.new("es_draft_tree *", {"tokens": i32(tokens), "parents": i32(parents),
                                       "probs": f32(probs), "n_nodes": 2})
    out, n_out = ffi.new("es_token[]", 3), ffi.new("int32_t *", 77)
    assert lib.es_verify(smpl, f32(rows), tree, out, ffi.NULL, n_out) == lib.ES_ERR_INVALID_ARG
    assert n_out[0] == 77


# ---------------------------------------------------------------------------
# Sampling: exactness on a toy model
# ---------------------------------------------------------------------------

V_STAT, N_TRIALS, ROOT, N_POS = 6, 100_000, 3, 4
TARGET = np.random.default_rng(11).normal(0.0, 1.0, size=(N_POS, V_STAT, V_STAT)).astype(np.float32)
DRAFTER = np.random.default_rng(12).normal(0.0, 1.0, size=(N_POS, V_STAT, V_STAT)).astype(np.float32)
# TARGET[pos, prev]: (V,) logits of the token at position pos (0: right after
# the root) following token prev; DRAFTER likewise for the drafter.


def kept_probs(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The sampler's distribution for temperature and top-k: (..., V) float64."""
    z = logits.astype(np.float64) / temperature
    if top_k > 0:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def expected_pairs(temperature: float, top_k: int) -> np.ndarray:
    """(V, V): p0(x) * p1(y | x) of the toy target."""
    p0 = kept_probs(TARGET[0, ROOT], temperature, top_k)
    p1 = kept_probs(TARGET[1], temperature, top_k)  # (prev = x, V)
    return p0[:, None] * p1


def chi_square_ok(counts: np.ndarray, expected: np.ndarray) -> tuple[bool, float, float]:
    """Pearson's chi-square of counts against probabilities expected, cells with
    an expected count under 5 pooled into one. Returns (passed, statistic,
    critical value at p = 1e-4, by the Wilson-Hilferty approximation)."""
    e = expected.ravel() * counts.sum()
    c = counts.ravel().astype(np.float64)
    assert not c[e == 0].any(), "a token outside the kept set was emitted"
    small = e < 5
    e = np.append(e[~small], e[small].sum())
    c = np.append(c[~small], c[small].sum())
    c, e = c[e > 0], e[e > 0]
    stat = float(((c - e) ** 2 / e).sum())
    k = len(e) - 1
    z = 3.719  # standard normal upper 1e-4 quantile
    crit = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return stat < crit, stat, crit


def count_first_two(smpl, verify, n_trials, draft_for_trial):
    """counts (V, V) of the first two tokens of the text over n_trials. Each
    trial verifies draft_for_trial(i) = (logits, tokens, n_nodes, parents, probs)
    pointers; when verification stops after one token the second is sampled
    plainly from the target's row."""
    counts = np.zeros((V_STAT, V_STAT), dtype=np.int64)
    second = ffi.new("es_token *")
    target = f32(TARGET)
    for i in range(n_trials):
        out, _ = verify(*draft_for_trial(i))
        if len(out) < 2:
            row = target + (1 * V_STAT + out[0]) * V_STAT  # TARGET[1, out[0]]
            assert lib.es_sampler_sample(smpl, row, ffi.NULL, second) == lib.ES_OK
            lib.es_sampler_accept(smpl, second[0])
            out.append(second[0])
        counts[out[0], out[1]] += 1
    return counts


def draw_rows(rng, probs: np.ndarray) -> np.ndarray:
    """One draw from each row of probs (n, V), by inverse CDF."""
    u = rng.random(len(probs))
    return np.minimum((np.cumsum(probs, axis=1) < u[:, None]).sum(axis=1), V_STAT - 1)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 3)])
def test_sampled_chain_with_drafter_rows_keeps_target_distribution(temperature, top_k):
    n_nodes = 3
    rng = np.random.default_rng(5)
    # The drafter's chains, drawn from its own rows: tokens (N, n_nodes), q (N, n_nodes, V).
    tokens = np.zeros((N_TRIALS, n_nodes), dtype=np.int32)
    q = np.zeros((N_TRIALS, n_nodes, V_STAT), dtype=np.float32)
    prev = np.full(N_TRIALS, ROOT)
    for i in range(n_nodes):
        q[:, i] = kept_probs(DRAFTER[i, prev], 1.0, 0)
        tokens[:, i] = prev = draw_rows(rng, q[:, i].astype(np.float64))
    # The target's rows for each chain: logits (N, n_nodes + 1, V).
    logits = np.empty((N_TRIALS, n_nodes + 1, V_STAT), dtype=np.float32)
    logits[:, 0] = TARGET[0, ROOT]
    for i in range(n_nodes):
        logits[:, i + 1] = TARGET[i + 1, tokens[:, i]]

    smpl = make_sampler(V_STAT, temperature=temperature, top_k=top_k, seed=1)
    verify = Verifier(smpl, n_nodes)
    lp, tp, qp = f32(logits), i32(tokens), f32(q)
    rows, nodes = (n_nodes + 1) * V_STAT, n_nodes * V_STAT

    def draft(i):
        return lp + i * rows, tp + i * n_nodes, n_nodes, ffi.NULL, qp + i * nodes

    counts = count_first_two(smpl, verify, N_TRIALS, draft)
    expected = expected_pairs(temperature, top_k)
    ok, stat, crit = chi_square_ok(counts.sum(axis=1), expected.sum(axis=1))
    assert ok, f"first token: chi2 {stat:.1f} >= {crit:.1f}"
    ok, stat, crit = chi_square_ok(counts, expected)
    assert ok, f"first two tokens: chi2 {stat:.1f} >= {crit:.1f}"


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 3)])
def test_sampled_sibling_candidates_keep_target_distribution(temperature, top_k):
    # root -> {0, 5, 2}; 0 -> 1; 2 -> 4
    tokens = np.array([0, 5, 2, 1, 4], dtype=np.int32)
    parents = np.array([-1, -1, -1, 0, 2], dtype=np.int32)
    depth = [0, 0, 0, 1, 1]
    logits = np.empty((len(tokens) + 1, V_STAT), dtype=np.float32)  # (n_nodes + 1, V)
    logits[0] = TARGET[0, ROOT]
    for i, t in enumerate(tokens):
        logits[i + 1] = TARGET[depth[i] + 1, t]

    smpl = make_sampler(V_STAT, temperature=temperature, top_k=top_k, seed=2)
    verify = Verifier(smpl, len(tokens))
    fixed = (f32(logits), i32(tokens), len(tokens), i32(parents), ffi.NULL)
    counts = count_first_two(smpl, verify, N_TRIALS, lambda i: fixed)
    expected = expected_pairs(temperature, top_k)
    ok, stat, crit = chi_square_ok(counts.sum(axis=1), expected.sum(axis=1))
    assert ok, f"first token: chi2 {stat:.1f} >= {crit:.1f}"
    ok, stat, crit = chi_square_ok(counts, expected)
    assert ok, f"first two tokens: chi2 {stat:.1f} >= {crit:.1f}"
