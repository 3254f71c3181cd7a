"""Making token rankings (edgespec.drafters.ranks) from text.

``edgespec drafter rank --model M`` tokenizes a sample of every language of
the dataset-build wheel and of the Python standard library (English and
Python weighing more) with M's tokenizer (the benchmark suites' text held out, as for distillation), counts
each token, and writes the ids most used first, the vocabulary's control
tokens (end of turn, tool-call markers) at the very top so that a trimmed
draft head can always end a turn. Ties keep id order, so a ranking is
reproducible.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..backends.vocab import Vocab
from ..drafters import ranks
from ..drafters.model import target_fingerprint
from ..files import write_atomic
from ..models import registry
from ..models.gguf import GGUFFile
from ..progress import Progress
from . import corpus

DEFAULT_CHARS = 4_000_000   # characters of text counted, spread over the languages
CONTROL = 3                 # llama.cpp's token type of control tokens
# English and Python (dataset-build's and the standard library's) count this
# many times a language's share: what the built-in models are mostly asked in.
HEAVY = 8


def rank_tokens(model: str, *, chars: int = DEFAULT_CHARS, progress: bool = True) -> Path:
    """Rank model ``model``'s vocabulary by use over ``chars`` characters of
    text; writes ``$EDGESPEC_HOME/token-ranks/<fingerprint>.npy`` and returns its path."""
    path = registry.model_path_checked(model)
    with GGUFFile(path) as f:
        types = f.get("tokenizer.ggml.token_type") or []
    langs = corpus.dataset_build_langs(corpus.dataset_build_wheel(progress))
    share = chars / (len(langs) + 2 * (HEAVY - 1) + HEAVY)   # English and Python weigh HEAVY, the rest 1
    held_out = corpus.HeldOut.suites()
    texts = []
    for lang in langs:
        text = "\n\n".join(t for _, t in corpus.source_texts(lang, ["dataset-build"], progress=progress))
        texts.append((lang, text[:int(share * (HEAVY if lang in ("eng", "python") else 1))]))
    code = "".join(text for _, text in corpus.source_texts("python", ["python-stdlib"], progress=progress))
    texts.append(("python-stdlib", code[:int(share * HEAVY)]))
    docs, _ = corpus.documents(texts, held_out)
    with Vocab.load(path) as vocab:
        counts = np.zeros(vocab.n_vocab, dtype=np.int64)
        bar = Progress(f"rank {Path(path).name}", len(docs), enabled=progress)
        for doc in docs:
            counts += np.bincount(vocab.tokenize(doc.text, add_special=False), minlength=vocab.n_vocab)
            bar.update()
        bar.done()
        control = np.array([i for i, t in enumerate(types) if t == CONTROL], dtype=np.int64)
        counts[control] = counts.max() + 1     # always kept
        order = np.argsort(-counts, kind="stable").astype(np.int32)
        out = ranks.user_folder() / ranks.rank_name(target_fingerprint(vocab))
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, order, allow_pickle=False)
    write_atomic(out, buf.getvalue())
    return out
