"""`edgespec drafter train-head`: a draft head (EAGLE-1, see
edgespec.drafters.head) for one target and one language or domain, trained
on this machine in two resumable stages.

1. **Collect** (``collect``): text of the language (``corpus``, the
   benchmark suites held out), cut into sequences of ``ctx`` tokens and,
   depending on ``mode``, turned into what the target says (self-
   distillation, the seed's recipe):

   * ``text``: the text itself (teacher forcing: a prefill's cost);
   * ``generate``: the target's own continuation of each sequence's first
     ``prompt_tokens`` tokens;
   * ``chat``: the target's answer, through its chat template, to a request
     about each sequence's first ``prompt_tokens`` tokens (explain,
     summarise, continue, answer questions on it);
   * ``translate``: the target's translation into English of them, through
     its chat template (the seed paper's own task);
   * ``questions``: the target's answer to a question it first wrote itself
     about each sequence's subject (self-instruct): short requests and long
     answers, as users chat.

   The generative modes run ``COLLECT_PARALLEL`` generations at once
   (continuous batching: about twice the tokens a second on 2 cores); greedy
   answers are batch invariant, so the features are the same either way.

   Each sequence's hidden states after the final norm (the features the
   native engine keeps for a head, ``Backend.hidden_states``: no output
   layer) are kept with its tokens and ``start``, the first row the head sees
   at run time (the prompt's last position: a head's cache starts there) in
   checksummed shards under ``OUT.data/``, one at least every minute, so a
   killed run (even with -9) goes on from its last shard.

2. **Train** (``train_head``): the head's layer (PyTorch, the target's own
   block as ``network`` computes it, a narrower feed-forward) over
   ``x = fc_feature f_p + fc_token embed(t_p+1)``, row p predicting
   ``f_p+1``: EAGLE's loss, a smooth-L1 regression on the feature plus 0.1 x
   the cross-entropy of the output layer's distribution of the guess against
   the target's own (``softmax(W f_p+1)``), both over the ``draft_vocab``
   most used tokens the head will compute (FR-Spec, the shipped ranking).
   Input features get uniform noise (EAGLE-1: a drafted row reads the head's
   own guess, never exact). AdamW, warm-up then cosine, ``minutes`` of all
   runs together; ``OUT.ckpt`` every minute (a later run goes on from it);
   the state of the best held-out agreement (the share of held-out rows
   whose drafted token is the target's choice among those tokens) is
   exported as a head GGUF (``write_head``), quantized, with its recipe
   (``eagle.recipe``: command, data digest, minutes, tokens seen, held-out
   agreement and its curve) and ``eagle.draft_vocab``, which the head
   drafter trims its output to unless told otherwise.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import DrafterError, IncompatibleDraftModelError, InvalidArgumentError
from ..files import sha256_file
from ..models import registry
from ..models.gguf import GGUFFile, arch_traits, architectures
from ..progress import Progress
from ..drafters import head as head_file, ranks, specialized
from ..drafters.model import target_fingerprint
from . import corpus, distill, network
from .network import import_torch
from .train import CHECKPOINT_SECONDS, Clock, Every, load_checkpoint, qtype_of, save_checkpoint

MANIFEST = "features.json"
FORMAT = 1
MODES = ("text", "generate", "chat", "translate", "questions")
QUANTS = ("f16", "q8_0", "q4_0")
SEQUENCES_PER_SHARD = 16
EVAL_SECONDS = 30
EVAL_SHARE = 0.1
TOKEN_LOSS_WEIGHT = 0.1      # EAGLE's weight of the token loss beside the feature regression
MAX_HEAD_BYTES = 30 * 1000 * 1000

# chat mode: requests about a piece of text, one per sequence in turn
CHAT_REQUESTS = ("Explain what the following text says, in plain words:\n\n{}",
                 "Summarize the following text in a few sentences:\n\n{}",
                 "Continue the following text:\n\n{}",
                 "Write three questions about the following text and answer them:\n\n{}",
                 "Rewrite the following text more clearly:\n\n{}")
TRANSLATE_REQUEST = "Translate the following text into English:\n\n{}"
# questions mode: the request the target writes its question by, and the question's length at most
QUESTION_REQUEST = ("Read the following text, then write one question that a curious person might ask an AI "
                    "assistant about its subject. Write the question alone, nothing else.\n\n{}")
QUESTION_TOKENS = 48
COLLECT_PARALLEL = 4   # generations at once in the generative modes


@dataclass
class HeadParams:
    lang: str
    sources: Sequence[str] = ()
    mode: str = "text"             # how the sequences are made (MODES)
    minutes: float = 30.0          # training time of all runs together
    data_minutes: float | None = None   # collection time of this run (None: --tokens or all the text)
    tokens: int | None = None      # collect sequences until this many tokens in all
    ctx: int = 256                 # tokens per sequence (prompt and answer)
    prompt_tokens: int = 96        # generate, chat, translate: the text a prompt is made of
    n_ff: int = 2048               # the head's feed-forward width
    draft_vocab: int = 8192        # tokens the head computes (the most used: FR-Spec)
    quant: str = "q8_0"            # the exported matrices
    window: int = 64               # rows per training window
    batch_rows: int = 256          # rows per optimizer step (small: a CPU run takes few steps)
    lr: float = 1e-3
    noise: float = 0.1             # uniform input-feature noise, times each row's RMS
    unroll: int = 2                # drafted tokens per chain trained on (1: EAGLE-1's single step)
    held_out_share: float = 0.05   # of the sequences, for measuring agreement
    seed: int = 0
    threads: int | None = None

    def shape(self) -> dict:
        """What a checkpoint must share with a run that goes on from it."""
        d = asdict(self)
        for k in ("minutes", "data_minutes", "tokens", "threads", "quant"):   # quant: the export's alone
            del d[k]
        d["sources"] = list(d["sources"])
        return d


def check_params(p: HeadParams) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidArgumentError(what)

    need(p.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {p.mode!r}")
    need(p.minutes > 0, f"--minutes must be positive, got {p.minutes}")
    need(p.data_minutes is None or p.data_minutes > 0, f"--data-minutes must be positive, got {p.data_minutes}")
    need(p.tokens is None or p.tokens > 0, f"--tokens must be positive, got {p.tokens}")
    need(distill.MIN_SEQUENCE <= p.ctx <= 4096, f"--ctx must be in [{distill.MIN_SEQUENCE}, 4096], got {p.ctx}")
    need(p.mode == "text" or 8 <= p.prompt_tokens < p.ctx - 8,
         f"--prompt-tokens must be in [8, {p.ctx - 9}] (below --ctx), got {p.prompt_tokens}")
    need(16 <= p.n_ff <= 65536, f"--n-ff must be in [16, 65536], got {p.n_ff}")
    need(p.quant in QUANTS, f"--quant must be one of {', '.join(QUANTS)}, got {p.quant!r}")
    need(4 <= p.window <= p.ctx, f"--window must be in [4, --ctx {p.ctx}], got {p.window}")
    need(p.window <= p.batch_rows <= 65536, f"--batch-rows must be in [--window {p.window}, 65536], got "
                                            f"{p.batch_rows}")
    need(0 < p.lr < 1, f"--lr must be in (0, 1), got {p.lr}")
    need(0 <= p.noise < 1, f"--noise must be in [0, 1), got {p.noise}")
    need(1 <= p.unroll <= min(8, p.window - 1), f"--unroll must be in [1, {min(8, p.window - 1)}], got {p.unroll}")
    need(p.threads is None or p.threads > 0, f"--threads must be positive, got {p.threads}")
    need(bool(p.sources), "give at least one --source")
    distill.check_lang(p.lang)


# -- stage 1: the target's features --------------------------------------------------------------

@dataclass
class Collected:
    tokens: np.ndarray     # (n,) int32
    start: int             # the first row the head sees at run time
    features: np.ndarray   # (n, n_embd) float16: the target's hidden state after the final norm


def _encode_shard(seqs: list[Collected]) -> bytes:
    buf = io.BytesIO()
    arrays = {}
    for i, s in enumerate(seqs):
        arrays[f"tokens{i}"], arrays[f"start{i}"], arrays[f"features{i}"] = s.tokens, np.int32(s.start), s.features
    np.savez(buf, **arrays)
    return buf.getvalue()


def read_shard(path: Path) -> list[Collected]:
    try:
        with np.load(path, allow_pickle=False) as z:
            n = len(z.files) // 3
            return [Collected(z[f"tokens{i}"], int(z[f"start{i}"]), z[f"features{i}"]) for i in range(n)]
    except (OSError, ValueError, KeyError) as e:
        raise DrafterError(f"{path}: not a feature shard ({e})") from None


class FeatureSet:
    """A folder of the target's features (``collect``): its manifest, checked."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        try:
            self.manifest = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DrafterError(f"{self.folder}: no {MANIFEST} (not a folder written by drafter train-head)") from None
        except (OSError, ValueError) as e:
            raise DrafterError(f"{path}: unreadable manifest ({e})") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise DrafterError(f"{path}: not a feature manifest of format {FORMAT}")

    def verify(self) -> None:
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            if not path.is_file():
                raise DrafterError(f"{path}: missing (listed in {MANIFEST})")
            if path.stat().st_size != shard["bytes"] or sha256_file(path) != shard["sha256"]:
                raise DrafterError(f"{path}: its size or sha256 differs from the manifest's (truncated or altered)")

    def sequences(self) -> list[Collected]:
        return [s for shard in self.manifest["shards"] for s in read_shard(self.folder / shard["file"])]


