"""`edgespec drafter train`: a small llama drafter for one target and one
language or domain, in the two stages of Yi et al. 2024, exported as a GGUF
that the native engine and llama.cpp load as a draft model.

1. Pretraining: next-token prediction on plain text of the language (the
   sources the distillation read, tokenized with the target's tokenizer).
2. Distillation: the drafter's distribution is pulled towards the target's
   top-k soft labels (``edgespec drafter distill``) by cross-entropy, each
   step also taking a batch of plain text so a small label set is not learnt
   by heart.

The drafter keeps only the ``vocab`` target tokens its text uses most (the
target's control tokens always among them): drafter id i is target id
``token_map[i]``; a target token outside the map is fed to it as ``unk``
(the target's end-of-text token), the engine gives the others probability 0
(see ``model.TokenMap``). Its embedding starts from the principal components
of the target's own embedding rows of the kept tokens, so tokens the target
treats alike start alike; the output head is the embedding (tied).

The network is llama's (RMSNorm, rotary positions on adjacent pairs, which is
llama.cpp's NORM mode, grouped-query attention, SwiGLU), so the exported
tensors need no permutation. ``--minutes`` bounds the training of all runs
together; a checkpoint (``OUT.ckpt``: magic, sha256, then the torch state) is
written every minute and at the end, and a later run with the same data and
shape goes on from it. The best state by held-out acceptance (the share of
held-out positions where the drafter's top token is the target's) is exported.

PyTorch and gguf-py come with the extra: ``pip install 'edgespec[train]'``.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import DrafterError, InvalidArgumentError
from ..files import write_atomic
from ..progress import Progress
from ..drafters import specialized
from . import corpus
from .distill import DistillSet

CKPT_MAGIC = b"ESCK"
CKPT_VERSION = 1
_CKPT_HEAD = struct.Struct("<4sI32sQ")   # magic, version, sha256 of the payload, payload bytes
CHECKPOINT_SECONDS = 60
EVAL_SECONDS = 30
MAX_DRAFTER_BYTES = 25 * 1000 * 1000
TRAIN_EXTRA = "pip install 'edgespec[train]'"


def _torch():
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError(f"edgespec drafter train needs PyTorch: {TRAIN_EXTRA}") from None
    return torch


@dataclass
class TrainParams:
    lang: str
    minutes: float = 30.0       # training time of all runs together
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 768
    vocab: int = 8192           # drafter tokens kept
    ctx: int = 512              # tokens per pretraining window
    batch_tokens: int = 4096    # tokens per step and kind of batch
    lr: float = 2e-3
    pretrain_share: float = 0.4  # of the minutes spent on plain text alone
    held_out_share: float = 0.05  # of the distilled sequences kept for measuring acceptance
    init: str = "target"        # "target": embedding from the target's rows; "random"
    seed: int = 0
    threads: int | None = None
    device: str = "auto"        # auto: cuda, else mps, else cpu
    sources: list[str] = field(default_factory=list)  # pretraining text (default: the distillation's)

    def shape(self) -> dict:
        """What a checkpoint must share with a run that goes on from it."""
        d = asdict(self)
        for k in ("minutes", "threads", "device"):
            del d[k]
        return d


def check_params(p: TrainParams) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidArgumentError(what)

    need(p.minutes > 0, f"--minutes must be positive, got {p.minutes}")
    need(16 <= p.n_embd <= 2048 and p.n_embd % p.n_head == 0 and (p.n_embd // p.n_head) % 2 == 0,
         f"--n-embd must be in [16, 2048] and split into --n-head heads of an even size, got {p.n_embd}")
    need(1 <= p.n_layer <= 32, f"--n-layer must be in [1, 32], got {p.n_layer}")
    need(1 <= p.n_head_kv <= p.n_head and p.n_head % p.n_head_kv == 0,
         f"--n-head-kv must divide --n-head ({p.n_head}), got {p.n_head_kv}")
    need(16 <= p.n_ff <= 16384, f"--n-ff must be in [16, 16384], got {p.n_ff}")
    need(256 <= p.vocab <= 262144, f"--vocab must be in [256, 262144], got {p.vocab}")
    need(16 <= p.ctx <= 4096, f"--ctx must be in [16, 4096], got {p.ctx}")
    need(0 <= p.pretrain_share < 1, f"--pretrain-share must be in [0, 1), got {p.pretrain_share}")
    need(p.init in ("target", "random"), f"--init must be target or random, got {p.init!r}")
    need(p.lr > 0, f"--lr must be positive, got {p.lr}")
    need(p.device in ("auto", "cpu", "cuda", "mps"), f"--device must be auto, cpu, cuda or mps, got {p.device!r}")


def pick_device(name: str):
    """The torch device of ``--device`` (auto: a CUDA GPU, else Apple's MPS, else the CPU)."""
    torch = _torch()
    has = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if name == "auto":
        name = next(n for n in ("cuda", "mps", "cpu") if has[n])
    if not has[name]:
        raise InvalidArgumentError(f"--device {name}: this PyTorch build or machine has no {name} device")
    return torch.device(name)


# -- the network ----------------------------------------------------------------------

def build_model(p: TrainParams, n_vocab: int):
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional
    hd = p.n_embd // p.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.RMSNorm(p.n_embd, eps=1e-5)
            self.wq = nn.Linear(p.n_embd, p.n_head * hd, bias=False)          # (n_head*hd, n_embd)
            self.wk = nn.Linear(p.n_embd, p.n_head_kv * hd, bias=False)
            self.wv = nn.Linear(p.n_embd, p.n_head_kv * hd, bias=False)
            self.wo = nn.Linear(p.n_head * hd, p.n_embd, bias=False)
            self.ffn_norm = nn.RMSNorm(p.n_embd, eps=1e-5)
            self.w_gate = nn.Linear(p.n_embd, p.n_ff, bias=False)             # (n_ff, n_embd)
            self.w_up = nn.Linear(p.n_embd, p.n_ff, bias=False)
            self.w_down = nn.Linear(p.n_ff, p.n_embd, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = rope(self.wq(h).view(B, T, p.n_head, hd), cos, sin).transpose(1, 2)      # (B, H, T, hd)
            k = rope(self.wk(h).view(B, T, p.n_head_kv, hd), cos, sin).transpose(1, 2)
            v = self.wv(h).view(B, T, p.n_head_kv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=p.n_head_kv != p.n_head)
            x = x + self.wo(a.transpose(1, 2).reshape(B, T, p.n_head * hd))
            h = self.ffn_norm(x)
            return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    def rope(x, cos, sin):
        # llama.cpp's NORM mode: each adjacent pair (2i, 2i+1) turns by pos * base^(-2i/hd).
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    class Drafter(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embd = nn.Embedding(n_vocab, p.n_embd)     # (n_vocab, n_embd), also the output head
            self.blocks = nn.ModuleList(Block() for _ in range(p.n_layer))
            self.output_norm = nn.RMSNorm(p.n_embd, eps=1e-5)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
            for b in self.blocks:  # residual branches scaled down with depth (GPT-2)
                nn.init.normal_(b.wo.weight, std=0.02 / math.sqrt(2 * p.n_layer))
                nn.init.normal_(b.w_down.weight, std=0.02 / math.sqrt(2 * p.n_layer))
            nn.init.normal_(self.tok_embd.weight, std=0.02)

        def forward(self, tokens):                               # (B, T) -> logits (B, T, n_vocab)
            T = tokens.shape[1]
            pos = torch.arange(T, dtype=torch.float32)
            inv = ROPE_BASE ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
            ang = pos[:, None] * inv[None, :]                      # (T, hd/2)
            cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
            x = self.tok_embd(tokens)
            for b in self.blocks:
                x = b(x, cos, sin)
            return self.output_norm(x) @ self.tok_embd.weight.T

    return Drafter()


ROPE_BASE = 10000.0


# -- data ----------------------------------------------------------------------------------

@dataclass
class TrainData:
    token_map: np.ndarray      # (n_draft,) target id of each drafter id
    unk: int                   # drafter id fed for target tokens outside the map
    text: np.ndarray           # (N,) drafter ids of the plain text, documents one after another
    kd_train: list             # distillation records (tokens, ids, probs) in drafter ids
    kd_held_out: list
    n_target: int              # the target's vocabulary size
    profile: list[str]         # specialized.char_profile() of the plain text, for the router


def choose_vocab(counts: np.ndarray, control: Sequence[int], unk_target: int, n: int) -> np.ndarray:
    """The ``n`` target ids kept: the control tokens and ``unk_target``, then
    the most frequent of ``counts`` (ties by id); sorted by target id."""
    keep = set(int(c) for c in control) | {int(unk_target)}
    order = np.lexsort((np.arange(len(counts)), -counts))
    for t in order:
        if len(keep) >= n or counts[t] <= 0:
            break
        keep.add(int(t))
    return np.array(sorted(keep), dtype=np.int64)


def prepare_data(target_vocab, target_reader, data: DistillSet, p: TrainParams, *, progress: bool = True) -> TrainData:
    """Tokenize the plain text, read the distilled records, choose the drafter's vocabulary."""
    import gguf

    texts = corpus.source_texts(p.lang, p.sources or data.sources, progress=progress)
    docs, _ = corpus.documents(texts, corpus.HeldOut.suites() if data.held_out else None)
    bos = target_vocab.bos_token if target_vocab.adds_bos else None
    stream: list[int] = []
    for doc in docs:
        stream.extend(([bos] if bos is not None else []) + target_vocab.tokenize(doc.text, add_special=False))
    text = np.asarray(stream, dtype=np.int64)
    records = list(data.records())
    if not records:
        raise DrafterError(f"{data.folder}: the distillation holds no records yet")
    n_target = target_vocab.n_vocab
    counts = np.bincount(text, minlength=n_target).astype(np.float64)
    for r in records:
        counts += np.bincount(r.tokens, minlength=n_target)
        np.add.at(counts, r.ids.ravel(), r.probs.ravel().astype(np.float64))
    types = target_reader.fields.get(gguf.Keys.Tokenizer.TOKEN_TYPE)
    control = [i for i, t in enumerate(types.contents())
               if t == gguf.TokenType.CONTROL] if types is not None else []
    unk_target = target_vocab.eos_token
    keep = choose_vocab(counts, control, unk_target, p.vocab)
    to_draft = np.full(n_target, -1, np.int64)
    to_draft[keep] = np.arange(len(keep))
    unk = int(to_draft[unk_target])

    def ids(a):
        d = to_draft[a]
        return np.where(d < 0, unk, d)

    kd = [(ids(r.tokens), to_draft[r.ids], r.probs.astype(np.float32)) for r in records]
    rng = np.random.default_rng(p.seed)
    order = rng.permutation(len(kd))
    n_held = max(1, int(round(len(kd) * p.held_out_share))) if len(kd) > 1 else 0
    held = [kd[i] for i in order[:n_held]] or kd
    return TrainData(keep, unk, ids(text), [kd[i] for i in order[n_held:]] or kd, held, n_target,
                     specialized.char_profile(t for _, t in texts))


# -- checkpoints --------------------------------------------------------------------------------

def save_checkpoint(path: Path, state: dict) -> None:
    torch = _torch()
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    head = _CKPT_HEAD.pack(CKPT_MAGIC, CKPT_VERSION, hashlib.sha256(payload).digest(), len(payload))
    write_atomic(path, head + payload)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's state, checked: DrafterError names the file and where it goes wrong."""
    torch = _torch()
    data = path.read_bytes()
    if len(data) < _CKPT_HEAD.size:
        raise DrafterError(f"{path}: truncated at byte {len(data)} (header of {_CKPT_HEAD.size} bytes)")
    magic, version, digest, size = _CKPT_HEAD.unpack_from(data)
    if magic != CKPT_MAGIC or version != CKPT_VERSION:
        raise DrafterError(f"{path}: not an edgespec drafter checkpoint of version {CKPT_VERSION}")
    payload = data[_CKPT_HEAD.size:]
    if len(payload) != size:
        raise DrafterError(f"{path}: truncated at byte {len(data)} of {_CKPT_HEAD.size + size}")
    if hashlib.sha256(payload).digest() != digest:
        raise DrafterError(f"{path}: checksum mismatch in bytes {_CKPT_HEAD.size}..{len(data)}")
    return torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")


# -- training -----------------------------------------------------------------------------------

@dataclass
class TrainResult:
    out: Path
    steps: int
    seconds: float
    held_out_acceptance: float
    tokens_seen: int
    n_params: int
    bytes: int


def train(target_path: Path, target_name: str, data_dir: Path, out: Path, p: TrainParams, *,
          restart: bool = False, progress: bool = True, command: str = "") -> TrainResult:
    """Train (or go on training) a drafter for the target at ``target_path``
    on the distillation ``data_dir``; export the best state to ``out``."""
    torch = _torch()
    from ..backends.vocab import Vocab
    from ..models.gguf_write import read_gguf
    from ..drafters.model import target_fingerprint

    check_params(p)
    if out.suffix != ".gguf":
        raise InvalidArgumentError(f"--out must name a .gguf file, got {out}")
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"--out: {out.parent}: no such folder")
    data = DistillSet(data_dir)
    if data.lang != p.lang:
        raise InvalidArgumentError(f"{data_dir} was distilled for --lang {data.lang}, not {p.lang}")
    data.verify()
    reader = read_gguf(target_path)
    with Vocab.load(target_path) as vocab:
        if data.target_vocab != target_fingerprint(vocab):
            raise InvalidArgumentError(f"{data_dir} was distilled from {data.target}, whose vocabulary differs "
                                       f"from {target_name}'s")
        prepared = prepare_data(vocab, reader, data, p, progress=progress)
    if len(prepared.text) < p.ctx + 1:
        raise InvalidArgumentError(f"the plain text of --lang {p.lang} has {len(prepared.text)} tokens, "
                                   f"fewer than one --ctx window of {p.ctx}")
    torch.manual_seed(p.seed)
    if p.threads:
        torch.set_num_threads(p.threads)
    device = pick_device(p.device)
    model = build_model(p, len(prepared.token_map))
    if p.init == "target":
        _init_from_target(model, reader, prepared.token_map)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    ckpt_path = out.with_suffix(".ckpt")
    state = {"step": 0, "seconds": 0.0, "tokens": 0, "best_acceptance": -1.0, "best": None}
    if ckpt_path.exists() and not restart:
        saved = load_checkpoint(ckpt_path)
        if saved["shape"] != p.shape() or saved["data"] != data.manifest["text_sha256"] \
                or saved["records"] != data.sequences:
            raise InvalidArgumentError(f"{ckpt_path} was trained with other options or data: give the same "
                                       "ones to go on, or --restart to start over")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["progress"]
        torch.set_rng_state(saved["rng"])
    budget = p.minutes * 60
    n_params = sum(t.numel() for t in model.parameters())
    rng = np.random.default_rng(p.seed + state["step"])
    bar = _Clock("train", int(budget), enabled=progress, lines=True)
    bar.update(int(state["seconds"]))
    t_run = time.monotonic()
    seconds0 = state["seconds"]
    last_ckpt = last_eval = time.monotonic()

    def save():
        save_checkpoint(ckpt_path, {"shape": p.shape(), "data": data.manifest["text_sha256"],
                                    "records": data.sequences, "model": model.state_dict(),
                                    "optimizer": opt.state_dict(), "progress": state,
                                    "rng": torch.get_rng_state()})

    def evaluate():
        acc = held_out_acceptance(model, prepared.kd_held_out)
        if acc > state["best_acceptance"]:
            state["best_acceptance"] = acc
            state["best"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return acc

    acc = state["best_acceptance"]
    try:
        while state["seconds"] < budget:
            share = state["seconds"] / budget
            stage = "text" if share < p.pretrain_share else "distil"
            # Warm-up over 50 steps, then a cosine down to a tenth within each stage.
            a, b = (0.0, p.pretrain_share) if stage == "text" else (p.pretrain_share, 1.0)
            frac = (share - a) / max(b - a, 1e-9)
            lr = p.lr * min(1.0, (state["step"] + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            model.train()
            loss = _text_loss(model, prepared, p, rng)
            if stage == "distil":
                loss = loss + _distil_loss(model, prepared, p, rng)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            state["tokens"] += p.batch_tokens * (2 if stage == "distil" else 1)
            now = time.monotonic()
            state["seconds"] = seconds0 + now - t_run
            if now - last_eval > EVAL_SECONDS:
                acc, last_eval = evaluate(), now
            if now - last_ckpt > CHECKPOINT_SECONDS:
                save()
                last_ckpt = now
            bar.update(int(state["seconds"]) - bar.count,
                       f"{stage}  loss {loss.item():.3f}  held-out acceptance {max(acc, 0):.1%}")
        evaluate()
    finally:
        # Also when interrupted: the run so far is kept and its best state exported.
        if state["step"]:
            save()
            if state["best"] is None:
                evaluate()
            model.load_state_dict(state["best"])
            recipe = {"command": command, "lang": p.lang, "data": {k: data.manifest[k] for k in (
                "target", "sources", "top_k", "ctx", "tokens", "sequences", "text_sha256")},
                "params": p.shape(), "steps": state["step"], "seconds": round(state["seconds"]),
                "tokens_seen": state["tokens"], "held_out_acceptance": round(state["best_acceptance"], 4)}
            export_gguf(out, model, p, prepared, reader, target_name=target_name,
                        target_vocab=data.target_vocab, recipe=recipe)
        bar.done()
    return TrainResult(out, state["step"], state["seconds"], state["best_acceptance"], state["tokens"],
                       n_params, out.stat().st_size)


def train_model(model: str | None, data: str | os.PathLike, out: str | os.PathLike, params: TrainParams, *,
                restart: bool = False, progress: bool = True, command: str = "") -> TrainResult:
    """``train`` for a model reference (a built-in name, a GGUF path, hf:...;
    default: the built-in default)."""
    from ..models import registry

    check_params(params)
    _torch()
    ref = model or registry.default_model()
    return train(registry.model_path_checked(ref), registry.model_name(ref), Path(data), Path(out), params,
                 restart=restart, progress=progress, command=command)


def _text_loss(model, d: TrainData, p: TrainParams, rng):
    torch = _torch()
    n = max(1, p.batch_tokens // p.ctx)
    starts = rng.integers(0, len(d.text) - p.ctx, size=n)
    x = torch.from_numpy(np.stack([d.text[s:s + p.ctx + 1] for s in starts])).to(_device(model))
    logits = model(x[:, :-1])
    target = x[:, 1:].clone()
    target[target == d.unk] = -100   # out-of-map tokens are not learnt as "unk"
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100)


def _distil_loss(model, d: TrainData, p: TrainParams, rng):
    """Cross-entropy against the target's top-k, renormalised over the kept
    tokens; the records of a batch padded at their ends (causal attention
    keeps the padding out of the real positions)."""
    torch = _torch()
    picked, size = [], 0
    while size < p.batch_tokens:
        r = d.kd_train[int(rng.integers(len(d.kd_train)))]
        picked.append(r)
        size += len(r[0])
    n, k = max(len(r[0]) for r in picked), picked[0][1].shape[1]
    tokens = np.full((len(picked), n), d.unk, np.int64)
    ids = np.full((len(picked), n, k), -1, np.int64)
    probs = np.zeros((len(picked), n, k), np.float32)
    for i, (t, a, b) in enumerate(picked):
        tokens[i, :len(t)], ids[i, :len(t)], probs[i, :len(t)] = t, a, b
    dev = _device(model)
    logp = torch.log_softmax(model(torch.from_numpy(tokens).to(dev)), dim=-1)      # (B, n, n_draft)
    ids_t = torch.from_numpy(ids).to(dev)
    w = torch.from_numpy(probs).to(dev) * (ids_t >= 0)
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-6)
    return -(w * logp.gather(2, ids_t.clamp_min(0))).sum() / size


def _device(model):
    return next(model.parameters()).device


def held_out_acceptance(model, records) -> float:
    """Share of held-out positions where the drafter's top token is the target's."""
    torch = _torch()
    model.eval()
    hit = n = 0
    with torch.no_grad():
        for tokens, ids, _ in records:
            top = model(torch.from_numpy(tokens)[None].to(_device(model)))[0].argmax(-1).cpu().numpy()
            hit += int((top == ids[:, 0]).sum())
            n += len(tokens)
    return hit / max(n, 1)


def _init_from_target(model, reader, keep: np.ndarray) -> None:
    """The embedding rows of the kept tokens, from the target's own: their top
    principal components, scaled to the random init's spread."""
    torch = _torch()
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if t is None:
        return
    rows = dequantize(np.asarray(t.data)[keep], t.tensor_type).astype(np.float32)   # (n_draft, n_embd_target)
    rows -= rows.mean(axis=0)
    n = model.tok_embd.weight.shape[1]
    u, s, _ = torch.linalg.svd(torch.from_numpy(rows), full_matrices=False)
    k = min(n, u.shape[1])
    e = torch.zeros(len(keep), n)
    e[:, :k] = u[:, :k] * s[:k]
    e *= 0.02 / e.std()
    with torch.no_grad():
        model.tok_embd.weight.copy_(e)


# -- export ----------------------------------------------------------------------------------

def export_gguf(out: Path, model, p: TrainParams, d: TrainData, target_reader, *, target_name: str,
                target_vocab: str, recipe: dict) -> None:
    """The drafter as a llama GGUF: F16 matrices, F32 norms, the trimmed
    tokenizer and the edgespec.drafter.* keys (see ``specialized``)."""
    import gguf

    from ..models.gguf_write import gguf_output

    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    with gguf_output(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), "llama")
        try:
            w.add_name(f"edgespec drafter {p.lang} for {target_name}")
            w.add_context_length(4096)
            w.add_embedding_length(p.n_embd)
            w.add_block_count(p.n_layer)
            w.add_feed_forward_length(p.n_ff)
            w.add_head_count(p.n_head)
            w.add_head_count_kv(p.n_head_kv)
            w.add_layer_norm_rms_eps(1e-5)
            w.add_rope_freq_base(ROPE_BASE)
            w.add_rope_dimension_count(p.n_embd // p.n_head)
            w.add_vocab_size(len(d.token_map))
            w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
            specialized.add_trimmed_tokenizer(w, target_reader, d.token_map.tolist())
            w.add_string(specialized.KEY_TARGET, target_name)
            w.add_string(specialized.KEY_TARGET_VOCAB, target_vocab)
            w.add_uint32(specialized.KEY_TARGET_N_VOCAB, d.n_target)
            w.add_array(specialized.KEY_TOKEN_MAP, d.token_map.tolist())
            w.add_uint32(specialized.KEY_UNK, d.unk)
            w.add_array(specialized.KEY_LANGS, [p.lang])
            w.add_array(specialized.KEY_PROFILE, d.profile)
            w.add_string(specialized.KEY_RECIPE, json.dumps(recipe, ensure_ascii=False, sort_keys=True))
            f16 = lambda a: a.astype(np.float16)
            w.add_tensor("token_embd.weight", f16(sd["tok_embd.weight"]))
            names = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
                     "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
                     "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
            for i in range(p.n_layer):
                for ours, theirs in names.items():
                    a = sd[f"blocks.{i}.{ours}.weight"]
                    w.add_tensor(f"blk.{i}.{theirs}", a if a.ndim == 1 else f16(a))
            w.add_tensor("output_norm.weight", sd["output_norm.weight"])
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
        size = tmp.stat().st_size
        if size > MAX_DRAFTER_BYTES:
            raise InvalidArgumentError(f"the drafter would be {size / 1e6:.1f} MB, over the "
                                       f"{MAX_DRAFTER_BYTES / 1e6:.0f} MB a drafter may take: lower --vocab, "
                                       "--n-embd or --n-layer")


class _Clock(Progress):
    """Training seconds against the budget, as m:ss."""

    def counter(self) -> str:
        return f"{_mmss(self.count)}/{_mmss(self.total)}"


def _mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"
