"""Specialized drafters: the contract between the trainer and the engine.

A specialized drafter is a small llama-architecture GGUF trained for one
target model and one language or domain (Yi et al. 2024). It keeps only the
target tokens its language uses: drafter token ``i`` stands for target token
``token_map[i]``; a target token outside the map is fed to the drafter as
``unk_id``. The drafter's tokenizer metadata is the target's, cut down to the
kept tokens, so llama.cpp loads the file too.

Metadata keys written by ``edgespec drafter train`` and read by the engine,
the router and ``edgespec drafter list``:
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Iterable

KEY_TARGET = "edgespec.drafter.target"                # str: the target it was trained for (name or file name)
KEY_TARGET_VOCAB = "edgespec.drafter.target_vocab"    # str: vocab_fingerprint() of the target
KEY_TARGET_N_VOCAB = "edgespec.drafter.target_n_vocab"  # uint32: the target's vocabulary size
KEY_TOKEN_MAP = "edgespec.drafter.token_map"          # uint32 array (n_vocab_drafter,): drafter id -> target id
KEY_UNK = "edgespec.drafter.unk_id"                   # uint32: drafter id fed for target tokens outside the map
KEY_LANGS = "edgespec.drafter.langs"                  # str array: languages / domains ("python", "deu", ...)
KEY_PROFILE = "edgespec.drafter.profile"              # str array: char_profile() of its training text
KEY_RECIPE = "edgespec.drafter.recipe"                # str: JSON of the command, data, seed, steps, held-out figures

PROFILE_N = 3       # character n-gram length of a profile
PROFILE_TOP = 400   # n-grams kept in a drafter's profile


def vocab_fingerprint(token_texts: Iterable[str | bytes]) -> str:
    """sha256 (hex) over the target's token texts in id order, each UTF-8
    encoded and followed by a NUL byte: equal fingerprints mean the same ids."""
    return hashlib.sha256(b"".join((t.encode("utf-8", "surrogatepass") if isinstance(t, str) else t) + b"\0"
                                   for t in token_texts)).hexdigest()


def char_profile(texts: Iterable[str], n: int = PROFILE_N, top: int = PROFILE_TOP) -> list[str]:
    """The ``top`` most frequent character n-grams of ``texts`` (case folded,
    runs of whitespace kept as one space or newline), most frequent first;
    ties broken by the n-gram itself so the profile is deterministic."""
    counts: Counter[str] = Counter()
    for text in texts:
        folded = normalise(text)
        counts.update(folded[i:i + n] for i in range(len(folded) - n + 1))
    return [g for g, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]


def normalise(text: str) -> str:
    """``text`` as profiles compare it: case folded, each run of whitespace one
    newline (if it holds one) or one space."""
    out: list[str] = []
    for ch in text.casefold():
        if ch.isspace():
            ch = "\n" if ch == "\n" else " "
            if out and out[-1] == ch:
                continue
        out.append(ch)
    return "".join(out)


def add_trimmed_tokenizer(writer, target_reader, keep) -> None:
    """The target's tokenizer cut down to the target ids ``keep`` (drafter id
    i = target id keep[i]) onto ``writer`` (a gguf.GGUFWriter): the kept
    tokens and their types, the merges whose pieces and result are all kept,
    special-token ids moved to their drafter ids (dropped when not kept), and
    every other tokenizer key (model, pre-tokenizer, chat template) as is, so
    llama.cpp loads the drafter with the target's tokenizer rules."""
    import gguf

    from ..models.gguf_write import field_value

    keys = gguf.Keys.Tokenizer
    fields = target_reader.fields
    tokens = field_value(fields[keys.LIST])
    kept = [tokens[i] for i in keep]
    index = {t: i for i, t in enumerate(kept)}
    target_to_drafter = {t: i for i, t in enumerate(keep)}
    writer.add_token_list(kept)
    if keys.TOKEN_TYPE in fields:
        types = field_value(fields[keys.TOKEN_TYPE])
        writer.add_token_types([types[i] for i in keep])
    if keys.MERGES in fields:
        merges = field_value(fields[keys.MERGES])
        writer.add_token_merges([m for m in merges
                                 if all(p in index for p in (*m.split(b" "), m.replace(b" ", b"")))])
    for key, field in fields.items():
        if not key.startswith("tokenizer.") or key in (keys.LIST, keys.TOKEN_TYPE, keys.MERGES, keys.SCORES):
            continue
        value = field_value(field)
        if key.endswith("_token_id"):
            if value not in target_to_drafter:
                continue
            value = target_to_drafter[value]
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    if keys.SCORES in fields:
        scores = field_value(fields[keys.SCORES])
        writer.add_token_scores([scores[i] for i in keep])
