"""Draft head (EAGLE-1): one decoder layer over the target's own hidden
states drafts a chain (the C core's ``es_head``; its file format is in
csrc/native/es_native.h, "Draft heads").

The head keeps a cache of rows, one per context position p: the target's
feature at p (its hidden state after the final norm, which the native
backend keeps beside the logits: ``keep_features``) and the token at p + 1.
Its output at the last row is its guess of the next position's feature:
the target's output layer turns it into the first drafted token's logits,
and it goes back in with that token as the next row, and so on. The drafted
rows are dropped after each draft; ``accept`` brings the verified step's
real features (the root's row, then the accepted draft nodes') for the next
draft to append, so the head's cache follows the text with the target's
own features and never a guess.

The head's cache starts at the prompt's last position (the prefill keeps
that row's feature alone: features for every prompt row would take the
vocabulary projection of every row, or a second pass), so its attention
sees the generation's own positions. Under continuous batching the
features read are the selected slot's: a lane whose slot is not selected
when it learns drafts from another generation's features, which costs
acceptance, never exactness (every draft is verified).
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..capi import ffi, lib
from ..costs import DRAFT_COST_FILE, DraftCost, cached_measurement, cost_key, open_seconds
from ..errors import IncompatibleDraftModelError, InvalidArgumentError
from ..models.gguf import GGUFFile, arch_tensors
from ..models.gguf_write import gguf_module, quantize, write_gguf
from ..progress import Progress
from ..sampling import Sampler, SamplingParams
from . import Draft, Drafter, DrafterConfig, Verified, ranks, siblings, specialized
from .model import DRAFT_SEED_XOR, target_fingerprint

ARCH = "eagle"
DRAFT_VOCAB_KEY = f"{ARCH}.draft_vocab"   # the output rows a head was trained to compute
TARGET_N_VOCAB_KEY = f"{ARCH}.target.vocab_size"
TARGET_DIGEST_KEY = f"{ARCH}.target.digest"
CATCH_UP_ROWS = 32   # rows a head's catch-up is timed with (a verified step's accepted tokens, and more)


# -- the file ---------------------------------------------------------------------


def target_digest(target_path: Path) -> int:
    """``es_head_target_digest`` of a target GGUF: what a head records of it."""
    with GGUFFile(target_path) as f:
        out = ffi.new("uint64_t *")
        if lib.es_head_target_digest(f.handle, out) != lib.ES_OK:
            raise InvalidArgumentError(f"{target_path}: no token_embd.weight: not a model a head can draft for")
        return int(out[0])


def write_head(path: Path, target_path: Path, tensors: dict[str, np.ndarray], *, n_head: int, n_head_kv: int,
               n_ff: int, qtype: int | None = None, draft_vocab: int | None = None,
               recipe: dict | None = None, langs: Sequence[str] = (), profile: Sequence[str] = ()) -> None:
    """Writes a head file for the target GGUF at ``target_path``: ``tensors``
    (float arrays in numpy order: fc_feature.weight, fc_token.weight,
    optionally fc.bias, and blk.0.* of the target's architecture), matrices
    as ``qtype`` (default F32; vectors always F32), the target's identity
    and the tensors' digest; ``draft_vocab``, the output rows it was trained
    to compute (``eagle.draft_vocab``: the drafter's default --draft-vocab);
    and, as a specialized drafter's (``specialized.KEY_*``: what routes it
    in a target's drafter set), its languages, its text's character profile
    and how it was made (``recipe``, JSON)."""
    gguf = gguf_module()
    with GGUFFile(target_path) as f:
        arch = f.get("general.architecture")
        name = f.get("general.name") or Path(target_path).stem
        n_embd = f.get(f"{arch}.embedding_length")
        n_layer = f.get(f"{arch}.block_count")
        eps = f.get(f"{arch}.attention.layer_norm_rms_epsilon")
        rope_base = f.get(f"{arch}.rope.freq_base", 10000.0)
        n_vocab = f.tensor("token_embd.weight").shape[-1]
    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    data, infos, digest = [], [], 0
    for tname, w in tensors.items():
        t = gguf.GGMLQuantizationType.F32 if w.ndim == 1 else qtype
        arr = np.ascontiguousarray(quantize(w, t))
        digest = lib.es_head_digest(digest, tname.encode(), ffi.from_buffer(arr), arr.nbytes)
        data.append(arr)
        infos.append((tname, w.shape, int(t), arr.nbytes))

    def keys(w) -> None:
        w.add_name(f"draft head for {name}")
        w.add_uint32(f"{ARCH}.embedding_length", n_embd)
        w.add_uint32(f"{ARCH}.block_count", 1)
        w.add_uint32(f"{ARCH}.attention.head_count", n_head)
        w.add_uint32(f"{ARCH}.attention.head_count_kv", n_head_kv)
        w.add_uint32(f"{ARCH}.feed_forward_length", n_ff)
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", eps)
        w.add_float32(f"{ARCH}.rope.freq_base", rope_base)
        w.add_string(f"{ARCH}.target.name", name)
        w.add_string(f"{ARCH}.target.architecture", arch)
        w.add_uint32(TARGET_N_VOCAB_KEY, n_vocab)
        w.add_uint32(f"{ARCH}.target.block_count", n_layer)
        w.add_uint64(TARGET_DIGEST_KEY, target_digest(target_path))
        w.add_uint64(f"{ARCH}.digest", digest)
        if draft_vocab:
            w.add_uint32(DRAFT_VOCAB_KEY, draft_vocab)
        if recipe is not None:
            w.add_string(specialized.KEY_RECIPE, json.dumps(recipe, ensure_ascii=False))
        if langs:
            w.add_string(specialized.KEY_TARGET, name)
            w.add_array(specialized.KEY_LANGS, list(langs))
            w.add_array(specialized.KEY_PROFILE, list(profile))

    write_gguf(Path(path), ARCH, keys, infos, iter(data), Progress("head", 0, enabled=False))


def random_head(target_path: Path, path: Path, *, n_ff: int | None = None, seed: int = 0,
                qtype: int | None = None, gain: float = 1.0) -> dict[str, np.ndarray]:
    """Writes an untrained head for a target (weights N(0, gain / fan-in),
    norms 1; heads as the target's, ``n_ff`` default the target's) and
    returns its float tensors: the tests' and the cost measurement's head."""
    with GGUFFile(target_path) as f:
        arch = f.get("general.architecture")
        n_embd = f.get(f"{arch}.embedding_length")
        n_head = f.get(f"{arch}.attention.head_count")
        n_head_kv = f.get(f"{arch}.attention.head_count_kv", n_head)
        n_ff = n_ff or f.get(f"{arch}.feed_forward_length")
    head_dim = n_embd // n_head
    dims = {"1": 1, "n_embd": n_embd, "n_ff": n_ff, "n_q": n_head * head_dim, "n_k": n_head_kv * head_dim,
            "n_v": n_head_kv * head_dim, "head_dim": head_dim}
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal((n_embd, n_embd)).astype(np.float32) * np.float32(gain / np.sqrt(n_embd))
               for name in ("fc_feature.weight", "fc_token.weight")}
    for spec in arch_tensors(arch):
        if not (spec.layer and spec.required) or spec.flags & lib.ES_TENSOR_EXPERTS:
            continue
        shape = tuple(dims[d] for d in reversed(spec.dims))   # numpy order
        if len(shape) == 1:
            w = np.ones(shape, dtype=np.float32)
        else:
            w = rng.standard_normal(shape).astype(np.float32) * np.float32(gain / np.sqrt(shape[1]))
        tensors[f"blk.0.{spec.name}"] = w
    write_head(path, target_path, tensors, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, qtype=qtype)
    return tensors


def check_target(target, path: Path) -> None:
    """Whether the head at ``path`` was made for ``target`` (anything with
    the target GGUF's ``path``: a backend, a vocabulary), without opening
    it: IncompatibleDraftModelError naming both when not."""
    with GGUFFile(path) as f:
        made_for, name = f.get(TARGET_DIGEST_KEY), f.get(f"{ARCH}.target.name")
    if made_for != target_digest(target.path):
        raise IncompatibleDraftModelError(f"draft head {Path(path).name} was made for {name}, "
                                          f"not {Path(target.path).name}")


def backend_problem(target) -> str | None:
    """Why a head cannot draft on ``target``'s backend (None: it can; a bare
    vocabulary, which has no backend name, is not asked)."""
    if getattr(target, "name", None) is not None and not hasattr(target, "open_head"):
        return f"a draft head drafts on the native backend's features, not the {target.name} backend's"
    return None


def trained_draft_vocab(path: Path) -> int | None:
    """The output rows the head at ``path`` was trained to compute, if it says."""
    with GGUFFile(path) as f:
        return f.get(DRAFT_VOCAB_KEY)


def recipe(path: Path) -> dict | None:
    """How the head at ``path`` was made (drafter train-head), if it says."""
    with GGUFFile(path) as f:
        text = f.get(specialized.KEY_RECIPE)
    return json.loads(text) if text else None


# -- its cost ---------------------------------------------------------------------


def measure_head_cost(target, head, *, reps: int = 5, prefix: int = 64) -> DraftCost:
    """A head's one-row step and its CATCH_UP_ROWS-row batch (per row)
    against the target's one-token step, interleaved, the fastest of
    ``reps`` each. Leaves the target's cache cleared and the head's empty."""
    tokens = target.tokenize("The quick brown fox jumps over the lazy dog. " * 16)
    while len(tokens) < prefix + CATCH_UP_ROWS:
        tokens += tokens
    rng = np.random.default_rng(0)
    features = rng.standard_normal((prefix + CATCH_UP_ROWS, target.n_embd)).astype(np.float32)
    target.clear()
    head.truncate(0)
    target.decode(tokens[:prefix])
    head.decode(features[:prefix], tokens[1:prefix + 1], prefix)
    best = {"target": float("inf"), "head": float("inf"), "batch": float("inf")}
    runs = (("target", lambda: target.decode(tokens[prefix:prefix + 1]), lambda: target.truncate(prefix)),
            ("head", lambda: head.decode(features[prefix:prefix + 1], tokens[prefix:prefix + 1], 0),
             lambda: head.truncate(prefix)),
            ("batch", lambda: head.decode(features[prefix:], tokens[prefix:prefix + CATCH_UP_ROWS],
                                          CATCH_UP_ROWS - 1), lambda: head.truncate(prefix)))
    for _ in range(reps):
        for name, run, undo in runs:
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
            undo()
    target.clear()
    head.truncate(0)
    return DraftCost(best["head"] / best["target"], best["batch"] / CATCH_UP_ROWS / best["target"])


def head_cost(target, path: Path, output_rows: int, open_head, *, remeasure: bool = False) -> DraftCost:
    """The cached cost of a head file computing ``output_rows`` logits beside
    ``target``, measured when missing on the head ``open_head()`` returns
    (so a head of known cost is not opened for it)."""
    st = Path(path).stat()
    value = cached_measurement(
        DRAFT_COST_FILE, f"{cost_key(target)}|head:{Path(path).name}:{st.st_size}:rows-{output_rows}",
        "cost", lambda: measure_head_cost(target, open_head()).to_list(),
        lambda v: isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in v),
        remeasure=remeasure, notice=f"the cost of draft head {Path(path).name} beside {Path(target.path).name}")
    return DraftCost(*value)


# -- the drafter ------------------------------------------------------------------


class HeadDrafter(Drafter):
    name = "head"
    costly = True
    prior = 0.6   # a trained head's acceptance, as EAGLE reports it, a little lower

    def __init__(self, config: DrafterConfig):
        path = config.options.head
        if not path:
            raise InvalidArgumentError("the head drafter needs a draft head file (--head FILE)")
        target = config.target
        problem = backend_problem(target)
        if problem is not None:
            raise InvalidArgumentError(problem)
        self.path = Path(path)
        self.target = target
        self._n_ctx = config.n_ctx
        # The head opens when the planner first asks it for a draft (a short
        # answer, or a request routed elsewhere, never may); its cost comes
        # from the cache without opening it.
        self._head = None
        self._open_s = open_seconds(self.path)   # what opening it is expected to take (opening())
        self._sampler: Sampler | None = None
        try:
            draft_vocab = config.options.draft_vocab or trained_draft_vocab(self.path)
            self._rows = (ranks.top_tokens(target_fingerprint(target), draft_vocab, target.n_vocab, self.path.name)
                          if draft_vocab and draft_vocab < target.n_vocab else None)
            self.cost = head_cost(target, self.path, target.n_vocab if self._rows is None else len(self._rows),
                                  lambda: self.head)
        except BaseException:
            self.close()
            raise
        self.n_vocab = target.n_vocab
        self._constraint = None
        self._probs = np.empty((0, self.n_vocab), dtype=np.float32)   # (max_draft, n_vocab) q rows
        self._base = 0          # context position of the head cache's first row
        self._pending = np.empty((0, target.n_embd), dtype=np.float32)  # real features after the cache's rows
        self._length = 0        # the context's length when the next step is drafted
        self._prefill = False   # the target's last evaluation was the prompt's: its last row is ours
        self.n_drafts = 0
        self.n_rows = 0         # rows the head evaluated (real and drafted)
        self.n_trees = 0        # drafts widened with runner-up leaves

    @property
    def head(self):
        """The head (``NativeHead``), opened on first use."""
        if self._head is None:
            self._head = self.target.open_head(self.path, n_ctx=self._n_ctx)
            if self._rows is not None:
                self._head.restrict_output(self._rows)
        return self._head

    def opening(self) -> float:
        return 0.0 if self._head is not None else self._open_s

    def open(self) -> None:
        self.head   # the property opens it

    def backlog(self, context: Sequence[int]) -> int:
        """Real rows the head evaluates before drafting: a step's root and
        accepted nodes, and those of every step it was not asked at."""
        return len(self._pending) + self._prefill

    def _held(self) -> int:
        """Rows in the head's cache (none before it opens)."""
        return self._head.n_past if self._head is not None else 0

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """Keep the target's features from the prompt's evaluation on; the head starts empty."""
        self.target.keep_features(True)
        if self._sampler is not None:
            self._sampler.close()
        self._sampler = Sampler(replace(sampling, seed=sampling.seed ^ DRAFT_SEED_XOR), self.n_vocab)
        self._restart(max(len(prompt) - 1, 0))   # the prompt's last position: its feature comes first
        self._length = len(prompt) + 1   # the prompt's step samples one token
        self._prefill = True

    def constrain(self, constraint) -> None:
        self._constraint = constraint

    def _restart(self, position: int) -> None:
        """The head's cache empty, its next row at context ``position``."""
        if self._head is not None:
            self._head.truncate(0)
        self._base = position
        self._pending = self._pending[:0]

    def _take(self, features: np.ndarray, position: int) -> None:
        """Real features of positions [position, position + len(features)) after the rows held."""
        if position != self._base + self._held() + len(self._pending):
            self._restart(position)   # a gap (steps this drafter did not see): start again there
        self._pending = np.concatenate([self._pending, features])

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        self.backlog_seconds = 0.0
        if len(context) != self._length:   # begun on a context already stepped (a context shift)
            self._length = len(context)
            if not self._prefill:
                self._restart(len(context) - 1)
        if self._prefill:   # the last evaluation's last row: the feature of the context's next-to-last position
            self._take(self.target.features()[-1:], len(context) - 2)
            self._prefill = False
        greedy = self._sampler.params.greedy
        n = len(self._pending)
        if (max_tokens <= 0 or n == 0
                or self._base + self.head.n_past + n != len(context) - 1
                or self.head.n_past + n + max_tokens > self.head.n_ctx
                or (self._constraint is not None and not greedy)):   # q would have to follow the grammar
            return Draft(source=self.name)
        self.n_drafts += 1
        # The real rows: feature at p, token at p + 1; the last one's output drafts.
        first = len(context) - 1 - n
        t0 = time.perf_counter()
        for at in range(0, n, self.head.n_batch):
            end = min(n, at + self.head.n_batch)
            logits = self.head.decode(self._pending[at:end], context[first + at + 1:first + end + 1], end - at - 1)
        # Rows beyond those a head asked at every step evaluates (its root
        # and accepted nodes) are steps it was not asked at: catching up.
        per_step = max_tokens + 1
        self.backlog_seconds = (time.perf_counter() - t0) * (n - per_step) / n if n > per_step else 0.0
        self.n_rows += n
        self._pending = self._pending[:0]
        real = self.head.n_past
        params = self._sampler.params
        if params.penalized:   # the penalty window holds the text's tail (drafts are not text)
            for t in context[-params.repeat_last_n:]:
                self._sampler.accept(t)
        if not greedy and self._probs.shape[0] < max_tokens:
            self._probs = np.empty((max_tokens, self.n_vocab), dtype=np.float32)
        want_runners = greedy and siblings.wanted(self.planner, self.name, max_tokens)
        tokens: list[int] = []
        runners: list[tuple] = []
        confidence: list[float] = []   # greedy: the head's probability of each token
        i = 0
        while True:
            if not greedy:
                self._probs[i] = self._sampler.probs(logits)
            tok = self._sampler.sample(logits)
            if want_runners:
                runners.append(siblings.runner_up(logits, self.n_vocab, tok, self._rows))
                confidence.append(runners[-1][1])
            elif greedy:
                confidence.append(siblings.probability(logits, self.n_vocab, tok, self._rows))
            self._sampler.accept(tok)
            tokens.append(tok)
            i += 1
            # Past what it was asked for, a greedy chain goes on while the
            # head is sure enough of it that one token more pays.
            further = (i >= max_tokens and greedy and self.planner is not None
                       and self.head.n_past < self.head.n_ctx and self.planner.draft_further(self.name, confidence))
            if i >= max_tokens and not further:
                break
            logits = self.head.decode(self.head.hidden(), [tok], 0)
            self.n_rows += 1
        self.head.truncate(real)
        if greedy:
            draft, widened = siblings.widen(self.planner, self.name, tokens, runners)
            self.n_trees += widened
            return replace(draft, confidence=confidence)
        return Draft(tokens=tokens, probs=self._probs.ctypes.data, source=self.name)

    def accept(self, step: Verified) -> None:
        """The step's real features: the root's row, then the accepted nodes'."""
        rows = self.target.features(step.slot)   # this generation's rows, also beside others in a batch
        root = self._length - 1
        self._length += len(step.tokens)
        self._prefill = False
        if len(rows) != len(step.row_tokens):
            return   # not this step's rows: the next draft starts again
        self._take(rows[[0, *(1 + i for i in accepted_nodes(step.draft, step.tokens, step.n_accepted))]], root)

    def stats(self) -> dict:
        return {"head": self.path.name, "drafts": self.n_drafts, "head_rows_evaluated": self.n_rows,
                "trees": self.n_trees}

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        if self._head is not None:
            self._head.close()
            self._head = None


def accepted_nodes(draft: Draft, tokens: Sequence[int], n_accepted: int) -> list[int]:
    """The draft's nodes the target accepted, root to leaf: a chain's first
    ``n_accepted``, or a tree's path, each node the child of the one before
    whose token the text took (``tokens``: the step's)."""
    if draft.parents is None:
        return list(range(n_accepted))
    path, node = [], -1
    for tok in tokens[:n_accepted]:
        node = next(j for j, (p, t) in enumerate(zip(draft.parents, draft.tokens)) if p == node and t == tok)
        path.append(node)
    return path


DRAFTER = HeadDrafter
