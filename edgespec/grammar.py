"""Structured output: JSON schemas and grammars enforced token by token.

llguidance (the grammar engine llama.cpp and vLLM use) compiles a JSON schema,
a Lark or GBNF grammar, or a regex; for each position of a generation it
computes the bitmask of the tokens that keep the text inside the grammar.
The C sampler applies the masks (es_sampler_sample, es_verify's per-row
masks), so greedy, sampling and speculative verification all stay inside the
grammar, and verification stays exact for the constrained distribution.

    Grammar.json_schema(schema) / Grammar.json_object() / Grammar.from_text(lark_or_gbnf)
      -> Constraint(grammar, tokenizer, n_vocab), one per generation:
           masks(draft) -> (draft pruned to what the grammar allows, masks address)
           advance(tokens)  after verification
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .drafters import Draft
from .errors import GrammarError
from .sampling import mask_words


MAX_DIGITS = 16             # digits of an integer or a number's integer part, as llama.cpp's grammars allow
NUMBER_STEP = 1e-10         # a number's fraction: at most 10 digits (llguidance's finest multipleOf)
_LIMIT = 10 ** MAX_DIGITS - 1
# Where a schema holds subschemas: keys holding one, and keys holding a list or a map of them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_schema(schema):
    """``schema`` made to end, as llama.cpp's JSON-schema grammars do: an
    integer without bounds gets +-(10**16 - 1) (16 digits), a number the same
    and at most 10 fraction digits, and an object that lists ``properties``
    without saying ``additionalProperties`` admits no others (llama.cpp's
    convention; an explicit true or schema is kept). Without these a model
    can write digits or keys until max_tokens. A new schema; the argument is
    not changed."""
    if isinstance(schema, list):
        return [bounded_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded_schema(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = bounded_schema(out[key])
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded_schema(v) for k, v in out[key].items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "integer" in kinds or "number" in kinds:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _LIMIT
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a default dependency
        raise GrammarError("structured output needs the grammar engine llguidance: "
                           "pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled-to-spec grammar (llguidance's grammar definition) and what it
    was made from. Construction validates it: a construct the engine cannot
    compile is a GrammarError naming it."""

    spec: str
    source: str   # "json_schema", "json_object", "grammar", "regex"

    @classmethod
    def json_schema(cls, schema: dict | str | bool, *, source: str = "json_schema") -> "Grammar":
        """A JSON schema (a dict, or its JSON text), made to end (``bounded_schema``:
        digits capped, objects admit only the listed properties unless the
        schema says ``additionalProperties``)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object or a boolean, not {type(schema).__name__}")
        llg = _llg()
        try:
            spec = llg.LLMatcher.grammar_from_json_schema(
                json.dumps(bounded_schema(schema)), defaults={"whitespace_flexible": False, "coerce_one_of": True})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"JSON schema: {e}") from None
        return cls._checked(spec, source, "JSON schema")

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"}, source="json_object")

    @classmethod
    def from_text(cls, text: str) -> "Grammar":
        """A Lark grammar (llguidance's dialect: ``%json {...}`` embeds a schema)
        or a GBNF grammar (llama.cpp's ``root ::= ...``)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("the grammar is empty")
        llg = _llg()
        if "::=" in text:
            try:
                text = llg.gbnf_to_lark.any_to_lark(text)
            except Exception as e:  # the converter raises plain exceptions
                raise GrammarError(f"GBNF grammar: {e}") from None
        return cls._checked(llg.LLMatcher.grammar_from_lark(text), "grammar", "grammar")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls._checked(_llg().LLMatcher.grammar_from_regex(pattern), "regex", "regex")

    @classmethod
    def _checked(cls, spec: str, source: str, what: str) -> "Grammar":
        error = _llg().LLMatcher.validate_grammar(spec)
        if error:
            raise GrammarError(f"{what} cannot be compiled: {error.strip()}"[:500])
        return cls(spec, source)


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads of a tokenizer: the token
    table, the special tokens, and a call tokenizing text without them."""

    def __init__(self, vocab, eog: list[int]):
        table = vocab.token_table()
        self.special_token_ids = [t for t, piece in enumerate(table) if piece[:1] == b"\xff"]
        self.tokens = [piece[1:] if piece[:1] == b"\xff" else piece for piece in table]
        self.eos_token_id = eog[0]
        self.bos_token_id = vocab.bos_token if vocab.bos_token >= 0 else None
        self._vocab = vocab

    def __call__(self, text: str) -> list[int]:
        return self._vocab.tokenize(text, add_special=False, parse_special=False)


def tokenizer_for(backend):
    """llguidance's view of a backend's vocabulary: every token's bytes (control
    tokens marked special: vocab.token_table), the backend's own tokenizer,
    and the end-of-generation tokens as the grammar's EOS. About a second for
    a 150k vocabulary: built once per engine."""
    llg = _llg()
    eog = [t for t in range(backend.n_vocab) if backend.is_eog(t)] or [backend.eos_token]
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerView(backend.vocab, eog)), n_vocab=backend.n_vocab,
                           eos_token=eog, slices=None)


class Constraint:
    """One generation's grammar state: the matcher, advanced by every token the
    text gains, and the mask rows of each step's draft."""

    def __init__(self, grammar: Grammar, tokenizer, n_vocab: int):
        llg = _llg()
        self._m = llg.LLMatcher(tokenizer, grammar.spec, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"{grammar.source} cannot be compiled: {self._m.get_error()}"[:500])
        self._words = mask_words(n_vocab)
        # A drafted end-of-generation token is checked against its row but
        # never consumed: llguidance versions disagree on whether a rollback
        # counts it, and nothing follows it in the text anyway. The row after
        # it allows the end tokens only, as the stopped matcher's would.
        self._eos = frozenset(tokenizer.eos_tokens)
        self._eos_row = np.zeros(self._words, dtype=np.uint32)
        for t in self._eos:
            self._eos_row[t >> 5] |= np.uint32(1 << (t & 31))
        self._rows = np.zeros((17, self._words), dtype=np.uint32)   # (n_rows, words), grown on demand

    def _fill(self, row: int) -> None:
        r = self._rows[row]
        self._m.unsafe_compute_mask_ptr(r.ctypes.data, r.nbytes)

    def _allowed(self, row: int, token: int) -> bool:
        return bool((self._rows[row, token >> 5] >> (token & 31)) & 1)

    def masks(self, draft: Draft) -> tuple[Draft, int]:
        """The draft less the nodes the grammar rejects (and their subtrees), and
        the address of its (n_nodes + 1, words) mask rows: row 0 the root's,
        row i + 1 the grammar's state after the path to node i.

        A drafter chain with distributions (``probs``) keeps its first rejected
        node as its last (verification must see it to stay exact: it is then
        rejected for sure and its row never read); everything else drops it,
        which verification would have rejected without consulting the RNG.
        Nothing after an end-of-generation node is kept: the text ends there."""
        n = len(draft)
        if self._rows.shape[0] < n + 1:
            self._rows = np.zeros((2 * (n + 1), self._words), dtype=np.uint32)
        self._fill(0)
        if draft.parents is None:
            kept = self._chain(draft)
        else:
            kept = self._tree(draft)
        return kept, self._rows.ctypes.data

    def _rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def _chain(self, draft: Draft) -> Draft:
        m, tokens = self._m, draft.tokens
        n_ok, ended = 0, False
        while n_ok < len(tokens) and self._allowed(n_ok, tokens[n_ok]):
            ended = tokens[n_ok] in self._eos
            if not ended and not m.consume_token(tokens[n_ok]):
                break
            n_ok += 1
            if ended:          # the text would end here: what follows is not drafted
                self._rows[n_ok] = self._eos_row
                break
            self._fill(n_ok)
        self._rollback(n_ok - ended)
        keep = min(n_ok + 1, len(tokens)) if draft.probs and not ended else n_ok
        if keep == len(tokens):
            return draft
        return Draft(tokens[:keep], None, draft.probs, draft.source, draft.key, draft.prior)

    def _tree(self, draft: Draft) -> Draft:
        m = self._m
        new_index: dict[int, int] = {}      # old node -> index in the pruned tree
        ends: set[int] = set()              # kept end-of-generation nodes: leaves, never consumed
        tokens: list[int] = []
        parents: list[int] = []
        stack: list[int] = []               # old nodes on the matcher's current path
        for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)):
            if p >= 0 and (p not in new_index or p in ends):
                continue                    # below a rejected node, or past the end of the text
            path = self._path(draft.parents, p)
            common = 0
            while common < min(len(stack), len(path)) and stack[common] == path[common]:
                common += 1
            self._rollback(len(stack) - common)
            del stack[common:]
            for node in path[common:]:
                m.consume_token(draft.tokens[node])
                stack.append(node)
            row = new_index[p] + 1 if p >= 0 else 0
            if not self._allowed(row, t):
                continue
            if t in self._eos:
                ends.add(i)
            elif m.consume_token(t):
                stack.append(i)
            else:
                continue
            new_index[i] = len(tokens)
            tokens.append(t)
            parents.append(new_index[p] if p >= 0 else -1)
            if i in ends:
                self._rows[len(tokens)] = self._eos_row
            else:
                self._fill(len(tokens))
        self._rollback(len(stack))
        return Draft(tokens, parents, None, draft.source, draft.key, draft.prior)

    @staticmethod
    def _path(parents: list[int], node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    @contextmanager
    def lookahead(self):
        """For a drafter that samples: a ``Lookahead`` walking one chain ahead of
        the text; every token it took is rolled back on exit."""
        look = Lookahead(self._m, self._words, self._eos)
        try:
            yield look
        finally:
            self._rollback(len(look.tokens))

    def advance(self, tokens: list[int]) -> None:
        """The text gained ``tokens`` (each allowed by its row's mask); it ends
        at an end-of-generation token, so what a step verified past one is
        not text."""
        for t in tokens:
            if not self._m.consume_token(t):
                raise GrammarError(f"token {t} is outside the grammar: {self._m.get_error()}"[:300])
            if t in self._eos:
                break

    @property
    def done(self) -> bool:
        """The grammar admits nothing more but the end of generation."""
        return self._m.is_stopped()


class Lookahead:
    """The grammar along a chain being drafted: ``mask()`` for the next token,
    ``push(token)`` once it is chosen (False: the grammar admits nothing after
    it, the chain ends; an end-of-generation token ends it unconsumed, as
    Constraint's drafts do)."""

    def __init__(self, matcher, words: int, eos: frozenset[int]):
        self._m = matcher
        self._eos = eos
        self._row = np.zeros(words, dtype=np.uint32)
        self.tokens: list[int] = []   # consumed, to roll back

    def mask(self) -> int:
        self._m.unsafe_compute_mask_ptr(self._row.ctypes.data, self._row.nbytes)
        return self._row.ctypes.data

    def push(self, token: int) -> bool:
        if token in self._eos or not self._m.consume_token(token):
            return False
        self.tokens.append(token)
        return not self._m.is_stopped()