def _chat(engine, content: str) -> list[int]:
    """The prompt tokens of one user message through the target's chat template."""
    return engine.request(messages=[{"role": "user", "content": content}], max_tokens=1).prompt_tokens


def _question(engine, text: str) -> str | None:
    """The target's question about ``text`` (questions mode)."""
    return first_question(engine.generate(_chat(engine, QUESTION_REQUEST.format(text)),
                                          max_tokens=QUESTION_TOKENS, temperature=0.0).text)


def first_question(answer: str) -> str | None:
    """The question in an answer to QUESTION_REQUEST: its first line without
    quotes or emphasis; None when that holds fewer than 8 letters."""
    line = answer.strip().split("\n")[0].strip().strip('"*').strip()
    return line if sum(c.isalpha() for c in line) >= 8 else None


def _prompt(engine, p: HeadParams, piece: list[int], i: int) -> list[int]:
    """The prompt made of a sequence's first tokens, as the mode says."""
    if p.mode == "generate":
        return piece
    text = engine.detokenize(piece).strip()
    if p.mode == "questions":
        question = _question(engine, text)
        if question is not None:
            return _chat(engine, question)
        # no question came: a request about the text, as chat mode makes
    request = TRANSLATE_REQUEST if p.mode == "translate" else CHAT_REQUESTS[i % len(CHAT_REQUESTS)]
    return _chat(engine, request.format(text))


