"""Draft model: a small GGUF model with the target's tokenizer proposes a chain.

Its KV cache persists across steps: each draft only evaluates the tokens the
text gained since the last one (the common prefix with what the cache holds
is kept). Under sampling it draws from its own distribution q with the
target's sampling settings and hands q's rows to verification.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..backends import open_backend, resolve_model
from ..errors import IncompatibleDraftModelError, InvalidArgumentError
from ..sampling import Sampler, SamplingParams
from . import Draft, Drafter, DrafterConfig

DRAFT_SEED_XOR = 0x5EED_D4AF_7000_0001  # keeps the draft's draws independent of the target's

# Metadata that must agree between draft and target for token ids to mean the same.
_SPECIAL = ("bos_token", "eos_token")


def check_compatible(target, draft, draft_ref: str) -> None:
    """Raise IncompatibleDraftModelError naming the first difference."""
    if draft.n_vocab != target.n_vocab:
        raise IncompatibleDraftModelError(
            f"draft model {draft_ref} has a vocabulary of {draft.n_vocab} tokens, the target {target.n_vocab}")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        a, b = target.metadata(key), draft.metadata(key)
        if a != b:
            raise IncompatibleDraftModelError(f"draft model {draft_ref} has {key} = {b!r}, the target {a!r}")
    for attr in _SPECIAL:
        a, b = getattr(target, attr), getattr(draft, attr)
        if a != b:
            raise IncompatibleDraftModelError(f"draft model {draft_ref} has {attr} {b}, the target {a}")
    for t in range(target.n_vocab):
        a, b = target.token_text(t), draft.token_text(t)
        if a != b:
            raise IncompatibleDraftModelError(
                f"draft model {draft_ref}: token {t} is {b!r} but the target's is {a!r}")


class ModelDrafter(Drafter):
    name = "model"
    costly = True

    def __init__(self, config: DrafterConfig):
        if not config.draft_model:
            raise InvalidArgumentError("the model drafter needs a draft model (--draft-model NAME|PATH)")
        # The draft model may run on another backend and device than the target
        # (e.g. on an NPU through onnxruntime while llama.cpp runs the target).
        name = config.draft_backend or config.target.name
        # Its cache follows the target's text, also past its own training context.
        self.backend = open_backend(name, resolve_model(name, config.draft_model), n_ctx=config.n_ctx,
                                    threads=config.threads, ep=config.ep, ctx_extend=True)
        try:
            check_compatible(config.target, self.backend, config.draft_model)
        except Exception:
            self.backend.close()
            raise
        self.n_vocab = self.backend.n_vocab
        self._sampler: Sampler | None = None
        self._constraint = None   # the generation's grammar, drafted inside
        self._probs = np.empty((0, self.n_vocab), dtype=np.float32)  # (max_draft, n_vocab) q rows
        self.n_drafts = 0
        self.n_evaluated = 0

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """Draft with the target's sampling settings on an RNG stream of its own."""
        if self._sampler is not None:
            self._sampler.close()
        self._sampler = Sampler(replace(sampling, seed=sampling.seed ^ DRAFT_SEED_XOR), self.n_vocab)

    def constrain(self, constraint) -> None:
        self._constraint = constraint

    def _sync(self, context: Sequence[int]) -> int:
        """Bring the cache up to ``context``; returns the last row's logits address."""
        keep = self.backend.reuse_prefix(context)
        self.n_evaluated += len(context) - keep
        return self.backend.decode(context[keep:])

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(context) + max_tokens >= self.backend.n_ctx:
            return Draft(source=self.name)
        self.n_drafts += 1
        greedy = self._sampler.params.greedy
        if not greedy and self._probs.shape[0] < max_tokens:
            self._probs = np.empty((max_tokens, self.n_vocab), dtype=np.float32)
        logits = self._sync(context)
        params = self._sampler.params
        if params.penalized:
            # Refill the penalty window with the text's tail (drafts are not text).
            for t in context[-params.repeat_last_n:]:
                self._sampler.accept(t)
        tokens: list[int] = []
        with self._constraint.lookahead() if self._constraint else nullcontext() as look:
            for i in range(max_tokens):
                mask = look.mask() if look else None   # q inside the grammar, as p is
                if greedy:
                    tok = self._sampler.sample(logits, mask)
                else:
                    row = self._probs[i]
                    row[:] = self._sampler.probs(logits, mask)
                    tok = self._sampler.sample(logits, mask)
                self._sampler.accept(tok)
                tokens.append(tok)
                if look and not look.push(tok):
                    break
                if i + 1 < max_tokens:
                    logits = self.backend.decode([tok])
                    self.n_evaluated += 1
        return Draft(tokens=tokens, probs=None if greedy else self._probs.ctypes.data, source=self.name)

    def stats(self) -> dict:
        return {"drafts": self.n_drafts, "draft_tokens_evaluated": self.n_evaluated}

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self.backend.close()


DRAFTER = ModelDrafter
