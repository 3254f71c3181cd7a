"""Embeddings: the token sequences an ``embed`` call evaluates, and the one
vector per input pooled from their hidden states (after the model's final
norm) as the model's GGUF ``<arch>.pooling_type`` says."""
from __future__ import annotations

import numpy as np

from .backends import Backend
from .errors import ContextOverflowError, InvalidArgumentError, UnsupportedModelError, check_whole
from .prompting import Prompter, is_token
from .text import utf8_text

# GGUF <arch>.pooling_type (llama.cpp's enum) -> how token states are pooled;
# absent or 0 (none): the mean.
POOLING = {0: "mean", 1: "mean", 2: "cls", 3: "last"}


def pooling(backend: Backend, model_ref: str) -> str:
    """The model's own pooling (mean, cls = first token, last), else mean;
    UnsupportedModelError for one embeddings cannot use (a reranker's).
    Under the engine's ``reading`` guard."""
    arch = backend.metadata("general.architecture")
    value = backend.metadata(f"{arch}.pooling_type")
    if value is None:
        return "mean"
    kind = POOLING.get(int(value)) if value.isdigit() else None
    if kind is None:
        raise UnsupportedModelError(f"{model_ref}: pooling type {value} (a reranker?) is not "
                                    "one embeddings can use (mean, cls, last)")
    return kind


def inputs_tokens(prompter: Prompter, inputs, *, truncate: bool = False,
                  n_ctx: int | None = None) -> list[list[int]]:
    """The token sequences for ``inputs``: a string, a list of strings, a
    list of token ids or a list of such lists (OpenAI's ``input``); with
    ``truncate``, one longer than the context (``n_ctx``, at most the
    backend's) is cut to its first n_ctx tokens (Ollama's default) instead
    of refused."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and is_token(inputs[0])):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidArgumentError("input must be a non-empty string, list of strings, "
                                   "list of token ids or list of such lists")
    n_ctx = min(n_ctx or prompter.backend.n_ctx, prompter.backend.n_ctx)
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise InvalidArgumentError(f"input {i} is an empty string")
            tokens = prompter.tokenize(utf8_text(item, f"input {i}"))
        elif isinstance(item, (list, tuple)) and item and all(is_token(t) for t in item):
            tokens = prompter.known_tokens(item, f"input {i}")
        else:
            raise InvalidArgumentError(f"input {i} must be a non-empty string or list of token ids")
        if not tokens:
            raise InvalidArgumentError(f"input {i} has no tokens")
        if truncate:
            tokens = tokens[:n_ctx]
        if len(tokens) > n_ctx:
            raise ContextOverflowError(f"input {i} is {len(tokens)} tokens but the context holds {n_ctx}")
        out.append(tokens)
    return out


def pool(states: list[np.ndarray], how: str, *, normalize: bool = True,
         dimensions: int | None = None) -> np.ndarray:
    """One ``(n, n_embd)`` float32 vector per sequence's ``(n_tokens, n_embd)``
    states, pooled ``how``; ``dimensions``: only the first so many of each,
    scaled after the cut; unit length unless ``normalize`` is False."""
    if how == "cls":
        vectors = np.stack([s[0] for s in states])
    elif how == "last":
        vectors = np.stack([s[-1] for s in states])
    else:
        vectors = np.stack([s.mean(axis=0, dtype=np.float64) for s in states]).astype(np.float32)
    if dimensions is not None:
        check_whole("dimensions", dimensions, 1)
        if dimensions > vectors.shape[1]:
            raise InvalidArgumentError(f"dimensions must be at most {vectors.shape[1]} for this model, "
                                       f"got {dimensions}")
        vectors = np.ascontiguousarray(vectors[:, :dimensions])
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1)
    return vectors