def _sequence(engine, p: HeadParams, piece: list[int], i: int) -> tuple[list[int], int]:
    """Sequence ``i``'s tokens and the first row the head sees of them."""
    if p.mode == "text":
        return piece, 0
    prompt = _prompt(engine, p, piece, i)
    room = p.ctx - len(prompt)
    if room < 8:
        prompt, room = prompt[-(p.ctx - 8):], 8
    answer = engine.generate(prompt, max_tokens=room, temperature=0.0).tokens
    return prompt + answer, len(prompt) - 1


def collect(engine, target_name: str, out: Path, p: HeadParams, *, progress: bool = True) -> FeatureSet:
    """Stage 1 into the folder ``out`` with ``engine`` (the target, on the
    native backend), going on from where an earlier run on it stopped."""
    out.mkdir(parents=True, exist_ok=True)
    backend = engine.backend
    docs, dropped, text_sha256 = distill.shuffled_documents(p.lang, p.sources, True, progress)
    config = {"format": FORMAT, "target": target_name, "target_vocab": target_fingerprint(backend),
              "n_embd": backend.n_embd, "lang": p.lang, "sources": list(p.sources), "mode": p.mode, "ctx": p.ctx,
              "prompt_tokens": p.prompt_tokens, "text_sha256": text_sha256}
    manifest = _resume(out, config)
    bos = backend.bos_token if backend.adds_bos else None
    size = p.ctx if p.mode == "text" else p.prompt_tokens
    pieces = distill.sequences(lambda t: backend.tokenize(t, add_special=False), docs, size, bos)
    if not pieces:
        raise InvalidArgumentError(f"the sources of --lang {p.lang} hold no text to train a head on")
    manifest.update(sequences_total=len(pieces), held_out_paragraphs=dropped)
    # The goal of all runs together: --tokens, --data-minutes, else every sequence.
    deadline = time.monotonic() + p.data_minutes * 60 - manifest["seconds"] if p.data_minutes else None
    goal = p.tokens or math.inf
    bar = Progress("features", p.tokens or len(pieces), enabled=progress, lines=True)
    bar.update(manifest["tokens"] if p.tokens else manifest["sequences"])
    pending: list[Collected] = []
    t0 = time.monotonic()
    group = 1 if p.mode == "text" else max(1, engine.parallel)   # sequences made at once
    pool = ThreadPoolExecutor(group) if group > 1 else None
    try:
        i = manifest["sequences"]
        while i < len(pieces):
            if manifest["tokens"] + sum(len(s.tokens) for s in pending) >= goal or \
                    (deadline is not None and time.monotonic() > deadline):
                break
            batch = range(i, min(i + group, len(pieces)))
            made = (list(pool.map(lambda j: _sequence(engine, p, pieces[j], j), batch)) if pool
                    else [_sequence(engine, p, pieces[j], j) for j in batch])
            features = backend.hidden_states([tokens for tokens, _ in made])
            for j, (tokens, start), f in zip(batch, made, features):
                pending.append(Collected(np.asarray(tokens, np.int32), start, f.astype(np.float16)))
                bar.update(len(tokens) if p.tokens else 1, f"{len(tokens) - start} rows from sequence {j}")
            i = batch.stop
            if len(pending) >= SEQUENCES_PER_SHARD or time.monotonic() - t0 >= CHECKPOINT_SECONDS:
                _flush(out, manifest, pending, time.monotonic() - t0)
                pending, t0 = [], time.monotonic()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        # An interruption keeps what was collected: the sequences so far become a shard.
        _flush(out, manifest, pending, time.monotonic() - t0)
        bar.done()
    return FeatureSet(out)


