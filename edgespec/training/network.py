"""The drafter network in PyTorch: one decoder for every architecture a
drafter is trained or grown in (those whose traits are llama's but for the
RoPE layout: llama, qwen2), computing what the native engine and llama.cpp
compute for a GGUF of that architecture:

    x = token_embd[tokens]
    per block:  h = rmsnorm(x) * attn_norm
                q, k, v = attn_q(h), attn_k(h), attn_v(h)        (+ biases when the file has them)
                q, k = rope(q), rope(k)                          (the traits' layout: adjacent pairs or NEOX halves)
                x += attn_output(softmax(q k^T / sqrt(head_dim), causal) v)   (grouped-query)
                h = rmsnorm(x) * ffn_norm
                x += ffn_down(silu(ffn_gate(h)) * ffn_up(h))
    logits = (rmsnorm(x) * output_norm) @ output^T               (output: token_embd when tied)

Parameters are named as the GGUF tensors they come from and become
(``blk.0.attn_q.weight``), so reading a model (``read_gguf``) and exporting
a drafter are a matter of names; which names an architecture has comes from
its tensor table (``edgespec.models.gguf.arch_tensors``, which the export
follows).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..models.gguf import ArchTraits, GGUFFile, arch_traits, architectures

# What this network computes besides the RoPE layout (NORM: adjacent pairs,
# llama GGUFs hold Q and K permuted for it; NEOX: the two halves of a head),
# as an architecture's traits (csrc/native/arch/<name>.c) say it.
PLAIN_DECODER = dict(activation="silu", qk_norm=False, post_norms=False, embd_scale=False, final_softcap=False,
                     attn_scale_on_q=False, sliding_window=False)


def computes(traits: ArchTraits | None) -> bool:
    """Whether this network computes an architecture with these traits."""
    return traits is not None and all(getattr(traits, k) == v for k, v in PLAIN_DECODER.items())

# The tensors this network computes, per layer and global (a model with any other is refused).
LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias",
                 "attn_k.bias", "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                 "ffn_up.weight", "ffn_down.weight")
GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")


@dataclass(frozen=True)
class NetShape:
    """Everything that fixes the network's function besides its weights."""

    arch: str               # an architecture whose traits it computes
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    eps: float              # RMSNorm epsilon
    rope_base: float
    rope_scale: float = 1.0  # positions are multiplied by it (linear RoPE scaling)
    qkv_bias: bool = False
    tied: bool = True       # the output projection is token_embd
    n_ctx: int = 4096       # the context length the exported file declares

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


TRAIN_EXTRA = "pip install 'edgespec[train]'"


def import_torch():
    """PyTorch, or an InvalidArgumentError saying how to install it."""
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError(f"edgespec drafter train needs PyTorch: {TRAIN_EXTRA}") from None
    return torch


