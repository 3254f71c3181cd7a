"""Tiny random-weight llama-architecture GGUF files for tests.

    write_tiny_llama(path, "SmolLM2-135M-Instruct.Q4_1.gguf")

The weights are random, the tokenizer is real: every ``tokenizer.*`` key of
the source file is copied byte for byte, so llama.cpp tokenizes (and applies
the chat template) exactly as it does for the source model, while a forward
pass costs next to nothing. Tensor names and shapes are the ones llama.cpp's
llama architecture loads (src/models/llama.cpp); numpy shapes below are
(rows, cols) = GGUF's (ne1, ne0) reversed.
"""
from __future__ import annotations

import os

import gguf
import numpy as np

ARCH = "llama"
_NP_DTYPE = {gguf.GGMLQuantizationType.F16: np.float16,
             gguf.GGMLQuantizationType.F32: np.float32}
_FILE_TYPE = {gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
              gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32}


def _tensor_name(kind: gguf.MODEL_TENSOR, layer: int | None = None) -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight"


def _field_value(field: gguf.ReaderField):
    """A reader field's value as GGUFWriter.add_key_value takes it. Strings stay
    bytes, so that tokens which are not valid UTF-8 survive the copy."""
    main = field.types[0]
    if main == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    if main == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data]
    return field.contents()


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Copy every tokenizer.* key of `reader` into `writer`; return the vocabulary size."""
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, _field_value(field), field.types[0], sub_type)
    return len(reader.fields[gguf.Keys.Tokenizer.LIST].data)


def write_tiny_llama(path: str | os.PathLike, tokenizer_source: str | os.PathLike, *,
                     n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 128, n_ctx: int = 512, seed: int = 0,
                     dtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16) -> None:
    """Write a random llama model with `tokenizer_source`'s tokenizer to `path`.

    Matrices are stored as `dtype` (F16 or F32), norms always as F32. Each
    matrix is N(0, 1/fan_in), so every block keeps the residual stream at unit
    scale; the output matrix is scaled up so that logits spread over several
    units and greedy decoding does not settle on one token.
    """
    if dtype not in _NP_DTYPE:
        raise ValueError(f"dtype must be F16 or F32, got {dtype!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv            # width of K and V (grouped-query attention)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))
        return w.astype(_NP_DTYPE[dtype])

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    reader = gguf.GGUFReader(tokenizer_source)
    writer = gguf.GGUFWriter(path, ARCH)
    try:
        writer.add_name("tiny-random-llama")
        writer.add_file_type(_FILE_TYPE[dtype])
        n_vocab = copy_tokenizer(reader, writer)
        writer.add_vocab_size(n_vocab)
        writer.add_context_length(n_ctx)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(1e-5)

        T = gguf.MODEL_TENSOR
        # Embedding rows at unit scale: (n_vocab, n_embd).
        writer.add_tensor(_tensor_name(T.TOKEN_EMBD), matrix(n_vocab, n_embd, np.sqrt(n_embd)))
        for i in range(n_layer):
            writer.add_tensor(_tensor_name(T.ATTN_NORM, i), norm())
            writer.add_tensor(_tensor_name(T.ATTN_Q, i), matrix(n_embd, n_embd))       # (n_head*hd, n_embd)
            writer.add_tensor(_tensor_name(T.ATTN_K, i), matrix(n_embd_kv, n_embd))    # (n_head_kv*hd, n_embd)
            writer.add_tensor(_tensor_name(T.ATTN_V, i), matrix(n_embd_kv, n_embd))    # (n_head_kv*hd, n_embd)
            writer.add_tensor(_tensor_name(T.ATTN_OUT, i), matrix(n_embd, n_embd))     # (n_embd, n_head*hd)
            writer.add_tensor(_tensor_name(T.FFN_NORM, i), norm())
            writer.add_tensor(_tensor_name(T.FFN_GATE, i), matrix(n_ff, n_embd))       # (n_ff, n_embd)
            writer.add_tensor(_tensor_name(T.FFN_UP, i), matrix(n_ff, n_embd))         # (n_ff, n_embd)
            writer.add_tensor(_tensor_name(T.FFN_DOWN, i), matrix(n_embd, n_ff))       # (n_embd, n_ff)
        writer.add_tensor(_tensor_name(T.OUTPUT_NORM), norm())
        # (n_vocab, n_embd); logits ~ N(0, 4^2) on a unit-RMS final state.
        writer.add_tensor(_tensor_name(T.OUTPUT), matrix(n_vocab, n_embd, 4.0))

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