def collected(folder: Path, p: HeadParams) -> bool:
    """Whether the folder holds what ``p`` asks for (of all runs together)."""
    if not (folder / MANIFEST).exists():
        return False
    m = FeatureSet(folder).manifest
    if p.tokens is not None:
        return m["tokens"] >= p.tokens
    if p.data_minutes is not None:
        return m["seconds"] >= p.data_minutes * 60
    return m["sequences"] >= m.get("sequences_total", math.inf)


def _resume(out: Path, config: dict) -> dict:
    if not (out / MANIFEST).exists():
        if any(out.iterdir()):   # never mixed into a folder of other files
            raise InvalidArgumentError(f"{out}: a folder of other files, without {MANIFEST}: give an empty or "
                                       "new folder for the features")
        return {**config, "shards": [], "sequences": 0, "tokens": 0, "seconds": 0.0}
    done = FeatureSet(out)
    for key, value in config.items():
        if key != "target" and done.manifest.get(key) != value:
            raise InvalidArgumentError(f"{out} holds features with {key} {done.manifest.get(key)!r}, not {value!r}: "
                                       "give the same options, or another --out")
    done.verify()
    return done.manifest


def _flush(out: Path, manifest: dict, pending: list[Collected], seconds: float) -> None:
    if pending:
        manifest["rows"] = manifest.get("rows", 0) + sum(len(s.tokens) - s.start - 1 for s in pending)
        distill.append_shard(out, MANIFEST, manifest, "npz", _encode_shard(pending), len(pending),
                             sum(len(s.tokens) for s in pending), seconds)


# -- stage 2: the head -----------------------------------------------------------------------------

def build_head(s: network.NetShape):
    """The head: fc over [feature, embedding] and one block of the target's
    architecture (``s``: the target's shape with one layer and the head's
    feed-forward). fc_feature starts as the identity: an untrained head
    guesses the next feature is this one's, plus what the block adds."""
    torch = import_torch()
    nn = torch.nn
    one = network.build(replace(s, n_layer=1, n_vocab=1))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.shape = s
            self.fc_feature = nn.Linear(s.n_embd, s.n_embd, bias=False)   # (n_embd, n_embd)
            self.fc_token = nn.Linear(s.n_embd, s.n_embd, bias=False)
            self.blk = one.blk        # blk.0.*, as the GGUF names them
            self._rotation = one.rotation
            with torch.no_grad():
                self.fc_feature.weight.copy_(torch.eye(s.n_embd))
                self.fc_token.weight.mul_(0.1)

        def forward(self, features, embeddings, start: int = 0, past=None, keep_kv: bool = False):
            """(B, T, n_embd) each, rows at positions start.. -> the guessed
            next features (past, keep_kv: the block's)."""
            cos, sin = self._rotation(features.shape[1], start)
            x = (self.fc_feature(features) + self.fc_token(embeddings)).float()   # the residual in float32 under autocast
            return self.blk[0](x, cos, sin, past, keep_kv)

    return Head()


@dataclass
class HeadData:
    """Training rows in memory: each sequence's rows from its start."""

    train: list[tuple[np.ndarray, np.ndarray]]      # (tokens (n,), features (n, n_embd) float16)
    held_out: list[tuple[np.ndarray, np.ndarray]]
    embed: dict[int, int]                           # target token id -> row of ``embeddings``
    embeddings: np.ndarray                          # (n_used, n_embd) float32: the target's token_embd rows
    output: np.ndarray                              # (draft_vocab, n_embd) float32: its output rows kept
    keep: np.ndarray                                # (draft_vocab,) the kept token ids


