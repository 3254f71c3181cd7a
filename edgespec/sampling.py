"""Sampling parameters and the owning wrapper of the C sampler."""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

from .capi import Owned, check, ffi, lib
from .config import option
from .errors import BackendError, InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature=0`` is greedy decoding. Each
    field that the command line takes carries its flags and help, as
    EngineConfig's do (edgespec.config.option); the ranges are checked here."""

    temperature: float = option(0.0, "--temperature", "--temp",
                                help="0 = greedy; otherwise >= 1e-6, sampled (default: 0).")
    top_k: int = option(0, "--top-k", help="Keep the k most likely tokens, >= 0; 0 = off.")
    top_p: float = option(1.0, "--top-p", help="Nucleus mass in (0, 1]; 1 = off.")
    min_p: float = option(0.0, "--min-p", help="Drop tokens below min_p x p(best), [0, 1); 0 = off.")
    repeat_penalty: float = option(1.0, "--repeat-penalty", help="Repetition penalty, > 0; 1 = off.")
    presence_penalty: float = option(0.0, "--presence-penalty",
                                     help="Subtracted from the logit of each recent token; 0 = off.")
    frequency_penalty: float = option(0.0, "--frequency-penalty",
                                      help="Subtracted per occurrence of a recent token; 0 = off.")
    repeat_last_n: int = 64   # the window the three penalties see
    seed: int = option(0, "--seed", cli_default=None,
                       help="RNG seed for sampling, [0, 2**64) (default: random).")
    # (token, bias) pairs added to the logits before the penalties (a dict is
    # taken too); -inf bans a token
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            _require(name, getattr(self, name), (int, float))
        for name in ("top_k", "repeat_last_n", "seed"):
            _require(name, getattr(self, name), (int,))
        if not math.isfinite(self.temperature) or self.temperature < 0 or (
                self.temperature > 0 and self.temperature < 1e-6):
            raise InvalidArgumentError(f"temperature must be 0 (greedy) or in [1e-6, inf), got {self.temperature}")
        # The C sampler holds these as 32-bit floats: a value that rounds to 0,
        # to 1 or to infinity there is refused here, naming it.
        if not 0 < self.top_p <= 1 or _f32(self.top_p) < FLT_MIN:
            raise InvalidArgumentError(f"top_p must be in (0, 1] and at least {FLT_MIN:.3g} (a 32-bit float), "
                                       f"got {self.top_p}")
        if not 0 <= self.min_p < 1 or _f32(self.min_p) == 1:
            raise InvalidArgumentError(f"min_p must be in [0, 1) and below 1 as a 32-bit float, got {self.min_p}")
        if not 0 <= self.top_k < 2**31:
            raise InvalidArgumentError(f"top_k must be in [0, 2**31), got {self.top_k}")
        if not FLT_MIN <= _f32(self.repeat_penalty) < math.inf:
            raise InvalidArgumentError(f"repeat_penalty must be > 0 and a finite 32-bit float (in [{FLT_MIN:.3g}, "
                                       f"{FLT_MAX:.3g}]), got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(_f32(getattr(self, name))):
                raise InvalidArgumentError(f"{name} must be a finite 32-bit float (|x| <= {FLT_MAX:.3g}), "
                                           f"got {getattr(self, name)}")
        if not 0 <= self.repeat_last_n < 2**31:
            raise InvalidArgumentError(f"repeat_last_n must be in [0, 2**31), got {self.repeat_last_n}")
        if not 0 <= self.seed < 2**64:
            raise InvalidArgumentError(f"seed must be in [0, 2**64), got {self.seed}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any of the penalties is on (they read the recent-token window)."""
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token, bias) pairs, each checked: a token id
    >= 0 (the vocabulary's end is the sampler's to check), a bias that is a
    finite 32-bit float or -inf."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = sorted((t, b) for t, b in items)
    except (TypeError, ValueError):
        raise InvalidArgumentError("logit_bias must map token ids to numbers") from None
    for t, b in pairs:
        _require("a logit_bias token id", t, (int,))
        _require(f"logit_bias[{t}]", b, (int, float))
        if t < 0 or not (math.isfinite(_f32(b)) or b == -math.inf):
            raise InvalidArgumentError(f"logit_bias: token {t} with bias {b} (a token id >= 0 and a finite "
                                       "bias, or -inf to ban it)"[:200])
    if len({t for t, _ in pairs}) < len(pairs):
        raise InvalidArgumentError("logit_bias names a token twice")
    return tuple((int(t), float(b)) for t, b in pairs)


FLT_MIN, FLT_MAX = 1.1754944e-38, 3.4028235e38   # the smallest normal and the largest 32-bit float


def _f32(x: float) -> float:
    """``x`` rounded to a 32-bit float, as the C sampler holds it (inf past its range)."""
    return ctypes.c_float(x).value


def _require(name: str, value, kinds: tuple[type, ...]) -> None:
    """A sampling parameter of the wrong type is an InvalidArgumentError, not a TypeError."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = "a whole number" if kinds == (int,) else "a number"
        raise InvalidArgumentError(f"{name} must be {want}, got {value!r}"[:200])


class Sampler(Owned):
    """Owns one ``es_sampler``. Reads logits rows in place through their address."""

    _free = lib.es_sampler_free

    def __init__(self, params: SamplingParams, n_vocab: int):
        c = lib.es_sampler_default_params()
        c.temperature = params.temperature
        c.top_k = params.top_k
        c.top_p = params.top_p
        c.min_p = params.min_p
        c.repeat_penalty = params.repeat_penalty
        c.presence_penalty = params.presence_penalty
        c.frequency_penalty = params.frequency_penalty
        c.repeat_last_n = params.repeat_last_n
        c.seed = params.seed
        out = ffi.new("es_sampler **")
        check(lib.es_sampler_init(ffi.addressof(c), n_vocab, out), "es_sampler_init")
        self._ptr = out[0]
        if params.logit_bias:
            ids, bias = zip(*params.logit_bias)
            check(lib.es_sampler_set_bias(self._ptr, ffi.new("es_token[]", ids), ffi.new("float[]", bias), len(ids)),
                  "es_sampler_set_bias")
        self._tok = ffi.new("es_token *")
        self.params = params
        self.n_vocab = n_vocab
        # Verification buffers, sized for the largest draft and grown on demand.
        self._tree = ffi.new("es_draft_tree *")
        self._n_out = ffi.new("int32_t *")
        self.rows: list[int] = []
        self._grow(64)

    def _grow(self, n_nodes: int) -> None:
        self._cap = n_nodes
        self._draft_tokens = ffi.new("es_token[]", n_nodes)
        self._draft_parents = ffi.new("int32_t[]", n_nodes)
        self._out_tokens = ffi.new("es_token[]", n_nodes + 1)
        self._out_path = ffi.new("int32_t[]", n_nodes)

    def sample(self, logits_addr: int, mask_addr: int | None = None) -> int:
        """Sample from the row of ``n_vocab`` floats at ``logits_addr`` (no copy),
        inside the allowed-token bitmask at ``mask_addr`` (None: unconstrained)."""
        check(lib.es_sampler_sample(self._ptr, ffi.cast("const float *", logits_addr),
                                    _mask(mask_addr), self._tok), "es_sampler_sample")
        return self._tok[0]

    def verify(self, logits_addr: int, tokens: list[int], parents: list[int] | None = None,
               probs_addr: int | None = None, masks_addr: int | None = None) -> list[int]:
        """Verify a draft against (n_nodes + 1, n_vocab) logits rows (see es_verify),
        each row restricted to its allowed-token bitmask when ``masks_addr`` holds
        (n_nodes + 1, mask_words(n_vocab)) uint32 words.

        Returns the tokens to append: the accepted ones, then the target's own;
        ``rows`` then holds the logits row each was chosen from. An empty draft
        is plain sampling of row 0. Every returned token is recorded in the
        penalty history.
        """
        n = len(tokens)
        if n > self._cap:
            self._grow(n)
        tree = self._tree
        tree.n_nodes = n
        self._draft_tokens[0:n] = tokens
        tree.tokens = self._draft_tokens
        if parents is None:
            tree.parents = ffi.NULL
        else:
            self._draft_parents[0:n] = parents
            tree.parents = self._draft_parents
        tree.probs = ffi.cast("const float *", probs_addr) if probs_addr else ffi.NULL
        tree.masks = _mask(masks_addr)
        status = lib.es_verify(self._ptr, ffi.cast("const float *", logits_addr), tree,
                               self._out_tokens, self._out_path, self._n_out)
        if status == lib.ES_ERR_EMPTY and not masks_addr:
            # Unconstrained, only NaN or -inf rows leave nothing: arithmetic
            # gone non-finite, which either backend reports the same way.
            raise BackendError("the model computed no usable logits (every one NaN or -inf): its "
                               "weights are damaged or overflow")
        check(status, "es_verify")
        n_out = self._n_out[0]
        self.rows = [0] + [p + 1 for p in ffi.unpack(self._out_path, n_out - 1)]
        return ffi.unpack(self._out_tokens, n_out)

    def accept(self, token: int) -> None:
        lib.es_sampler_accept(self._ptr, token)

    def reset(self) -> None:
        lib.es_sampler_reset(self._ptr)

    def probs(self, logits_addr: int, mask_addr: int | None = None):
        """The final distribution of one row, as a new numpy array (for tests and tools)."""
        import numpy as np

        out = np.empty(self.n_vocab, dtype=np.float32)
        check(lib.es_sampler_probs(self._ptr, ffi.cast("const float *", logits_addr), _mask(mask_addr),
                                   ffi.cast("float *", out.ctypes.data)), "es_sampler_probs")
        return out


def mask_words(n_vocab: int) -> int:
    """uint32 words of one allowed-token bitmask (ES_MASK_WORDS)."""
    return (n_vocab + 31) // 32


def _mask(addr: int | None):
    return ffi.cast("const uint32_t *", addr) if addr else ffi.NULL


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its
    logits row, before penalties, temperature and grammar), and the ``top``
    most likely tokens of that row as (token, logprob), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits_addr: int, n_vocab: int, rows: list[int], tokens: list[int],
                   top: int | None) -> list[TokenLogprob] | None:
    """Each token's TokenLogprob under its row of the (n_rows, n_vocab) logits
    at ``logits_addr`` (read in place); None when ``top`` is None (not asked for)."""
    if top is None:
        return None
    import numpy as np

    out = []
    for row, token in zip(rows, tokens):
        x = np.frombuffer(ffi.buffer(ffi.cast("float *", logits_addr) + row * n_vocab, 4 * n_vocab),
                          dtype=np.float32)  # (n_vocab)
        m = float(x.max())
        lse = m + float(np.log(np.exp(x.astype(np.float64) - m).sum()))
        best = []
        if top:
            idx = np.argpartition(-x, top - 1)[:top]
            idx = idx[np.lexsort((idx, -x[idx]))]   # most likely first, ties by token id
            best = [(int(i), float(x[i]) - lse) for i in idx]
        out.append(TokenLogprob(int(token), float(x[token]) - lse, best))
    return out