def bf16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 at full speed (oneDNN's AVX-512
    or AMX kernels): there autocast's bfloat16 matrix products train at about
    2.6x float32's (measured on Zen 4: 377 against 146 GFLOP/s, 2 threads);
    on AVX2 alone they would be emulated, slower than float32."""
    torch = import_torch()
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def build(s: NetShape):
    """The network of shape ``s``, weights at PyTorch's defaults."""
    torch = import_torch()
    nn, F = torch.nn, torch.nn.functional
    hd, neox = s.head_dim, arch_traits(s.arch).rope_neox

    def rope(x, cos, sin):                       # x (B, T, H, hd); cos, sin (1, T, 1, hd/2)
        if neox:
            x0, x1 = x[..., :hd // 2], x[..., hd // 2:]
            return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.RMSNorm(s.n_embd, eps=s.eps)
            self.attn_q = nn.Linear(s.n_embd, s.n_head * hd, bias=s.qkv_bias)        # (n_head*hd, n_embd)
            self.attn_k = nn.Linear(s.n_embd, s.n_head_kv * hd, bias=s.qkv_bias)     # (n_head_kv*hd, n_embd)
            self.attn_v = nn.Linear(s.n_embd, s.n_head_kv * hd, bias=s.qkv_bias)
            self.attn_output = nn.Linear(s.n_head * hd, s.n_embd, bias=False)
            self.ffn_norm = nn.RMSNorm(s.n_embd, eps=s.eps)
            self.ffn_gate = nn.Linear(s.n_embd, s.n_ff, bias=False)                  # (n_ff, n_embd)
            self.ffn_up = nn.Linear(s.n_embd, s.n_ff, bias=False)
            self.ffn_down = nn.Linear(s.n_ff, s.n_embd, bias=False)

        def forward(self, x, cos, sin, past=None, keep_kv: bool = False):
            """x (B, T, n_embd) -> (B, T, n_embd), causal; with ``past`` =
            (k, v, mask), x's rows also see earlier calls' k and v
            ((B, H_kv, P, hd) each) as the boolean mask ((T, P + T): past
            columns, then x's own) says, instead of causally (a draft head
            trained on its own drafted rows). ``keep_kv``: also returns this
            call's (k, v), for a later call's past."""
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = rope(self.attn_q(h).view(B, T, s.n_head, hd), cos, sin).transpose(1, 2)     # (B, H, T, hd)
            k = rope(self.attn_k(h).view(B, T, s.n_head_kv, hd), cos, sin).transpose(1, 2)
            v = self.attn_v(h).view(B, T, s.n_head_kv, hd).transpose(1, 2)
            gqa = s.n_head_kv != s.n_head
            if past is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                pk, pv, mask = past
                a = F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), attn_mask=mask,
                                                   enable_gqa=gqa)
            x = x + self.attn_output(a.transpose(1, 2).reshape(B, T, s.n_head * hd))
            h = self.ffn_norm(x)
            out = x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))
            return (out, (k, v)) if keep_kv else out

    class Network(nn.Module):
        def __init__(self):
            super().__init__()
            self.shape = s
            self.token_embd = nn.Embedding(s.n_vocab, s.n_embd)      # (n_vocab, n_embd)
            self.blk = nn.ModuleList(Block() for _ in range(s.n_layer))
            self.output_norm = nn.RMSNorm(s.n_embd, eps=s.eps)
            if not s.tied:
                self.output = nn.Linear(s.n_embd, s.n_vocab, bias=False)   # (n_vocab, n_embd)

        def rotation(self, T: int, start: int = 0):
            """cos, sin (1, T, 1, hd/2) of positions start..start+T-1."""
            pos = torch.arange(start, start + T, dtype=torch.float32, device=self.token_embd.weight.device) * s.rope_scale
            inv = s.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=pos.device) / hd)
            ang = pos[:, None] * inv[None, :]                         # (T, hd/2)
            return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]

        def forward(self, tokens):                                    # (B, T) -> logits (B, T, n_vocab)
            cos, sin = self.rotation(tokens.shape[1])
            x = self.token_embd(tokens)
            for b in self.blk:
                x = b(x, cos, sin)
            x = self.output_norm(x)
            return x @ (self.token_embd.weight if s.tied else self.output.weight).T

    return Network()


# -- from a GGUF model ----------------------------------------------------------------------

def read_shape(f: GGUFFile) -> NetShape:
    """The shape of the model in ``f`` (every layer, its whole vocabulary).
    InvalidArgumentError naming what this network cannot compute."""
    arch = f.get("general.architecture")
    if not computes(arch_traits(arch)):
        plain = (a for a in architectures() if computes(arch_traits(a)))
        raise InvalidArgumentError(f"{f.path}: a drafter cannot be grown from a {arch} model "
                                   f"(architectures: {', '.join(plain)})")
    n_layer = f.get(f"{arch}.block_count", 0)
    known = set(GLOBAL_TENSORS) | {f"blk.{il}.{n}" for il in range(n_layer) for n in LAYER_TENSORS}
    foreign = sorted({t.name for t in f.tensors} - known)
    if foreign:
        raise InvalidArgumentError(f"{f.path}: a drafter cannot be grown from this model: it has "
                                   f"{', '.join(foreign[:3])}, which the training network does not compute")

    def key(name, default=None):
        return f.get(f"{arch}.{name}", default)

    shapes = f.arch_shapes()   # widths as the native engine binds them
    # RoPE as the native engine resolves it (every layer alike without a sliding
    # window; a scaling or partial rotation it does not compute is UnsupportedModelError).
    rope = f.arch_traits().layers[0]
    n_head = key("attention.head_count")
    n_embd, n_vocab = shapes["token_embd.weight"]
    if shapes["blk.0.attn_q.weight"][1] != n_embd:
        raise InvalidArgumentError(f"{f.path}: a drafter cannot be grown from a model whose heads do not span "
                                   "its width")
    return NetShape(arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                    n_head_kv=key("attention.head_count_kv", n_head), n_ff=shapes["blk.0.ffn_gate.weight"][1],
                    eps=key("attention.layer_norm_rms_epsilon"), rope_base=rope.rope_base,
                    rope_scale=rope.rope_scale,
                    qkv_bias=f.tensor("blk.0.attn_q.bias") is not None,
                    tied=f.tensor("output.weight") is None, n_ctx=key("context_length", 4096))