def prepare(target_path: Path, target_name: str, fingerprint: str, n_vocab: int, data: Sequence[FeatureSet],
            p: HeadParams) -> HeadData:
    seqs = [(s.tokens.astype(np.int64)[s.start:], s.features[s.start:]) for d in data for s in d.sequences()]
    seqs = [s for s in seqs if len(s[0]) > 4]
    if not seqs:
        raise InvalidArgumentError(f"{', '.join(str(d.folder) for d in data)}: no sequences to train on: "
                                   "collect longer (--data-minutes)")
    order = np.random.default_rng(p.seed).permutation(len(seqs))
    n_held = max(1, int(round(len(seqs) * p.held_out_share))) if len(seqs) > 1 else 0
    held, train_ = [seqs[i] for i in order[:n_held]], [seqs[i] for i in order[n_held:]]
    keep = (np.arange(n_vocab) if p.draft_vocab >= n_vocab   # every row: no ranking needed
            else ranks.top_tokens(fingerprint, p.draft_vocab, n_vocab, target_name))
    used = np.unique(np.concatenate([t for t, _ in seqs]))
    with GGUFFile(target_path) as f:
        embd = f.tensor("token_embd.weight")
        out = f.tensor("output.weight")
        embeddings = embd.dequantize()[used]
        output = (embd if out is None else out).dequantize()[keep]   # tied: the embedding
    return HeadData(train_, held, {int(t): i for i, t in enumerate(used)}, np.ascontiguousarray(embeddings, np.float32),
                    np.ascontiguousarray(output, np.float32), keep)


