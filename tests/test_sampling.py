"""The sampler through its Python wrapper: parameter checks, greedy against
numpy.argmax, the kept-set distribution against a plain numpy reference of
the same pipeline, draws against that distribution, and seeding."""
import itertools
import math

import numpy as np
import pytest

from edgespec.errors import InvalidArgumentError, NativeError
from edgespec.sampling import Sampler, SamplingParams

VOCAB = 1000


def as_row(x) -> np.ndarray:
    """A contiguous float32 copy: the sampler reads n_vocab floats at its address."""
    return np.ascontiguousarray(x, dtype=np.float32)


def reference_probs(logits: np.ndarray, p: SamplingParams, history=()) -> np.ndarray:
    """The sampler's pipeline written out in numpy: penalty -> greedy, or
    temperature -> top-k -> softmax -> top-p -> min-p -> renormalise.
    logits: (n_vocab,) float32, finite. Returns (n_vocab,) float64 summing to 1."""
    x = logits.astype(np.float32).copy()
    recent = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else ()
    pen = np.float32(p.repeat_penalty)
    for t in set(recent):  # each distinct recent token once
        x[t] = x[t] / pen if x[t] > 0 else x[t] * pen
    probs = np.zeros(len(x))
    if p.temperature == 0:
        probs[np.argmax(x)] = 1.0
        return probs

    scaled = x.astype(np.float64) / p.temperature
    order = np.argsort(-scaled, kind="stable")        # ids, most likely first
    if p.top_k > 0:
        order = order[:p.top_k]
    e = np.exp(scaled[order] - scaled[order[0]])
    q = e / e.sum()                                   # (len(order),) descending
    if p.top_p < 1:
        n = int(np.searchsorted(np.cumsum(q), p.top_p)) + 1  # first prefix with mass >= top_p
        order, q = order[:n], q[:n]
    keep = q >= p.min_p * q[0]
    probs[order[keep]] = q[keep] / q[keep].sum()
    return probs


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

BAD_PARAMS = [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf),
    ("top_k", -1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.0), ("min_p", math.nan),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_penalty", math.nan),
    ("repeat_penalty", math.inf),
    ("repeat_last_n", -1),
    ("seed", -1), ("seed", 2**64),
    # in range as Python floats, but 0, 1 or infinite as the C sampler's 32-bit floats
    ("top_p", 1e-300), ("min_p", 0.99999999), ("repeat_penalty", 1e-300), ("repeat_penalty", 1e39),
    ("presence_penalty", 1e39), ("frequency_penalty", -1e39),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_params_reject_out_of_range(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_edges():
    d = SamplingParams()
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (0.0, 0, 1.0, 0.0)
    assert (d.repeat_penalty, d.repeat_last_n, d.seed) == (1.0, 64, 0)
    assert d.greedy and not SamplingParams(temperature=0.1).greedy
    SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=0,
                   seed=2**64 - 1)


