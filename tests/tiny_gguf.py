"""Tiny random-weight GGUF files for tests.

    write_tiny_vocab(source)                                      # a generated tokenizer
    write_tiny_llama(path, source)                                # or a real model's file
    write_tiny_llama(path, source, n_expert=4, n_expert_used=2)   # Mixtral-style MoE
    write_tiny_qwen3moe(path, source)
    write_tiny_qwen2(path, source)                                # Q/K/V biases, NEOX RoPE
    write_tiny_qwen3(path, source)                                # head norms, heads wider than n_embd
    write_tiny_gemma3(path, source)                               # head norms, post norms, GELU, windows
    copy_gguf(path, variant, drop=["blk.0.attn_q.bias"])          # a file a loader must refuse

The weights are random, the tokenizer is a source file's: every
``tokenizer.*`` key of it is copied byte for byte, so llama.cpp tokenizes (and
applies the chat template) exactly as it does for the source, while a forward
pass costs next to nothing. The source is a real model (SmolLM2's 49k-token
tokenizer) or write_tiny_vocab's small byte-level BPE, which needs no
download. Tensor names, shapes and hyperparameter keys are the ones
llama.cpp's loaders read (src/models/llama.cpp, qwen2.cpp, qwen3.cpp, qwen3moe.cpp, gemma3.cpp);
numpy shapes below are GGUF's ne reversed: (rows, cols) = (ne1, ne0), and an
expert stack (n_expert, rows, cols) = (ne2, ne1, ne0).

Matrices may be stored quantized: the gguf package quantizes the legacy
types (Q4_0 ... Q8_0), llama.cpp's own ggml_quantize_chunk the K-quants.
Two knobs make MoE files whose outputs must agree with another file's,
which is how the tests check expert routing: ``identical_experts`` (every
expert a copy of the dense FFN the same seed gives, so the MoE model computes
what the dense one does) and ``expert_order`` (the same experts stored in
another order).
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

from edgespec.models.gguf_write import copy_keys, field_value

Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR

_FILE_TYPE = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
              Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
              Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
              Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M, Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
              Q.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K, Q.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_M}
# Types the gguf package quantizes in numpy; the K-quants need llama.cpp.
_NUMPY_QUANTS = {Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
_GGML_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


# An expert stack type: one for gate, up and down, or a (gate, up, down) triple
# (llama.cpp's Q4_K_M stores down as Q6_K).
ExpertTypes = Q | tuple[Q, Q, Q]


def _tensor_name(kind: gguf.MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=layer) + "." + suffix


# ---- weight types -------------------------------------------------------------------

_ggml = None


def _ggml_base():
    """llama.cpp's ggml-base library, as llama-cpp-python ships it."""
    global _ggml
    if _ggml is None:
        import llama_cpp
        from llama_cpp._ctypes_extensions import load_shared_library

        lib = load_shared_library("ggml-base", Path(llama_cpp.__file__).parent / "lib")
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_row_size.restype = ctypes.c_size_t
        # size_t ggml_quantize_chunk(type, const float * src, void * dst, int64_t start,
        #                            int64_t nrows, int64_t n_per_row, const float * imatrix)
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_void_p]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        _ggml = lib
    return _ggml


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """`w` (..., cols) as `qtype`: F32 and F16 as numpy floats, any other type
    as GGUF's raw bytes, (..., bytes per row), ready for GGUFWriter.add_tensor
    with raw_dtype=qtype."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    cols = w.shape[-1]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    if qtype in _NUMPY_QUANTS:
        return gguf.quants.quantize(w, qtype)
    if qtype not in _GGML_QUANTS:
        raise ValueError(f"cannot quantize to {qtype.name}")
    lib = _ggml_base()
    rows = w.reshape(-1, cols)
    out = np.empty((rows.shape[0], lib.ggml_row_size(qtype, cols)), dtype=np.uint8)
    lib.ggml_quantize_chunk(qtype, rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], cols, None)
    return out.reshape(*w.shape[:-1], out.shape[-1])


# ---- a generated tokenizer ----------------------------------------------------------------

# The text the generated tokenizer learns its merges from: the kinds of prompt
# the tests send (English, numbers, code, chat turns).
_CORPUS = """\
Hello world! Hello there. The quick brown fox jumps over the lazy dog.
Once upon a time there was a little model that wanted to speak. It read every word
it could find, and then it wrote them down again, one token at a time.
The capital of France is Paris. The three primary colors are red, yellow and blue.
Water boils at one hundred degrees. What is 2+2? The answer is 4. Name a fruit and a vegetable.
1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))
The user asks a question and the assistant answers it. Be brief, be kind, and say why.
Speculative decoding drafts tokens and the target model verifies them in one batch.
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = ("{% for message in messages %}"
                   "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
                   "{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# GPT-2's pre-tokenizer (llama.cpp's "gpt-2" split), with \p{L} and \p{N} as Python spells them.
_PRE_SPLIT = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b is spelled byte_chars()[b], itself
    when printable Latin-1, else a character from U+0100 on (space is "Ġ",
    newline "Ċ"). Byte-level BPE vocabularies spell every token this way."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, moved = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + moved))
            moved += 1
    return chars


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges of `text`, most frequent pair first (ties broken
    by the pair itself, so the result is deterministic); fewer when every
    word of `text` is one piece."""
    chars = byte_chars()
    words = Counter(tuple(chars[b] for b in w.encode()) for w in _PRE_SPLIT.findall(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


# Qwen2.5-Coder's fill-in-the-middle tokens, which llama.cpp finds by their text.
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def write_tiny_vocab(path: str | os.PathLike, n_merges: int = 256, *, fim: bool = False) -> None:
    """Write a GGUF that holds only a tokenizer, generated here: GPT-2-style
    byte-level BPE (llama.cpp's "gpt2" model, "gpt-2" pre-tokenizer) over the
    three ChatML special tokens, the 256 byte tokens and up to `n_merges`
    pieces learned from _CORPUS, with a ChatML chat template; with `fim`, the
    three FIM_TOKENS come last. Any text tokenizes (every byte has a token);
    <|im_end|> ends generation. The tokenizer source for tiny models that need
    no download."""
    merges = learn_merges(_CORPUS, n_merges)
    # Two merges may spell the same piece ("a"+"bc", "ab"+"c"): one token.
    tokens = list(dict.fromkeys([*SPECIAL_TOKENS, *byte_chars(), *(a + b for a, b in merges)]))
    n_normal = len(tokens) - len(SPECIAL_TOKENS)
    extra = FIM_TOKENS if fim else ()
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens + list(extra))
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * n_normal
                      + [gguf.TokenType.CONTROL] * len(extra))
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(SPECIAL_TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(SPECIAL_TOKENS.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- copying GGUF metadata ------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: str) -> tuple[list[tuple], int]:
    """The tokenizer.* keys of `source` as (key, value, type, sub_type), and the
    vocabulary size. Parsing a real tokenizer takes seconds; tests write
    several models with one tokenizer."""
    reader = gguf.GGUFReader(source)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field_value(field), field.types[0], sub_type))
    return fields, len(reader.fields[gguf.Keys.Tokenizer.LIST].data)


def copy_tokenizer(source: str | os.PathLike, writer: gguf.GGUFWriter) -> int:
    """Copy every tokenizer.* key of the GGUF file `source` into `writer`;
    return the vocabulary size."""
    fields, n_vocab = _tokenizer_fields(str(source))
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type)
    return n_vocab


def copy_gguf(source: str | os.PathLike, path: str | os.PathLike, *, drop: Sequence[str] = (),
              add: dict[str, np.ndarray] | None = None) -> None:
    """Copy the GGUF file `source` to `path`, every key and tensor, less the
    tensors named in `drop` and plus the F32 tensors of `add` (name -> array,
    numpy shape): the variants of a model a loader must refuse."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    copy_keys(reader, writer)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, w in (add or {}).items():
        writer.add_tensor(name, np.asarray(w, dtype=np.float32))
    _write_out(writer)


def _write_out(writer: gguf.GGUFWriter) -> None:
    """Write what `writer` holds and close it, also when writing fails."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


# ---- random models --------------------------------------------------------------------

class _RandomModel:
    """One random model being written: its GGUF writer, tokenizer, random
    number stream and the tensors every llama-family architecture shares.

    Each matrix is N(0, gain^2/fan_in), so every block keeps the residual
    stream at unit scale; the output matrix is scaled up so that logits spread
    over several units and greedy decoding does not settle on one token.
    """

    def __init__(self, path, arch: str, tokenizer_source, *, seed: int, dtype: Q,
                 norm_noise: float):
        if dtype not in _FILE_TYPE:
            raise ValueError(f"unsupported dtype {dtype!r}")
        self.rng = np.random.default_rng(seed)
        # Routers draw from a stream of their own, so that a MoE model's other
        # tensors are those of the dense model with the same seed.
        self.router_rng = np.random.default_rng([seed, 1])
        self.dtype = dtype
        self.norm_noise = norm_noise
        self.writer = gguf.GGUFWriter(path, arch)
        self.writer.add_file_type(_FILE_TYPE[dtype])
        self.n_vocab = copy_tokenizer(tokenizer_source, self.writer)
        self.writer.add_vocab_size(self.n_vocab)

    def add(self, kind: T, layer: int | None, w: np.ndarray, dtype: Q | None = None) -> None:
        qtype = self.dtype if dtype is None else dtype
        self.writer.add_tensor(_tensor_name(kind, layer), quantize(w, qtype), raw_dtype=qtype)

    def draw(self, shape: tuple[int, ...], gain: float = 1.0,
             rng: np.random.Generator | None = None) -> np.ndarray:
        """Random weights for matrices of shape[-1] columns."""
        w = (rng or self.rng).standard_normal(shape, dtype=np.float32)
        return w * np.float32(gain / np.sqrt(shape[-1]))

    def matrix(self, kind: T, layer: int | None, rows: int, cols: int, *,
               gain: float = 1.0) -> None:
        """A (rows, cols) matrix."""
        self.add(kind, layer, self.draw((rows, cols), gain))

    def bias(self, kind: T, layer: int, n: int) -> None:
        """The F32 bias of matrix `kind`, (n) ~ N(0, 1): as large as the
        product it is added to, so that a bias left out shows in the logits."""
        w = self.rng.standard_normal(n, dtype=np.float32)
        self.writer.add_tensor(_tensor_name(kind, layer, "bias"), w, raw_dtype=Q.F32)

    def norm(self, kind: T, layer: int | None, n: int) -> None:
        """An RMSNorm weight (F32, as converters store norms): ones, or with
        norm_noise ones plus noise, so that a norm applied without its weight
        shows in the logits."""
        w = np.ones(n, dtype=np.float32)
        if self.norm_noise:
            w += self.rng.standard_normal(n, dtype=np.float32) * np.float32(self.norm_noise)
        self.add(kind, layer, w, Q.F32)

    def common_keys(self, *, name: str, n_ctx: int, n_embd: int, n_layer: int, n_ff: int,
                    n_head: int, n_head_kv: int, rms_eps: float,
                    rope_base: float = 10000.0, head_dim: int | None = None) -> None:
        """The keys every architecture here reads; head_dim: a head width of
        the model's own (key_length, value_length: n_head * head_dim need not be n_embd)."""
        w = self.writer
        w.add_name(name)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(rope_base)
        w.add_layer_norm_rms_eps(rms_eps)
        if head_dim is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)

    def attention(self, i: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int) -> None:
        self.norm(T.ATTN_NORM, i, n_embd)
        self.matrix(T.ATTN_Q, i, n_head * head_dim, n_embd)        # (n_head*hd, n_embd)
        self.matrix(T.ATTN_K, i, n_head_kv * head_dim, n_embd)     # (n_head_kv*hd, n_embd)
        self.matrix(T.ATTN_V, i, n_head_kv * head_dim, n_embd)     # (n_head_kv*hd, n_embd)
        self.matrix(T.ATTN_OUT, i, n_embd, n_head * head_dim)      # (n_embd, n_head*hd)

    def normed_attention(self, i: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int) -> None:
        """Attention with a per-head RMSNorm of Q and of K (qwen3, qwen3moe, gemma3)."""
        self.attention(i, n_embd, n_head, n_head_kv, head_dim)
        self.norm(T.ATTN_Q_NORM, i, head_dim)
        self.norm(T.ATTN_K_NORM, i, head_dim)

    def dense_ffn(self, i: int, n_embd: int, n_ff: int) -> None:
        self.norm(T.FFN_NORM, i, n_embd)
        self.matrix(T.FFN_GATE, i, n_ff, n_embd)                  # (n_ff, n_embd)
        self.matrix(T.FFN_UP, i, n_ff, n_embd)                    # (n_ff, n_embd)
        self.matrix(T.FFN_DOWN, i, n_embd, n_ff)                  # (n_embd, n_ff)

    def moe_ffn(self, i: int, n_embd: int, n_ff_exp: int, n_expert: int,
                expert_dtype: ExpertTypes, *, identical: bool = False,
                order: Sequence[int] | None = None) -> None:
        """A router and n_expert SwiGLU experts, stored as expert_dtype (one
        type, or one each for gate, up and down). With `identical` every
        expert is the FFN dense_ffn would draw here; with `order` expert e is
        stored at slot order[e] (router row and stacks alike)."""
        types = expert_dtype if isinstance(expert_dtype, tuple) else (expert_dtype,) * 3
        self.norm(T.FFN_NORM, i, n_embd)
        # The router stays F32, as llama.cpp's quantizer leaves it: (n_expert, n_embd),
        # logits ~ N(0, 1) so that routing weights vary between tokens.
        router = self.draw((n_expert, n_embd), rng=self.router_rng)
        stacks = {}
        for kind, rows, cols in ((T.FFN_GATE_EXP, n_ff_exp, n_embd),    # (n_expert, n_ff_exp, n_embd)
                                 (T.FFN_UP_EXP, n_ff_exp, n_embd),      # (n_expert, n_ff_exp, n_embd)
                                 (T.FFN_DOWN_EXP, n_embd, n_ff_exp)):   # (n_expert, n_embd, n_ff_exp)
            stacks[kind] = (np.broadcast_to(self.draw((rows, cols)), (n_expert, rows, cols))
                            if identical else self.draw((n_expert, rows, cols)))
        slot = np.arange(n_expert)
        if order is not None:
            if sorted(order) != list(range(n_expert)):
                raise ValueError(f"expert_order must be a permutation of range({n_expert})")
            slot = np.argsort(order)     # slot s holds expert slot[s]
        self.add(T.FFN_GATE_INP, i, router[slot], Q.F32)
        for (kind, w), qtype in zip(stacks.items(), types):
            self.add(kind, i, w[slot], qtype)

    def embeddings(self, n_embd: int) -> None:
        # Rows at unit scale: (n_vocab, n_embd).
        self.matrix(T.TOKEN_EMBD, None, self.n_vocab, n_embd, gain=float(np.sqrt(n_embd)))

    def output(self, n_embd: int) -> None:
        self.norm(T.OUTPUT_NORM, None, n_embd)
        # (n_vocab, n_embd); logits ~ N(0, 4^2) on a unit-RMS final state.
        self.matrix(T.OUTPUT, None, self.n_vocab, n_embd, gain=4.0)

    def write(self) -> None:
        try:
            self.writer.write_header_to_file()
            self.writer.write_kv_data_to_file()
            self.writer.write_tensors_to_file()
        finally:
            self.writer.close()


def _check_heads(n_embd: int, n_head: int, n_head_kv: int) -> None:
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")


def _check_groups(n_head: int, n_head_kv: int) -> None:
    if n_head % n_head_kv:
        raise ValueError("n_head must divide by n_head_kv")


def _check_experts(n_expert: int, n_expert_used: int) -> None:
    if not 0 < n_expert_used <= n_expert:
        raise ValueError(f"need 0 < n_expert_used <= n_expert, got {n_expert_used} of {n_expert}")


def write_tiny_llama(path: str | os.PathLike, tokenizer_source: str | os.PathLike, *,
                     n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 128, n_ctx: int = 512, seed: int = 0, dtype: Q = Q.F16,
                     n_expert: int = 0, n_expert_used: int = 0,
                     expert_dtype: ExpertTypes | None = None,
                     identical_experts: bool = False, expert_order: Sequence[int] | None = None,
                     norm_noise: float = 0.0) -> None:
    """Write a random llama model with `tokenizer_source`'s tokenizer to `path`.

    Matrices are stored as `dtype`, norms as F32 (ones, plus N(0, norm_noise^2)).
    With n_expert > 0 every feed-forward block is a Mixtral-style mixture of
    n_expert SwiGLU experts of width n_ff (stored as `expert_dtype`, default
    `dtype`; or a (gate, up, down) triple), n_expert_used of them routed per token. identical_experts makes
    every expert the FFN of the dense model with the same seed, so that the two
    files compute the same function; expert_order stores expert e at slot
    expert_order[e], the same model in another order.
    """
    _check_heads(n_embd, n_head, n_head_kv)
    if n_expert:
        _check_experts(n_expert, n_expert_used)
    head_dim = n_embd // n_head
    m = _RandomModel(path, "llama", tokenizer_source, seed=seed, dtype=dtype,
                     norm_noise=norm_noise)
    m.common_keys(name="tiny-random-llama" + ("-moe" if n_expert else ""), n_ctx=n_ctx,
                  n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                  rms_eps=1e-5)
    m.writer.add_rope_dimension_count(head_dim)
    if n_expert:
        m.writer.add_expert_count(n_expert)
        m.writer.add_expert_used_count(n_expert_used)
    m.embeddings(n_embd)
    for i in range(n_layer):
        m.attention(i, n_embd, n_head, n_head_kv, head_dim)
        if n_expert:
            m.moe_ffn(i, n_embd, n_ff, n_expert, expert_dtype or dtype,
                      identical=identical_experts, order=expert_order)
        else:
            m.dense_ffn(i, n_embd, n_ff)
    m.output(n_embd)
    m.write()


def write_tiny_qwen3moe(path: str | os.PathLike, tokenizer_source: str | os.PathLike, *,
                        n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2,
                        head_dim: int = 64, n_expert: int = 8, n_expert_used: int = 2,
                        n_ff_exp: int = 64, n_ctx: int = 1024, seed: int = 0,
                        dtype: Q = Q.F16, expert_dtype: ExpertTypes = Q.Q8_0,
                        expert_order: Sequence[int] | None = None,
                        norm_noise: float = 0.1) -> None:
    """Write a random qwen3moe model with `tokenizer_source`'s tokenizer to `path`.

    As Qwen3's: per-head RMSNorm of Q and K before NEOX RoPE, a head width of
    its own (head_dim, stored as key_length/value_length; n_head * head_dim
    need not be n_embd), and every feed-forward block a mixture of n_expert
    SwiGLU experts of width n_ff_exp, routed by softmax, top n_expert_used and
    renormalization of the chosen weights. expert_order as for write_tiny_llama.
    """
    _check_groups(n_head, n_head_kv)
    _check_experts(n_expert, n_expert_used)
    m = _RandomModel(path, "qwen3moe", tokenizer_source, seed=seed, dtype=dtype,
                     norm_noise=norm_noise)
    # feed_forward_length is the dense width of the source model, unused by a
    # model whose every block is MoE; converters write it all the same.
    m.common_keys(name="tiny-random-qwen3moe", n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer,
                  n_ff=n_ff_exp * n_expert_used, n_head=n_head, n_head_kv=n_head_kv,
                  rms_eps=1e-6, head_dim=head_dim)
    m.writer.add_expert_count(n_expert)
    m.writer.add_expert_used_count(n_expert_used)
    m.writer.add_expert_feed_forward_length(n_ff_exp)
    m.embeddings(n_embd)
    for i in range(n_layer):
        m.normed_attention(i, n_embd, n_head, n_head_kv, head_dim)
        m.moe_ffn(i, n_embd, n_ff_exp, n_expert, expert_dtype, order=expert_order)
    m.output(n_embd)
    m.write()


def write_tiny_qwen2(path: str | os.PathLike, tokenizer_source: str | os.PathLike, *,
                     n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 128, n_ctx: int = 512, seed: int = 0, dtype: Q = Q.F16,
                     tied: bool = False, norm_noise: float = 0.1) -> None:
    """Write a random qwen2 model with `tokenizer_source`'s tokenizer to `path`.

    As Qwen2.5's: llama's blocks plus F32 biases on the Q, K and V projections,
    RoPE in the NEOX layout with base 1e6, RMSNorm epsilon 1e-6. `tied` leaves
    out output.weight: the output projection is the token embedding, as in
    Qwen2.5 0.5B to 3B. Matrices and norms as for write_tiny_llama.
    """
    _check_heads(n_embd, n_head, n_head_kv)
    head_dim = n_embd // n_head
    m = _RandomModel(path, "qwen2", tokenizer_source, seed=seed, dtype=dtype,
                     norm_noise=norm_noise)
    m.common_keys(name="tiny-random-qwen2", n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer,
                  n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, rms_eps=1e-6, rope_base=1e6)
    m.embeddings(n_embd)
    for i in range(n_layer):
        m.attention(i, n_embd, n_head, n_head_kv, head_dim)
        m.bias(T.ATTN_Q, i, n_head * head_dim)
        m.bias(T.ATTN_K, i, n_head_kv * head_dim)
        m.bias(T.ATTN_V, i, n_head_kv * head_dim)
        m.dense_ffn(i, n_embd, n_ff)
    if tied:
        m.norm(T.OUTPUT_NORM, None, n_embd)
    else:
        m.output(n_embd)
    m.write()


def write_tiny_qwen3(path: str | os.PathLike, tokenizer_source: str | os.PathLike, *,
                     n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     head_dim: int = 32, n_ff: int = 128, n_ctx: int = 512, seed: int = 0,
                     dtype: Q = Q.F16, norm_noise: float = 0.1) -> None:
    """Write a random qwen3 (dense) model with `tokenizer_source`'s tokenizer to `path`.

    As Qwen3's: per-head RMSNorm of Q and K before NEOX RoPE (base 1e6), a head
    width of its own (head_dim, stored as key_length/value_length: here
    n_head * head_dim = 2 n_embd, as in Qwen3-0.6B) and a dense SwiGLU FFN.
    """
    _check_groups(n_head, n_head_kv)
    m = _RandomModel(path, "qwen3", tokenizer_source, seed=seed, dtype=dtype,
                     norm_noise=norm_noise)
    m.common_keys(name="tiny-random-qwen3", n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff,
                  n_head=n_head, n_head_kv=n_head_kv, rms_eps=1e-6, rope_base=1e6, head_dim=head_dim)
    m.embeddings(n_embd)
    for i in range(n_layer):
        m.normed_attention(i, n_embd, n_head, n_head_kv, head_dim)
        m.dense_ffn(i, n_embd, n_ff)
    m.output(n_embd)
    m.write()


def write_tiny_gemma3(path: str | os.PathLike, tokenizer_source: str | os.PathLike, *,
                      n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 1,
                      head_dim: int = 32, n_ff: int = 128, n_ctx: int = 512, n_swa: int = 8,
                      swa_pattern: int = 2, seed: int = 0, dtype: Q = Q.F16,
                      norm_noise: float = 0.1) -> None:
    """Write a random gemma3 model with `tokenizer_source`'s tokenizer to `path`.

    As Gemma 3's (270m): a head width of its own (key_length), per-head RMS
    norms of Q and K, norms after attention and after the FFN, a GELU-gated
    FFN, embeddings scaled by sqrt(n_embd) and tied to the output; layers
    alternate sliding-window (n_swa positions, RoPE base 10000) and global
    attention (base 1e6): with period swa_pattern the last layer of each period
    is global. A small window makes it matter on short prompts.
    """
    _check_groups(n_head, n_head_kv)
    m = _RandomModel(path, "gemma3", tokenizer_source, seed=seed, dtype=dtype,
                     norm_noise=norm_noise)
    m.common_keys(name="tiny-random-gemma3", n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff,
                  n_head=n_head, n_head_kv=n_head_kv, rms_eps=1e-6, rope_base=1e6, head_dim=head_dim)
    m.writer.add_sliding_window(n_swa)
    m.writer.add_uint32("gemma3.attention.sliding_window_pattern", swa_pattern)
    m.embeddings(n_embd)
    for i in range(n_layer):
        m.normed_attention(i, n_embd, n_head, n_head_kv, head_dim)
        m.norm(T.ATTN_POST_NORM, i, n_embd)
        m.dense_ffn(i, n_embd, n_ff)
        m.norm(T.FFN_POST_NORM, i, n_embd)
    m.norm(T.OUTPUT_NORM, None, n_embd)
    m.write()


# ---- the MoE fixtures ----------------------------------------------------------------------

_MIXTRAL = dict(n_expert=4, n_expert_used=2, n_ctx=1024, norm_noise=0.1)

# The MoE files tests/test_native_moe.py and benchmarks/bench_native.py share:
# name -> (writer, keyword arguments). Float weights keep llama.cpp's results
# independent of its batch size; quantized experts are what real MoE files
# have (Qwen3-30B-A3B in miniature: head_dim 64 on n_embd 128, 8 Q8_0
# experts of width 64, top 2; Mixtral: 4 experts as llama.cpp's Q4_K_M stores
# them, gate/up Q4_K and down Q6_K (K-quants need rows of 256), Q8_0 elsewhere).
MOE_FIXTURES = {
    "qwen3moe-f32": (write_tiny_qwen3moe, dict(dtype=Q.F32, expert_dtype=Q.F32)),
    "mixtral-f16": (write_tiny_llama, dict(n_embd=128, n_ff=128, **_MIXTRAL)),
    "qwen3moe-q8_0": (write_tiny_qwen3moe, {}),
    "mixtral-q4_k": (write_tiny_llama, dict(n_embd=256, n_ff=256, n_head=8, n_head_kv=4,
                                            dtype=Q.Q8_0, expert_dtype=(Q.Q4_K, Q.Q4_K, Q.Q6_K),
                                            **_MIXTRAL)),
}


def write_moe_fixture(name: str, directory: str | os.PathLike,
                      tokenizer_source: str | os.PathLike, **overrides) -> Path:
    """Write MOE_FIXTURES[name] (its keyword arguments updated by `overrides`)
    to directory/<name>.gguf, unless it is there already; return the path."""
    write, kwargs = MOE_FIXTURES[name]
    path = Path(directory) / f"{name}.gguf"
    if not path.exists():
        write(path, tokenizer_source, **{**kwargs, **overrides})
    return path



# ---- specialized drafters ---------------------------------------------------------------

def write_trimmed_drafter(path: str | os.PathLike, target_vocab: str | os.PathLike, keep: Sequence[int], *,
                          seed: int = 2, keys: dict | None = None,
                          weights_of: str | os.PathLike | None = None) -> None:
    """A tiny random llama drafting for the tokenizer of `target_vocab` with
    only the target ids `keep`, in that order (a specialized drafter, see
    edgespec.drafters.specialized): its tokenizer is the target's cut down to
    them (merges whose pieces are all kept), plus the edgespec.drafter.* keys;
    `keys` (key -> value) replaces or adds some of those. With `weights_of`
    (a tiny llama of write_tiny_llama's default shape) its weights are that
    model's, the vocabulary rows cut to `keep`: it drafts what that model
    would wherever the model's choice is a kept token."""
    from edgespec.drafters import specialized
    reader = gguf.GGUFReader(str(target_vocab))
    tokens = [t.decode("utf-8") for t in field_value(reader.fields[gguf.Keys.Tokenizer.LIST])]
    folder = Path(path).parent
    vocab, model = folder / f".{Path(path).stem}.vocab.gguf", folder / f".{Path(path).stem}.model.gguf"
    w = gguf.GGUFWriter(str(vocab), "llama")
    specialized.add_trimmed_tokenizer(w, reader, keep)
    _write_out(w)
    write_tiny_llama(model, vocab, seed=seed)
    values = {specialized.KEY_TARGET: "tiny", specialized.KEY_TARGET_VOCAB: specialized.vocab_fingerprint(tokens),
              specialized.KEY_TARGET_N_VOCAB: len(tokens), specialized.KEY_TOKEN_MAP: list(keep),
              specialized.KEY_UNK: 0, specialized.KEY_LANGS: ["python"],
              specialized.KEY_PROFILE: specialized.char_profile([_CORPUS]), **(keys or {})}
    reader = gguf.GGUFReader(str(model))
    writer = gguf.GGUFWriter(str(path), "llama")
    copy_keys(reader, writer)
    for key, value in values.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    source = {t.name: t for t in gguf.GGUFReader(str(weights_of)).tensors} if weights_of else {}
    for t in reader.tensors:
        t = source.get(t.name, t)
        data = t.data[np.asarray(keep)] if source and t.name in ("token_embd.weight", "output.weight") else t.data
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    try:
        _write_out(writer)
    finally:
        vocab.unlink()
        model.unlink()