def _batch(d: HeadData, seqs, p: HeadParams, rng, device):
    """Windows of ``p.window`` + 1 rows, as tensors: input features and
    embeddings of rows 0..T-1, target features of rows 1..T."""
    torch = import_torch()
    feats, embs = [], []
    for _ in range(max(1, p.batch_rows // p.window)):
        tokens, features = seqs[rng.integers(len(seqs))]
        T = min(p.window, len(tokens) - 1)
        a = int(rng.integers(0, len(tokens) - T))
        if T < p.window:   # a short sequence: padded with its last row, masked out below
            a = 0
        idx = np.minimum(np.arange(a, a + p.window + 1), len(tokens) - 1)
        feats.append(features[idx].astype(np.float32))
        embs.append(d.embeddings[[d.embed[int(t)] for t in tokens[np.minimum(idx[:-1] + 1, len(tokens) - 1)]]])
        if T < p.window:
            feats[-1][T + 1:] = np.nan   # marks the padding
    f = torch.from_numpy(np.stack(feats)).to(device)        # (B, T+1, n_embd)
    e = torch.from_numpy(np.stack(embs)).to(device)         # (B, T, n_embd)
    valid = ~torch.isnan(f[:, 1:, 0])                       # (B, T)
    f = torch.nan_to_num(f)
    return f[:, :-1], e, f[:, 1:], valid


def _losses(model, W, f_in, e, f_next, valid, noise: float, unroll: int = 1):
    """EAGLE's losses over chains of ``unroll`` drafted tokens from each row
    (the training-time test of EAGLE-3): step 1 reads the real features
    (plus noise); step j reads step j - 1's guesses, each row seeing the
    real rows up to its chain's root and its own chain's drafted rows, as
    the head does at run time. Returns (feature loss, token loss) averaged
    over the steps, and step 1's agreement count and row count."""
    torch = import_torch()
    F = torch.nn.functional
    if noise:
        rms = f_in.pow(2).mean(-1, keepdim=True).sqrt()
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * noise * rms
    T = f_in.shape[1]
    guess, kv = model(f_in, e, keep_kv=True)                 # (B, T, n_embd)
    past_k, past_v = [kv[0]], [kv[1]]
    reg_sum = tok_sum = 0.0
    for j in range(1, unroll + 1):
        if j > 1:   # chain step j: rows 0..T-j, row i at position i + j - 1
            guess, kv = model(guess[:, :-1], e[:, j - 1:], start=j - 1, keep_kv=True,
                              past=(torch.cat(past_k, 2), torch.cat(past_v, 2), _chain_mask(T, j)))
            past_k.append(kv[0])
            past_v.append(kv[1])
        target, m = f_next[:, j - 1:], valid[:, j - 1:].float()
        reg = F.smooth_l1_loss(guess.float(), target, reduction="none").mean(-1)
        with torch.autocast("cpu", enabled=False):           # the target's own distribution, exact
            teacher = target @ W.T                           # (B, n, draft_vocab)
        student = guess @ W.T
        tok = -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1)
        reg_sum = reg_sum + (reg * m).sum() / m.sum().clamp(min=1)
        tok_sum = tok_sum + (tok * m).sum() / m.sum().clamp(min=1)
        if j == 1:
            agree, count = ((student.argmax(-1) == teacher.argmax(-1)).float() * m).sum(), m.sum()
    return reg_sum / unroll, tok_sum / unroll, agree, count


def _chain_mask(T: int, j: int):
    """What chain step j's rows (n = T - j + 1 of them) see: step 1's rows
    0..i (real, (n, T)), then of each step 2..j (T - m + 1 rows each) row i."""
    torch = import_torch()
    n = T - j + 1
    cols = [torch.ones(n, T, dtype=torch.bool).tril()]
    for m in range(2, j + 1):
        cols.append(torch.eye(n, T - m + 1, dtype=torch.bool))
    return torch.cat(cols, 1)


def held_out_agreement(model, W, d: HeadData) -> float:
    """Share of held-out rows whose drafted token (from real features, the
    chain's first) is the target's choice among the kept tokens."""
    torch = import_torch()
    model.eval()
    hit = n = 0.0
    with torch.no_grad():
        for tokens, features in d.held_out:
            f = torch.from_numpy(features.astype(np.float32))[None]
            e = torch.from_numpy(d.embeddings[[d.embed[int(t)] for t in tokens[1:]]])[None]
            valid = torch.ones(1, len(tokens) - 1, dtype=torch.bool)
            _, _, agree, count = _losses(model, W, f[:, :-1], e, f[:, 1:], valid, 0.0)
            hit, n = hit + float(agree), n + float(count)
    model.train()
    return hit / max(n, 1.0)


@dataclass
class HeadResult:
    out: Path
    steps: int
    seconds: float
    held_out_agreement: float
    rows_seen: int
    bytes: int


def train_head(target_path: Path, target_name: str, data: Sequence[FeatureSet], out: Path, p: HeadParams, *,
               init: Path | None = None, restart: bool = False, progress: bool = True,
               command: str = "") -> HeadResult:
    """Stage 2: train (or go on training) the head on the feature sets
    ``data`` together; export the best state to ``out``. A run that starts
    (no checkpoint of its own to go on from) starts from the weights of the
    checkpoint ``init`` when given: another run's head of this target, such
    as an English head's for a translation head, or one trained before its
    data grew."""
    from ..backends.vocab import Vocab

    torch = import_torch()
    with GGUFFile(target_path) as f:
        shape = replace(network.read_shape(f), n_layer=1, n_ff=p.n_ff)
        n_vocab = shape.n_vocab
    with Vocab.load(target_path) as vocab:
        fingerprint = target_fingerprint(vocab)
    for d in data:
        d.verify()
        if d.manifest["target_vocab"] != fingerprint or d.manifest["n_embd"] != shape.n_embd:
            raise InvalidArgumentError(f"{d.folder} holds features of {d.manifest['target']}, not of {target_name}")
    d = prepare(target_path, target_name, fingerprint, n_vocab, data, p)
    if not d.train:
        raise InvalidArgumentError(f"{', '.join(str(x.folder) for x in data)}: too few sequences to train on: "
                                   "collect longer")
    torch.manual_seed(p.seed)
    if p.threads:
        torch.set_num_threads(p.threads)
    model = build_head(shape)
    W = torch.from_numpy(d.output)
    # bfloat16 products where the CPU has them (weights, optimizer and the
    # held-out measure stay float32): about twice the rows a minute.
    bf16 = network.bf16_matmuls()
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt_path = out.with_suffix(".ckpt")
    state = {"step": 0, "seconds": 0.0, "rows": 0, "best": -1.0, "best_state": None, "curve": []}
    digest = _data_digest(data)
    if ckpt_path.exists() and not restart:
        saved = load_checkpoint(ckpt_path)
        if saved.get("kind") != "head" or saved["shape"] != p.shape() or saved["data"] != digest:
            raise InvalidArgumentError(f"{ckpt_path} was trained with other options or data: give the same ones "
                                       "to go on, or --restart to start over")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["progress"]
        torch.set_rng_state(saved["rng"])
    elif init is not None:
        state["init"] = _start_from(model, init, target_path)
    budget = p.minutes * 60
    rng = np.random.default_rng(p.seed + state["step"])
    bar = Clock("train-head", int(budget), enabled=progress, lines=True)
    bar.update(int(state["seconds"]))
    t_run, seconds0 = time.monotonic(), state["seconds"]
    checkpoints, evaluations = Every(CHECKPOINT_SECONDS, EVAL_SHARE), Every(EVAL_SECONDS, EVAL_SHARE)

    def save():
        with checkpoints:
            save_checkpoint(ckpt_path, {"kind": "head", "shape": p.shape(), "data": digest,
                                        "model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "progress": state, "rng": torch.get_rng_state()})

    def evaluate() -> float:
        with evaluations:
            acc = held_out_agreement(model, W, d) if d.held_out else 0.0
        state["curve"].append([state["rows"], round(acc, 4)])
        if acc > state["best"]:
            state["best"] = acc
            state["best_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return acc

    shown = f"{state['best']:.1%}" if state["curve"] else "-"   # the last held-out agreement
    stopping = _StopOnTerm()
    warmup = 20
    try:
        while state["seconds"] < budget:
            frac = state["seconds"] / budget
            lr = p.lr * min(1.0, (state["step"] + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            f_in, e, f_next, valid = _batch(d, d.train, p, rng, "cpu")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                reg, tok, agree, count = _losses(model, W, f_in, e, f_next, valid, p.noise, p.unroll)
            loss = reg + TOKEN_LOSS_WEIGHT * tok
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            state["rows"] += int(count)
            state["seconds"] = seconds0 + time.monotonic() - t_run
            if evaluations.due():
                shown = f"{evaluate():.1%}"
            if checkpoints.due():
                save()
            bar.update(int(state["seconds"]) - bar.count,
                       f"feature {reg.item():.3f}  token {tok.item():.3f}  batch agreement "
                       f"{float(agree) / max(float(count), 1):.1%}  held-out {shown}  "
                       f"{state['rows'] / max(state['seconds'], 1e-9):.0f} rows/s")
        evaluate()
    finally:
        # Also when interrupted (^C, or SIGTERM: a background run's stop): the
        # run so far is kept and its best state exported.
        stopping.restore()
        if state["step"]:
            save()
            if state["best_state"] is None:
                evaluate()
            model.load_state_dict(state["best_state"])
            recipe = {"command": command, "lang": p.lang, "mode": p.mode,
                      "data": [{k: x.manifest.get(k) for k in ("lang", "mode", "sources", "ctx", "prompt_tokens",
                                                               "sequences", "tokens", "rows", "text_sha256",
                                                               "seconds")} for x in data],
                      "data_digest": digest, "params": p.shape(), "steps": state["step"],
                      "minutes": round(state["seconds"] / 60, 1), "rows_seen": state["rows"],
                      "precision": "bf16" if bf16 else "f32",
                      "held_out_agreement": round(state["best"], 4), "curve": state["curve"],
                      **({"init": state["init"]} if state.get("init") else {})}
            export(out, target_path, model, p, recipe)
        bar.done()
    return HeadResult(out, state["step"], state["seconds"], state["best"], state["rows"], out.stat().st_size)


class _StopOnTerm:
    """SIGTERM raises KeyboardInterrupt in the training loop (main thread
    only), so that a background run stopped with kill keeps and exports its
    work as ^C does; restore() puts the old handler back."""

    def __init__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


def _start_from(model, init: Path, target_path: Path) -> dict:
    """Load the head weights of ``init`` into ``model``: a checkpoint (not
    its optimizer nor its progress: this run's learning rate starts again)
    or a head file of this target (``_start_from_head``); what the recipe
    says of it."""
    if init.suffix == ".gguf":
        return _start_from_head(model, init, target_path)
    saved = load_checkpoint(init)
    if saved.get("kind") != "head":
        raise InvalidArgumentError(f"--init {init}: not a draft head's checkpoint (OUT.ckpt of train-head)")
    try:
        model.load_state_dict(saved["model"])
    except RuntimeError:
        raise InvalidArgumentError(f"--init {init}: a head of another shape (width or --n-ff) than this "
                                   f"target's with --n-ff {model.shape.n_ff}") from None
    done = saved.get("progress", {})
    return {"file": init.name, "lang": saved.get("shape", {}).get("lang"), "data_digest": saved.get("data"),
            "rows_seen": done.get("rows"), "held_out_agreement": round(done.get("best", 0.0), 4)}


def _start_from_head(model, init: Path, target_path: Path) -> dict:
    """A head file's weights, dequantized (a shipped head's q8_0 is within
    its rounding of what was trained), into ``model``: a head made for
    another target is refused naming both."""
    torch = import_torch()
    with GGUFFile(init) as f:
        if f.get("general.architecture") != head_file.ARCH:
            raise InvalidArgumentError(f"--init {init}: neither a draft head's checkpoint nor a head file")
        if f.get(head_file.TARGET_DIGEST_KEY) != head_file.target_digest(target_path):
            raise IncompatibleDraftModelError(f"--init {init.name}: a head made for "
                                              f"{f.get(f'{head_file.ARCH}.target.name')}, not {target_path.name}")
        weights = {}
        for name, like in model.state_dict().items():
            t = f.tensor(name)
            if t is None or t.shape[::-1] != tuple(like.shape):
                raise InvalidArgumentError(f"--init {init}: a head of another shape (width or --n-ff) than this "
                                           f"target's with --n-ff {model.shape.n_ff} ({name})")
            weights[name] = torch.from_numpy(t.dequantize())
        made = json.loads(f.get(specialized.KEY_RECIPE) or "{}")
    model.load_state_dict(weights)
    return {"file": init.name, "lang": made.get("lang"), "data_digest": made.get("data_digest"),
            "rows_seen": made.get("rows_seen"), "held_out_agreement": made.get("held_out_agreement")}


def _data_digest(data: Sequence[FeatureSet]) -> str:
    return hashlib.sha256("".join(s["sha256"] for d in data for s in d.manifest["shards"]).encode()).hexdigest()


def check_size(s: network.NetShape, p: HeadParams) -> None:
    """InvalidArgumentError when a head of the target shape ``s`` and ``p`` is over MAX_HEAD_BYTES."""
    from ..models.gguf_write import row_bytes

    hd = s.head_dim
    mats = [(s.n_embd, s.n_embd)] * 2 + [(s.n_head * hd, s.n_embd), (s.n_head_kv * hd, s.n_embd),
                                         (s.n_head_kv * hd, s.n_embd), (s.n_embd, s.n_head * hd)] + \
        [(p.n_ff, s.n_embd)] * 2 + [(s.n_embd, p.n_ff)]
    size = sum(rows * row_bytes(qtype_of(p.quant), cols) for rows, cols in mats)
    if size > MAX_HEAD_BYTES:
        raise InvalidArgumentError(f"a head with --n-ff {p.n_ff} as {p.quant} takes {size / 1e6:.0f} MB, over "
                                   f"{MAX_HEAD_BYTES / 1e6:.0f} MB: a narrower --n-ff or --quant q4_0")


def export(out: Path, target_path: Path, model, p: HeadParams, recipe: dict) -> None:
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    tensors = {"fc_feature.weight": sd["fc_feature.weight"], "fc_token.weight": sd["fc_token.weight"]}
    tensors.update({k: v for k, v in sd.items() if k.startswith("blk.0.")})
    s = model.shape
    # What routes it in a target's drafter set: its language and its text's profile.
    profile = specialized.char_profile(t for _, t in corpus.source_texts(p.lang, p.sources, progress=False))
    head_file.write_head(out, target_path, tensors, n_head=s.n_head, n_head_kv=s.n_head_kv, n_ff=p.n_ff,
                         qtype=qtype_of(p.quant), draft_vocab=p.draft_vocab if p.draft_vocab < s.n_vocab else None,
                         recipe=recipe, langs=[p.lang], profile=profile)


# -- the command ---------------------------------------------------------------------------------

def train_head_model(model: str | None, out: str | os.PathLike, p: HeadParams, *,
                     data: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                     init: str | os.PathLike | None = None, restart: bool = False, progress: bool = True,
                     command: str = "") -> HeadResult:
    """Both stages for a model reference (a built-in name, a GGUF path;
    default: the built-in default): features into the first folder of
    ``data`` (default OUT.data/) unless enough are there, then the head into
    ``out``, trained on every folder of ``data`` (the others made by earlier
    runs: English text beside translations, say)."""
    from ..engine import Engine

    check_params(p)
    import_torch()
    out = Path(out)
    if out.suffix != ".gguf":
        raise InvalidArgumentError(f"--out must name a .gguf file, got {out}")
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"--out: {out.parent}: no such folder")
    if init is not None and not Path(init).is_file():
        raise InvalidArgumentError(f"--init {init}: no such file")
    ref = model or registry.default_model()
    path = registry.model_path_checked(ref)
    with GGUFFile(path) as f:   # an architecture the head's layer cannot be trained in: refused before any work
        arch = f.get("general.architecture")
        if not network.computes(arch_traits(arch)):
            plain = (a for a in architectures() if network.computes(arch_traits(a)))
            raise InvalidArgumentError(f"{path}: a draft head cannot be trained for a {arch} model "
                                       f"(architectures: {', '.join(plain)})")
        check_size(replace(network.read_shape(f), n_layer=1), p)
    folders = ([Path(data)] if isinstance(data, (str, os.PathLike)) else [Path(x) for x in data or ()]) or \
        [out.with_suffix(".data")]
    others = [FeatureSet(x) for x in folders[1:]]   # made before: refused now when they are not
    if not collected(folders[0], p):
        # The generative modes batch COLLECT_PARALLEL answers (no drafts: they
        # would take the batch's slots); text mode is prefills alone.
        generative = p.mode != "text"
        with Engine(ref, backend="native", threads=p.threads, n_ctx=p.ctx + 64, n_batch=max(p.ctx, 64),
                    drafter="none" if generative else "ngram",
                    parallel=COLLECT_PARALLEL if generative else 1) as engine:
            first = collect(engine, registry.model_name(ref), folders[0], p, progress=progress)
    else:
        first = FeatureSet(folders[0])
    return train_head(path, registry.model_name(ref), [first, *others], out, p,
                      init=Path(init) if init is not None else None, restart=restart, progress=progress,
                      command=command)