def test_sampler_rejects_empty_vocabulary():
    with pytest.raises(InvalidArgumentError):
        Sampler(SamplingParams(), 0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_all_masked_row_raises(temperature):
    row = as_row(np.full(8, -np.inf))
    with Sampler(SamplingParams(temperature=temperature), 8) as s:
        with pytest.raises(NativeError):
            s.sample(row.ctypes.data)
        with pytest.raises(NativeError):
            s.probs(row.ctypes.data)


# ---------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------

def test_greedy_matches_numpy_argmax():
    rng = np.random.default_rng(1)
    with Sampler(SamplingParams(), VOCAB) as s:
        for i in range(300):
            # every third row is coarsely quantised, so that the max ties
            x = rng.normal(0, 4, VOCAB)
            row = as_row(np.round(x) if i % 3 == 0 else x)
            assert s.sample(row.ctypes.data) == int(np.argmax(row))
            probs = s.probs(row.ctypes.data)
            assert probs[np.argmax(row)] == 1.0 and probs.sum() == 1.0


def test_greedy_with_penalty_matches_reference():
    rng = np.random.default_rng(2)
    p = SamplingParams(repeat_penalty=1.5, repeat_last_n=8)
    with Sampler(p, VOCAB) as s:
        history = []
        for _ in range(100):
            row = as_row(rng.normal(0, 2, VOCAB))
            token = s.sample(row.ctypes.data)
            assert token == int(np.argmax(reference_probs(row, p, history)))
            # feed back the row's plain argmax too, so the history has repeats
            for t in (token, int(np.argmax(row))):
                s.accept(t)
                history.append(t)


def test_logit_bias_is_added_before_the_penalties():
    rng = np.random.default_rng(3)
    row = as_row(rng.normal(0, 2, VOCAB))
    top = int(np.argmax(row))
    banned = SamplingParams(logit_bias={top: -math.inf})
    with Sampler(banned, VOCAB) as s:
        assert s.sample(row.ctypes.data) == int(np.argsort(-row)[1])
    lifted = int(np.argmin(row))
    with Sampler(SamplingParams(logit_bias={lifted: 100.0}), VOCAB) as s:
        assert s.sample(row.ctypes.data) == lifted
    # sampled: the kept set is the reference's of the biased row
    p = SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.3, logit_bias=[(5, 3.0), (top, -2.0)])
    biased = row.copy()
    biased[5] += 3.0
    biased[top] -= 2.0
    with Sampler(p, VOCAB) as s:
        for t in (5, top, 7):
            s.accept(t)
        np.testing.assert_allclose(s.probs(row.ctypes.data), reference_probs(biased, p, [5, top, 7]),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bias, match", [
    ({-1: 1.0}, "token id >= 0"), ({3: math.nan}, "finite"), ({3: math.inf}, "finite"),
    ({3: "x"}, "must be a number"), ("abc", "map token ids"), ([(1, 2.0), (1, 3.0)], "twice"),
])
def test_logit_bias_is_checked(bias, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused_by_the_c_sampler():
    with pytest.raises(InvalidArgumentError):
        Sampler(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB)


# ---------------------------------------------------------------------------
# The kept set against the numpy reference
# ---------------------------------------------------------------------------

GRID = list(itertools.product(
    [0.5, 1.0, 1.7],        # temperature
    [0, 1, 40],             # top_k
    [1.0, 0.9, 0.5],        # top_p
    [0.0, 0.05, 0.2],       # min_p
    [1.0, 1.3],             # repeat_penalty
))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,repeat_penalty", GRID)
def test_probs_match_reference(temperature, top_k, top_p, min_p, repeat_penalty):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repeat_penalty=repeat_penalty, repeat_last_n=32)
    rng = np.random.default_rng([round(temperature * 10), top_k, round(top_p * 10),
                                 round(min_p * 100), round(repeat_penalty * 10)])
    history = [int(t) for t in rng.integers(0, VOCAB, 40)]
    with Sampler(p, VOCAB) as s:
        for t in history:
            s.accept(t)
        for scale in (0.5, 1.5, 3.0):  # flat to peaked: top-p keeps hundreds to a few
            row = as_row(rng.normal(0, scale, VOCAB))
            got = s.probs(row.ctypes.data)
            want = reference_probs(row, p, history)
            assert abs(float(got.sum()) - 1.0) < 1e-5
            np.testing.assert_array_equal(got > 0, want > 0)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------
# Draws
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.95, seed=12),
    SamplingParams(temperature=1.3, min_p=0.1, repeat_penalty=1.4, seed=13),
])
def test_draw_frequencies_match_probs(params):
    n_draws = 100_000
    row = as_row([1.5, 0.2, -0.7, 2.1, -np.inf, 0.9, 1.1, -2.0])
    with Sampler(params, len(row)) as s:
        s.accept(3)
        probs = s.probs(row.ctypes.data)
        addr = row.ctypes.data
        counts = np.bincount([s.sample(addr) for _ in range(n_draws)], minlength=len(row))
    freq = counts / n_draws
    # seeded, so deterministic; 5 standard deviations of each frequency
    sd = np.sqrt(probs * (1 - probs) / n_draws)
    assert np.all(np.abs(freq - probs) <= 5 * sd + 1e-9)
    assert np.all(counts[probs == 0] == 0)


def test_seed_reproduces_sequence():
    rng = np.random.default_rng(3)
    rows = [as_row(rng.normal(0, 2, VOCAB)) for _ in range(200)]
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(s):
        return [s.sample(r.ctypes.data) for r in rows]

    with Sampler(p, VOCAB) as a, Sampler(p, VOCAB) as b, \
            Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=1235), VOCAB) as c:
        first = run(a)
        assert run(b) == first
        assert run(c) != first
        a.reset()
        assert run(a) == first
