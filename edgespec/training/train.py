"""`edgespec drafter train`: a drafter for one target and one language or
domain, exported as a GGUF that the native engine and llama.cpp load as a
draft model. Two kinds:

* From scratch (``init`` "target" or "random"), in the two stages of Yi et
  al. 2024: a small llama pretrained on plain text of the language (the
  sources the distillation read, tokenized with the target's tokenizer), then
  distilled: its distribution pulled towards the target's top-k soft labels
  (``edgespec drafter distill``) by cross-entropy, each step also taking a
  batch of plain text so a small label set is not learnt by heart. Its
  embedding starts from the principal components of the target's own
  embedding rows of the kept tokens ("target"), so tokens the target treats
  alike start alike; the output head is the embedding (tied).
* Grown (``init`` a model sharing the target's tokenizer: the smaller sibling,
  qwen2.5-coder-0.5b for qwen2.5-coder-1.5b): its weights, only ``layers`` of
  its blocks (given, or the N of most block influence on held-out distilled
  text, ShortGPT-style) and only the kept tokens' rows of its embedding and
  output, then distilled on the labels as above (each step also with plain
  text), exported in its own architecture.

Either way the drafter keeps only the ``vocab`` target tokens its language
uses most (the plain text's and the labelled text's counts plus the target's
label mass; the target's control tokens always among them): drafter id i is target id
``token_map[i]``; a target token outside the map is fed to it as ``unk`` (the
target's end-of-text token), the engine gives the others probability 0 (see
``model.TokenMap``). The network (``network``) computes what the engines
compute for its architecture, so the exported tensors need no conversion.

``--minutes`` bounds the training of all runs together; a checkpoint
(``OUT.ckpt``: magic, sha256, then the torch state) is written every minute
and at the end, and a later run with the same data and options goes on from
it. The best state by held-out acceptance (the share of held-out positions
where the drafter's top token is the target's) is exported.

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import DrafterError, InvalidArgumentError
from ..files import write_atomic
from ..models import registry
from ..models.gguf import GGUFFile
from ..progress import Progress
from ..drafters import ranks, specialized
from . import corpus, network
from .distill import DistillSet
from .network import import_torch

CKPT_MAGIC = b"ESCK"
CKPT_VERSION = 2
_CKPT_HEAD = struct.Struct("<4sI32sQ")   # magic, version, sha256 of the payload, payload bytes
CHECKPOINT_SECONDS = 60
EVAL_SECONDS = 30            # at least this long between held-out evaluations,
EVAL_SHARE = 0.1             # and long enough that they take at most this share of the time
MAX_DRAFTER_BYTES = 25 * 1000 * 1000   # a drafter trained from scratch
MAX_GROWN_SHARE = 0.08       # a grown drafter: of what a target token reads (the goal: <= 8% of a target token)
INFLUENCE_TOKENS = 4096      # held-out tokens the layer choice reads
SCRATCH_INITS = ("target", "random")
QUANTS = ("f16", "q8_0", "q4_0")

# Defaults that depend on the kind of drafter (a field left None takes its kind's);
# the fields of only one kind are refused for the other.
SCRATCH_DEFAULTS = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=4, n_ff=768, lr=2e-3, pretrain_share=0.4,
                        quant="f16", batch_tokens=4096, warmup_steps=50)
GROWN_DEFAULTS = dict(layers=4, lr=2e-4, pretrain_share=0.0, quant="q8_0", batch_tokens=1024, warmup_steps=10)
_FLAGS = {"n_embd": "--n-embd", "n_layer": "--n-layer", "n_head": "--n-head", "n_head_kv": "--n-head-kv",
          "n_ff": "--n-ff", "layers": "--layers"}


@dataclass
class TrainParams:
    lang: str
    minutes: float = 30.0       # training time of all runs together
    init: str = "target"        # "target": a new llama, embedding from the target's rows; "random"; or a model
                                # (built-in name or GGUF path) sharing the target's tokenizer, grown from
    layers: int | list[int] | None = None   # grown: the N layers of most influence, or these (default 4)
    n_embd: int | None = None   # from scratch: the shape (defaults in SCRATCH_DEFAULTS)
    n_layer: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    n_ff: int | None = None
    vocab: int = 8192           # drafter tokens kept
    ctx: int = 512              # tokens per pretraining window
    batch_tokens: int | None = None  # tokens per step and kind of batch
    lr: float | None = None     # peak learning rate
    warmup_steps: int | None = None
    pretrain_share: float | None = None  # of the minutes spent on plain text alone
    quant: str | None = None    # the exported matrices: f16, q8_0 or q4_0
    held_out_share: float = 0.05  # of the distilled sequences kept for measuring acceptance
    seed: int = 0
    threads: int | None = None
    device: str = "auto"        # auto: cuda, else mps, else cpu
    sources: list[str] = field(default_factory=list)  # pretraining text (default: the distillation's)

    @property
    def grown(self) -> bool:
        return self.init not in SCRATCH_INITS

    def shape(self) -> dict:
        """What a checkpoint must share with a run that goes on from it."""
        d = asdict(self)
        for k in ("minutes", "threads", "device"):
            del d[k]
        return d


def check_params(p: TrainParams) -> TrainParams:
    """``p`` checked (InvalidArgumentError naming the option), with its kind's defaults filled in."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidArgumentError(what)

    defaults, other = (GROWN_DEFAULTS, SCRATCH_DEFAULTS) if p.grown else (SCRATCH_DEFAULTS, GROWN_DEFAULTS)
    for key in other.keys() - defaults.keys():
        need(getattr(p, key) is None, f"{_FLAGS[key]} is for a drafter " + (
            "trained from scratch: a grown one has its --init model's shape (choose --layers)" if p.grown
            else "grown from a model (--init MODEL)"))
    p = replace(p, **{k: v for k, v in defaults.items() if getattr(p, k) is None})
    need(p.minutes > 0, f"--minutes must be positive, got {p.minutes}")
    if p.grown:
        layers = [p.layers] if isinstance(p.layers, int) else p.layers
        need(bool(layers) and all(isinstance(i, int) and i >= 0 for i in layers) and
             (isinstance(p.layers, list) or p.layers >= 1) and len(set(layers)) == len(layers),
             f"--layers must be a count N >= 1 or distinct layer numbers such as 0,3,7, got {p.layers}")
    else:
        need(16 <= p.n_embd <= 2048 and p.n_embd % p.n_head == 0 and (p.n_embd // p.n_head) % 2 == 0,
             f"--n-embd must be in [16, 2048] and split into --n-head heads of an even size, got {p.n_embd}")
        need(1 <= p.n_layer <= 32, f"--n-layer must be in [1, 32], got {p.n_layer}")
        need(1 <= p.n_head_kv <= p.n_head and p.n_head % p.n_head_kv == 0,
             f"--n-head-kv must divide --n-head ({p.n_head}), got {p.n_head_kv}")
        need(16 <= p.n_ff <= 16384, f"--n-ff must be in [16, 16384], got {p.n_ff}")
    need(ranks.MIN_KEPT <= p.vocab <= 262144, f"--vocab must be in [{ranks.MIN_KEPT}, 262144], got {p.vocab}")
    need(16 <= p.ctx <= 4096, f"--ctx must be in [16, 4096], got {p.ctx}")
    need(64 <= p.batch_tokens <= 1 << 20, f"--batch-tokens must be in [64, {1 << 20}], got {p.batch_tokens}")
    need(0 <= p.pretrain_share < 1, f"--pretrain-share must be in [0, 1), got {p.pretrain_share}")
    need(p.lr > 0, f"--lr must be positive, got {p.lr}")
    need(p.warmup_steps >= 0, f"warmup_steps must be >= 0, got {p.warmup_steps}")
    need(p.quant in QUANTS, f"--quant must be {', '.join(QUANTS)}, got {p.quant!r}")
    need(p.device in ("auto", "cpu", "cuda", "mps"), f"--device must be auto, cpu, cuda or mps, got {p.device!r}")
    return p


def pick_device(name: str):
    """The torch device of ``--device`` (auto: a CUDA GPU, else Apple's MPS, else the CPU)."""
    torch = import_torch()
    has = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if name == "auto":
        name = next(n for n in ("cuda", "mps", "cpu") if has[n])
    if not has[name]:
        raise InvalidArgumentError(f"--device {name}: this PyTorch build or machine has no {name} device")
    return torch.device(name)


def scratch_shape(p: TrainParams, n_vocab: int) -> network.NetShape:
    """The small llama a drafter trained from scratch is (tied output)."""
    return network.NetShape(arch="llama", n_vocab=n_vocab, n_embd=p.n_embd, n_layer=p.n_layer, n_head=p.n_head,
                            n_head_kv=p.n_head_kv, n_ff=p.n_ff, eps=1e-5, rope_base=10000.0)


def build_scratch(p: TrainParams, n_vocab: int):
    """A drafter trained from scratch, at GPT-2's initialisation (residual
    branches scaled down with depth)."""
    torch = import_torch()
    model = network.build(scratch_shape(p, n_vocab))
    nn = torch.nn
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    for b in model.blk:
        nn.init.normal_(b.attn_output.weight, std=0.02 / math.sqrt(2 * p.n_layer))
        nn.init.normal_(b.ffn_down.weight, std=0.02 / math.sqrt(2 * p.n_layer))
    nn.init.normal_(model.token_embd.weight, std=0.02)
    return model


# -- data ----------------------------------------------------------------------------------

@dataclass
class TrainData:
    token_map: np.ndarray      # (n_draft,) target id of each drafter id
    unk: int                   # drafter id fed for target tokens outside the map
    text: np.ndarray           # (N,) drafter ids of the plain text, documents one after another
    kd_train: list             # distillation records (tokens, ids, probs) in drafter ids
    kd_held_out: list
    held_out_tokens: list      # the held-out records' tokens in target ids (for choosing layers)
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
    if p.vocab > n_target:
        raise InvalidArgumentError(f"--vocab {p.vocab} is above the target's vocabulary of {n_target} tokens")
    counts = np.bincount(text, minlength=n_target).astype(np.float64)
    for r in records:   # the text the target read, and its label mass: what it says comes next
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
    held = order[:n_held] if n_held else order
    return TrainData(keep, unk, ids(text), [kd[i] for i in order[n_held:]] or kd, [kd[i] for i in held],
                     [records[i].tokens.astype(np.int64) for i in held], n_target,
                     specialized.char_profile(t for _, t in texts))


# -- checkpoints --------------------------------------------------------------------------------

def save_checkpoint(path: Path, state: dict) -> None:
    torch = import_torch()
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    head = _CKPT_HEAD.pack(CKPT_MAGIC, CKPT_VERSION, hashlib.sha256(payload).digest(), len(payload))
    write_atomic(path, head + payload)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's state, checked: DrafterError names the file and where it goes wrong."""
    torch = import_torch()
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
    torch = import_torch()
    from ..backends.vocab import Vocab
    from ..models.gguf_write import read_gguf
    from ..drafters.model import target_fingerprint

    p = check_params(p)
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
        init_path, init_shape = _grown_init(p, vocab, target_name) if p.grown else (None, None)
        prepared = prepare_data(vocab, reader, data, p, progress=progress)
    if len(prepared.text) < p.ctx + 1:
        raise InvalidArgumentError(f"the plain text of --lang {p.lang} has {len(prepared.text)} tokens, "
                                   f"fewer than one --ctx window of {p.ctx}")
    torch.manual_seed(p.seed)
    if p.threads:
        torch.set_num_threads(p.threads)
    device = pick_device(p.device)
    ckpt_path = out.with_suffix(".ckpt")
    saved = None
    if ckpt_path.exists() and not restart:
        saved = load_checkpoint(ckpt_path)
        if saved["shape"] != p.shape() or saved["data"] != data.manifest["text_sha256"] \
                or saved["records"] != data.sequences:
            raise InvalidArgumentError(f"{ckpt_path} was trained with other options or data: give the same "
                                       "ones to go on, or --restart to start over")
    n_draft = len(prepared.token_map)
    if saved is not None:
        shape = network.NetShape(**saved["net"])
    elif p.grown:
        shape = replace(init_shape, n_layer=p.layers if isinstance(p.layers, int) else len(p.layers), n_vocab=n_draft)
    else:
        shape = scratch_shape(p, n_draft)
    _check_size(shape, p, reader)
    grown = None     # the init model's layers kept, and every layer's block influence
    if saved is not None:
        model, grown = network.build(shape), saved["grown"]
    elif p.grown:
        grown = _choose_layers(init_path, p.layers, init_shape.n_layer, prepared.held_out_tokens, progress)
        model = network.read_gguf(init_path, grown["layers"], prepared.token_map)
    else:
        model = build_scratch(p, n_draft)
        if p.init == "target":
            _init_from_target(model, reader, prepared.token_map)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    state = {"step": 0, "seconds": 0.0, "tokens": 0, "best_acceptance": -1.0, "best": None}
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["progress"]
        torch.set_rng_state(saved["rng"])
    budget = p.minutes * 60
    n_params = sum(t.numel() for t in model.parameters())
    rng = np.random.default_rng(p.seed + state["step"])
    bar = Clock("train", int(budget), enabled=progress, lines=True)
    bar.update(int(state["seconds"]))
    t_run = time.monotonic()
    seconds0 = state["seconds"]
    checkpoints, evaluations = Every(CHECKPOINT_SECONDS, EVAL_SHARE), Every(EVAL_SECONDS, EVAL_SHARE)

    def save():
        with checkpoints:
            save_checkpoint(ckpt_path, {"shape": p.shape(), "data": data.manifest["text_sha256"],
                                        "records": data.sequences, "net": model.shape.to_dict(), "grown": grown,
                                        "model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "progress": state, "rng": torch.get_rng_state()})

    def evaluate():
        with evaluations:
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
            # Warm-up, then a cosine down to a tenth within each stage.
            a, b = (0.0, p.pretrain_share) if stage == "text" else (p.pretrain_share, 1.0)
            frac = (share - a) / max(b - a, 1e-9)
            warm = min(1.0, (state["step"] + 1) / max(p.warmup_steps, 1))
            lr = p.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
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
            state["seconds"] = seconds0 + time.monotonic() - t_run
            if evaluations.due():
                acc = evaluate()
            if checkpoints.due():
                save()
            bar.update(int(state["seconds"]) - bar.count,
                       f"{stage}  loss {loss.item():.3f}  held-out acceptance {max(acc, 0):.1%}  "
                       f"{state['tokens'] / max(state['seconds'], 1e-9):.0f} tok/s")
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
            if grown is not None:
                recipe["grown"] = {"init": registry.model_name(p.init), **grown}
            export_gguf(out, model, prepared, reader, lang=p.lang, quant=p.quant, target_name=target_name,
                        target_vocab=data.target_vocab, recipe=recipe)
        bar.done()
    return TrainResult(out, state["step"], state["seconds"], state["best_acceptance"], state["tokens"],
                       n_params, out.stat().st_size)


def train_model(model: str | None, data: str | os.PathLike, out: str | os.PathLike, params: TrainParams, *,
                restart: bool = False, progress: bool = True, command: str = "") -> TrainResult:
    """``train`` for a model reference (a built-in name, a GGUF path, hf:...;
    default: the built-in default)."""
    check_params(params)
    import_torch()
    ref = model or registry.default_model()
    return train(registry.model_path_checked(ref), registry.model_name(ref), Path(data), Path(out), params,
                 restart=restart, progress=progress, command=command)


class Every:
    """When a periodic task (a checkpoint, an evaluation) is due: at least
    ``seconds`` after the last one ended, and late enough that it takes at
    most ``share`` of the time (a grown drafter's checkpoint is large)."""

    def __init__(self, seconds: float, share: float):
        self.seconds, self.share = seconds, share
        self.last, self.took = time.monotonic(), 0.0

    def due(self) -> bool:
        return time.monotonic() - self.last > max(self.seconds, self.took / self.share)

    def __enter__(self):
        self._t0 = time.monotonic()

    def __exit__(self, *exc):
        self.last = time.monotonic()
        self.took = self.last - self._t0


# -- growing from a model -----------------------------------------------------------------------

def _grown_init(p: TrainParams, target_vocab, target_name: str) -> tuple[Path, network.NetShape]:
    """The path and whole shape of the --init model, refused
    (InvalidArgumentError with the reason) unless the network computes its
    architecture, its tokenizer is the target's and it has the --layers asked for."""
    from ..backends.vocab import Vocab
    from ..drafters.model import target_fingerprint

    path = registry.model_path_checked(p.init)
    with GGUFFile(path) as f:
        shape = network.read_shape(f)
    n_layer = shape.n_layer
    with Vocab.load(path) as init:
        theirs, ours = target_fingerprint(init), target_fingerprint(target_vocab)
        if theirs != ours:
            raise InvalidArgumentError(
                f"--init {p.init}: its tokenizer is not {target_name}'s (vocabulary fingerprint {theirs[:12]}, "
                f"{init.n_vocab} tokens, against {ours[:12]}, {target_vocab.n_vocab} tokens): a drafter grows "
                "from a model with the target's tokenizer")
    layers = [p.layers] if isinstance(p.layers, int) else p.layers
    if (p.layers if isinstance(p.layers, int) else max(layers) + 1) > n_layer:
        raise InvalidArgumentError(f"--layers {','.join(map(str, layers))}: {path.name} has {n_layer} layers "
                                   f"(0 to {n_layer - 1})")
    return path, shape


def _choose_layers(init_path: Path, layers: int | list[int], n_layer: int, held_out: list, progress: bool) -> dict:
    """The init model's layers kept: ``layers`` as given, or the N of most
    block influence on up to INFLUENCE_TOKENS held-out tokens."""
    if not isinstance(layers, int):
        return {"layers": list(layers), "influence": None}
    sample, n = [], 0
    for tokens in held_out:
        if n >= INFLUENCE_TOKENS:
            break
        sample.append(tokens[:INFLUENCE_TOKENS - n])
        n += len(sample[-1])
    bar = Progress("block influence", n_layer, enabled=progress, lines=True)
    influence = network.block_influence(init_path, sample, bar.update)
    bar.done()
    return {"layers": network.choose_layers(influence, layers), "influence": [round(float(x), 5) for x in influence]}


def _check_size(shape: network.NetShape, p: TrainParams, target_reader) -> None:
    """The drafter's bytes a drafted token reads, against the cap of its kind:
    MAX_DRAFTER_BYTES from scratch, MAX_GROWN_SHARE of the target's when grown."""
    with import_torch().device("meta"):   # the tensors' shapes, no memory
        tensors = network.build(shape).state_dict()
    size = token_bytes({k: tensor_bytes(v.shape, p.quant) for k, v in tensors.items()}, shape.n_vocab)
    if p.grown:
        n_target = max(int(t.shape[-1]) for t in target_reader.tensors if t.name == "token_embd.weight")
        target = token_bytes({t.name: int(t.n_bytes) for t in target_reader.tensors}, n_target)
        cap, what = MAX_GROWN_SHARE * target, f"{MAX_GROWN_SHARE:.0%} of the target's {target / 1e6:.0f} MB"
        fix = "keep fewer --layers, a smaller --vocab or --quant q4_0"
    else:
        cap, what = MAX_DRAFTER_BYTES, "a drafter trained from scratch"
        fix = "lower --vocab, --n-embd or --n-layer"
    if size > cap:
        raise InvalidArgumentError(f"a drafted token would read {size / 1e6:.1f} MB of the drafter, over the "
                                   f"{cap / 1e6:.1f} MB of {what}: {fix}")


def token_bytes(sizes: dict[str, int], n_vocab: int) -> int:
    """Bytes of weights a token's evaluation reads, of tensors of ``sizes``
    bytes by name: all of them but an untied embedding's other rows."""
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes["token_embd.weight"] * (n_vocab - 1) // n_vocab
    return total


def tensor_bytes(shape, quant: str) -> int:
    """Bytes of an exported tensor of (numpy) ``shape``: a matrix as ``quant``, a vector F32."""
    from ..models.gguf_write import row_bytes

    return shape[0] * row_bytes(qtype_of(quant), shape[1]) if len(shape) == 2 else 4 * math.prod(shape)


def qtype_of(quant: str) -> int:
    import gguf

    return {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
            "q4_0": gguf.GGMLQuantizationType.Q4_0}[quant]


def _text_loss(model, d: TrainData, p: TrainParams, rng):
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if t is None:
        return
    rows = dequantize(np.asarray(t.data)[keep], t.tensor_type).astype(np.float32)   # (n_draft, n_embd_target)
    rows -= rows.mean(axis=0)
    n = model.token_embd.weight.shape[1]
    u, s, _ = torch.linalg.svd(torch.from_numpy(rows), full_matrices=False)
    k = min(n, u.shape[1])
    e = torch.zeros(len(keep), n)
    e[:, :k] = u[:, :k] * s[:k]
    e *= 0.02 / e.std()
    with torch.no_grad():
        model.token_embd.weight.copy_(e)


# -- export ----------------------------------------------------------------------------------

def export_gguf(out: Path, model, d: TrainData, target_reader, *, lang: str, quant: str, target_name: str,
                target_vocab: str, recipe: dict) -> None:
    """The drafter as a GGUF of its network's architecture: matrices as
    ``quant``, norms and biases F32, its tensors in the order of the
    architecture's table, the trimmed tokenizer and the edgespec.drafter.*
    keys (see ``specialized``)."""
    import gguf

    from ..models.gguf import arch_tensors
    from ..models.gguf_write import gguf_output, quantize

    s = model.shape
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    names = []
    for spec in arch_tensors(s.arch):
        names += [n for n in ([f"blk.{il}.{spec.name}" for il in range(s.n_layer)] if spec.layer else [spec.name])
                  if n in sd]
    if set(names) != set(sd):   # the network and the engine's table disagree: a bug here, not bad input
        raise AssertionError(f"tensors outside {s.arch}'s table: {sorted(set(sd) - set(names))}")
    qtype = qtype_of(quant)
    with gguf_output(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), s.arch)
        try:
            w.add_name(f"edgespec drafter {lang} for {target_name}")
            w.add_context_length(s.n_ctx)
            w.add_embedding_length(s.n_embd)
            w.add_block_count(s.n_layer)
            w.add_feed_forward_length(s.n_ff)
            w.add_head_count(s.n_head)
            w.add_head_count_kv(s.n_head_kv)
            w.add_layer_norm_rms_eps(s.eps)
            w.add_rope_freq_base(s.rope_base)
            w.add_rope_dimension_count(s.head_dim)
            if s.rope_scale != 1.0:
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(1.0 / s.rope_scale)
            w.add_vocab_size(len(d.token_map))
            w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[quant])
            specialized.add_trimmed_tokenizer(w, target_reader, d.token_map.tolist())
            w.add_string(specialized.KEY_TARGET, target_name)
            w.add_string(specialized.KEY_TARGET_VOCAB, target_vocab)
            w.add_uint32(specialized.KEY_TARGET_N_VOCAB, d.n_target)
            w.add_array(specialized.KEY_TOKEN_MAP, d.token_map.tolist())
            w.add_uint32(specialized.KEY_UNK, d.unk)
            w.add_array(specialized.KEY_LANGS, [lang])
            w.add_array(specialized.KEY_PROFILE, d.profile)
            w.add_string(specialized.KEY_RECIPE, json.dumps(recipe, ensure_ascii=False, sort_keys=True))
            for name in names:
                a = sd[name]
                if a.ndim == 1:
                    w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType.F32)
                else:
                    w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()


class Clock(Progress):
    """Training seconds against the budget, as m:ss."""

    def counter(self) -> str:
        return f"{_mmss(self.count)}/{_mmss(self.total)}"


def _mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"