def _check_layers(s: NetShape, layers: Sequence[int]) -> None:
    if not layers or len(set(layers)) != len(layers) or not all(0 <= il < s.n_layer for il in layers):
        raise InvalidArgumentError(f"--layers must name distinct layers of the model's {s.n_layer} "
                                   f"(0 to {s.n_layer - 1}), got {','.join(map(str, layers))}")


def _tensor(f: GGUFFile, name: str, shape, rows: np.ndarray | None = None):
    t = f.tensor(name)
    if t is None:
        raise InvalidArgumentError(f"{f.path}: no tensor {name}, which its other layers have")
    a = t.dequantize()
    return import_torch().from_numpy(np.ascontiguousarray(a if rows is None else a[rows])).reshape(shape)


def _load_block(f: GGUFFile, block, il: int) -> None:
    """Block ``il`` of the file's model into ``block`` (a block of ``build``)."""
    block.load_state_dict({name: _tensor(f, f"blk.{il}.{name}", p.shape) for name, p in block.state_dict().items()})


def read_gguf(path, layers: Sequence[int] | None = None, keep: np.ndarray | None = None):
    """The network of the model at ``path`` with only its blocks ``layers``
    (in that order; default all) and only the vocabulary rows ``keep`` (target
    ids; default all) of its embedding and output: its weights dequantized to
    float32. With every layer and row it computes the model's logits."""
    with GGUFFile(path) as f:
        full = read_shape(f)
        layers = list(range(full.n_layer)) if layers is None else list(layers)
        _check_layers(full, layers)
        rows = np.arange(full.n_vocab) if keep is None else np.asarray(keep)
        net = build(replace(full, n_layer=len(layers), n_vocab=len(rows)))
        for block, il in zip(net.blk, layers):
            _load_block(f, block, il)
        state = {name: _tensor(f, name, p.shape, rows if name in ("token_embd.weight", "output.weight") else None)
                 for name, p in net.state_dict().items() if not name.startswith("blk.")}
        net.load_state_dict(state, strict=False)
    return net


def block_influence(path, sequences: Sequence[np.ndarray], on_layer=lambda: None) -> np.ndarray:
    """Each layer's block influence (ShortGPT, Men et al. 2024) on the
    token sequences (target ids): 1 - the mean cosine similarity of a token's
    hidden state before and after the block, in one forward pass of the whole
    model, one block in memory at a time. (n_layer,) float64; the layers that
    change the hidden state least matter least. ``on_layer()`` after each layer."""
    torch = import_torch()
    with GGUFFile(path) as f:
        s = read_shape(f)
        embd = f.tensor("token_embd.weight").dequantize()                                  # (n_vocab, n_embd)
        xs = [torch.from_numpy(embd[np.asarray(seq, np.int64)])[None] for seq in sequences]   # (1, T, n_embd)
        del embd
        one = build(replace(s, n_layer=1, n_vocab=1))
        block = one.blk[0]
        out = np.zeros(s.n_layer)
        with torch.no_grad():
            for il in range(s.n_layer):
                _load_block(f, block, il)
                for i, x in enumerate(xs):
                    cos, sin = one.rotation(x.shape[1])
                    y = block(x, cos, sin)
                    out[il] += float((1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).sum())
                    xs[i] = y
                on_layer()
    return out / max(sum(x.shape[1] for x in xs), 1)


def choose_layers(influence: np.ndarray, n: int) -> list[int]:
    """The ``n`` layers of most influence, in model order (ties: the earlier layer)."""
    order = np.lexsort((np.arange(len(influence)), -influence))
    return sorted(int(i) for i in order[:n])
