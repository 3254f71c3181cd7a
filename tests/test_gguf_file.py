"""The GGUF reader (edgespec.models.gguf over the C core's csrc/native/gguf.c):
tiny files written with gguf-py's GGUFWriter, then corrupted byte by byte.
Every bad file must give one ModelFormatError line naming the file, never
another exception."""
from __future__ import annotations

import json
import random
import struct
import time

import gguf
import numpy as np
import pytest

from edgespec.capi import ffi, lib
from edgespec.errors import ModelFormatError, ModelNotFoundError
from edgespec.models.gguf import GGUFFile, check_gguf, model_info

N_TOKENS = 300
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_gguf(path, *, n_tokens=N_TOKENS, extra=None, alignment=None):
    """A small llama-like GGUF: hyperparameters, a tokenizer, F32/F16/Q8_0/Q4_K tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    w.add_token_merges([f"t o{i}" for i in range(n_tokens)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    w.add_array("test.nested", [[1, 2], [3, 4, 5], ["a", "b"]])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 0.5)
    if alignment is not None:
        alignment(w)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    w.add_tensor("token_embd.weight", np.arange(32 * 8, dtype=np.float32).reshape(8, 32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 34), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.1.ffn_up.weight", np.zeros((2, 144), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf")


@pytest.fixture
def corrupt(good, tmp_path):
    """corrupt(edit) -> path of a copy of the good file after edit(bytearray)."""
    def make(edit, name="bad.gguf"):
        data = bytearray(good.read_bytes())
        edit(data)
        path = tmp_path / name
        path.write_bytes(bytes(data))
        return path
    return make


def format_error(path) -> str:
    with pytest.raises(ModelFormatError) as exc:
        check_gguf(path)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(str(path) + ": "), message
    return message


def tensor_fields(data: bytes, name: str) -> dict[str, int]:
    """Byte positions of one tensor info's fields (found by its name)."""
    raw = name.encode()
    pos = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    fields = {"n_dims": pos, "dims": pos + 4}
    fields["type"] = pos + 4 + 8 * n_dims
    fields["offset"] = fields["type"] + 4
    return fields


def put(data: bytearray, pos: int, fmt: str, value) -> None:
    struct.pack_into(fmt, data, pos, value)


# ---------------------------------------------------------------------------
# Valid files
# ---------------------------------------------------------------------------


def test_reads_header_metadata_and_tensors(good):
    with GGUFFile(good) as f:
        assert f.version == 3
        assert f.alignment == 32 and f.data_offset % 32 == 0
        assert f.file_size == good.stat().st_size
        assert f.get("general.architecture") == "llama"
        assert f.get("llama.context_length") == 256
        assert f.get("test.flag") is True and f.get("test.f64") == 0.5
        assert f.get("absent") is None and f.get("absent", 7) == 7
        assert "general.name" in f and "absent" not in f
        assert f.keys()[:2] == ["general.architecture", "general.name"]
        assert f.value_type("test.flag") == lib.ES_GGUF_BOOL

        assert f.get("tokenizer.ggml.tokens") == [f"tok{i}" for i in range(N_TOKENS)]
        assert f.array_length("tokenizer.ggml.tokens") == N_TOKENS
        assert f.get("tokenizer.ggml.token_type") == [1] * N_TOKENS
        assert f.get("tokenizer.ggml.merges")[299] == "t o299"
        assert f.get("test.nested") == [[1, 2], [3, 4, 5], ["a", "b"]]
        assert f.array_length("general.name") is None

        by_name = {t.name: t for t in f.tensors}
        emb = by_name["token_embd.weight"]
        assert emb.shape == (32, 8) and emb.type_name == "F32" and emb.n_bytes == 32 * 8 * 4
        assert emb.n_elements == 256 and f.tensor("token_embd.weight") is emb
        assert by_name["blk.0.attn_q.weight"].n_bytes == 4 * 34
        assert by_name["blk.1.ffn_up.weight"].type_name == "Q4_K"
        assert f.tensor("absent") is None


def test_tensor_data_is_a_view_of_the_file(good):
    raw = good.read_bytes()
    with GGUFFile(good) as f:
        emb = f.tensor("token_embd.weight")
        data = emb.data
        assert data.dtype == np.uint8 and not data.flags.writeable and len(data) == emb.n_bytes
        assert np.array_equal(data.view(np.float32), np.arange(256, dtype=np.float32))
        start = raw.index(np.arange(256, dtype=np.float32).tobytes())
        assert start >= f.data_offset and start % 32 == 0
        # Dequantized: numpy order (rows, row length).
        assert np.array_equal(emb.dequantize(), np.arange(256, dtype=np.float32).reshape(8, 32))
        assert np.array_equal(f.tensor("output_norm.weight").dequantize(), np.ones(32, np.float32))
        assert not f.tensor("blk.1.ffn_up.weight").dequantize().any()  # zero Q4_K blocks
    with pytest.raises(ModelFormatError, match="closed"):
        emb.data
    with pytest.raises(ModelFormatError, match="closed"):
        f.get("general.name")
    f.close()  # twice is fine


def test_model_info(good):
    info = model_info(good)
    assert info.architecture == "llama" and info.name == "tiny-test"
    assert info.n_params == 32 * 8 + 32 + 4 * 32 + 2 * 256
    assert info.n_tensors == 4
    assert info.tensor_types == {"F32": 1, "F16": 1, "Q8_0": 1, "Q4_K": 1}
    assert info.file_type == "Q8_0"
    assert info.vocab_size == N_TOKENS
    assert (info.context_length, info.embedding_length, info.n_layers) == (256, 32, 2)
    assert (info.n_heads, info.n_kv_heads) == (4, 2)
    assert info.has_chat_template and info.chat_template == TEMPLATE
    assert (info.bos_token_id, info.eos_token_id) == (1, 2)
    d = json.loads(json.dumps(info.to_dict()))
    assert d["path"] == str(good) and d["has_chat_template"] is True
    assert d["file_size"] == good.stat().st_size


def test_custom_alignment(tmp_path):
    path = write_gguf(tmp_path / "a64.gguf", alignment=lambda w: setattr(w, "data_alignment", 64)
                      or w.add_uint32("general.alignment", 64))
    with GGUFFile(path) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0


def test_an_alignment_beyond_a_mebibyte_is_refused(tmp_path):
    path = write_gguf(tmp_path / "huge.gguf", alignment=lambda w: setattr(w, "data_alignment", 1 << 21)
                      or w.add_uint32("general.alignment", 1 << 21))
    with pytest.raises(ModelFormatError, match="general.alignment 2097152 is above 1048576"):
        GGUFFile(path)


def test_version_2_reads_as_version_3(corrupt):
    """GGUF v2 has v3's layout (v3 only added big-endian files)."""
    with GGUFFile(corrupt(lambda d: put(d, 4, "<I", 2))) as f:
        assert f.version == 2 and f.get("general.name") == "tiny-test"


def test_large_vocabulary_parses_quickly(tmp_path):
    path = write_gguf(tmp_path / "big_vocab.gguf", n_tokens=50_000)
    start = time.perf_counter()
    info = model_info(path)
    elapsed = time.perf_counter() - start
    assert info.vocab_size == 50_000
    assert elapsed < 1.0, f"parsing took {elapsed:.2f}s"


def test_string_arrays_read_whole_as_each_entry_then_nul(tmp_path):
    texts = ["", "a", "\u0120the", "日本", "emoji 🙂", "x" * 300]
    path = write_gguf(tmp_path / "m.gguf", extra=None)
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_array("test.texts", texts)
    w.add_array("test.ints", [1, 2])
    w.add_array("test.empty", [])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with GGUFFile(tmp_path / "s.gguf") as f:
        assert f.strings_nul_joined("test.texts") == b"".join(t.encode() + b"\0" for t in texts)
        assert f.strings_nul_joined("test.ints") is None
        assert f.strings_nul_joined("test.absent") is None
    with GGUFFile(path) as f:
        tokens = f.get("tokenizer.ggml.tokens")
        assert f.strings_nul_joined("tokenizer.ggml.tokens") == b"".join(t.encode() + b"\0" for t in tokens)


def test_type_tables_match_gguf_py():
    """The C reader's ggml type table and value type ids are gguf-py's."""
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if qtype.name == "Q8_1":
            size = 36  # ggml's block_q8_1 holds two halves d, s; gguf-py still counts two floats
        info = lib.es_type_info(qtype.value)
        assert info != ffi.NULL, qtype
        assert (ffi.string(info.name).decode(), info.block, info.block_bytes) == (qtype.name, block, size)
    assert lib.es_type_info(4) == ffi.NULL and lib.es_type_info(10_000) == ffi.NULL
    for vtype in gguf.GGUFValueType:
        short = vtype.name.replace("UINT", "U").replace("INT", "I").replace("FLOAT", "F")
        assert getattr(lib, f"ES_GGUF_{short}") == vtype.value


# ---------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf: no such file"):
        check_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    assert "not a regular file" in format_error(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"GGUF"])
def test_tiny_files(tmp_path, content):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(content)
    assert "truncated" in format_error(path)


def test_bad_magic(corrupt):
    def edit(d):
        d[0:4] = b"GGML"
    assert "bad magic" in format_error(corrupt(edit, "x.bin"))


@pytest.mark.parametrize("version", [1, 4, 7])
def test_unsupported_version(corrupt, version):
    assert f"unsupported GGUF version {version} (supported: 2, 3)" in format_error(
        corrupt(lambda d: put(d, 4, "<I", version)))


@pytest.mark.parametrize("version", [2, 3])
def test_big_endian_is_named(corrupt, version):
    assert "big-endian" in format_error(corrupt(lambda d: put(d, 4, ">I", version)))


def test_truncated_everywhere(good, tmp_path):
    data = good.read_bytes()
    with GGUFFile(good) as f:
        data_offset = f.data_offset
    cuts = {*range(0, 80), *range(80, len(data), 97), data_offset, len(data) - 1}
    for cut in sorted(cuts):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        message = format_error(path)
        assert any(s in message for s in ("truncated", "past the end of the file",
                                          "fit in the file")), message


def test_truncated_tensor_data_names_the_tensor(good, tmp_path):
    data = good.read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(data[:-200])
    message = format_error(path)
    assert "tensor blk.1.ffn_up.weight: data ends at byte" in message
    assert f"past the end of the file ({len(data) - 200} bytes): truncated" in message


def test_huge_tensor_count(corrupt):
    assert "tensors cannot fit" in format_error(corrupt(lambda d: put(d, 8, "<Q", 2**63)))


def test_huge_metadata_count(corrupt):
    assert "keys cannot fit" in format_error(corrupt(lambda d: put(d, 16, "<Q", 2**40)))


def test_huge_string_length(corrupt):
    # The first metadata key's length is the u64 right after the 24-byte header.
    assert "string of 4611686018427387904 bytes" in format_error(corrupt(lambda d: put(d, 24, "<Q", 2**62)))


def test_huge_array_length(corrupt):
    key = b"tokenizer.ggml.token_type"
    def edit(d):
        # key, then u32 ARRAY, u32 element type, u64 length
        put(d, d.index(key) + len(key) + 8, "<Q", 2**61)
    assert "array of 2305843009213693952 i32 values" in format_error(corrupt(edit))


def test_huge_string_inside_vocabulary(corrupt):
    def edit(d):
        put(d, d.index(b"tok150") - 8, "<Q", 2**50)
    assert "an array string: string of 1125899906842624 bytes" in format_error(corrupt(edit))


def test_unknown_value_type(corrupt):
    key = b"general.architecture"
    assert "key general.architecture: unknown value type 13" in format_error(
        corrupt(lambda d: put(d, d.index(key) + len(key), "<I", 13)))


def test_duplicate_key(tmp_path):
    path = write_gguf(tmp_path / "dup.gguf", extra={"test.dup1": "a", "test.dup2": "b"})
    data = bytearray(path.read_bytes())
    i = data.index(b"test.dup2")
    data[i:i + 9] = b"test.dup1"
    path.write_bytes(bytes(data))
    assert "key test.dup1 appears twice" in format_error(path)


@pytest.mark.parametrize("code", [4, 31, 99, 2**31])
def test_bad_tensor_type(corrupt, code):
    def edit(d):
        put(d, tensor_fields(d, "output_norm.weight")["type"], "<I", code)
    assert f"tensor output_norm.weight: unknown type id {code}" in format_error(corrupt(edit))


def test_tensor_offset_past_end(corrupt):
    def edit(d):
        put(d, tensor_fields(d, "blk.1.ffn_up.weight")["offset"], "<Q", 2**40)
    message = format_error(corrupt(edit))
    assert "tensor blk.1.ffn_up.weight: data at offset 1099511627776" in message
    assert "past the end of the file" in message


def test_overlapping_tensors(corrupt):
    def edit(d):
        put(d, tensor_fields(d, "output_norm.weight")["offset"], "<Q", 0)
    assert "tensors token_embd.weight [0, 1024) and output_norm.weight [0, 64) overlap" in format_error(corrupt(edit))


def test_tensor_offset_not_aligned(corrupt):
    def edit(d):
        put(d, tensor_fields(d, "output_norm.weight")["offset"], "<Q", 1040)
    assert "offset 1040 is not a multiple of the alignment 32" in format_error(corrupt(edit))


def test_too_many_dims(corrupt):
    def edit(d):
        put(d, tensor_fields(d, "output_norm.weight")["n_dims"], "<I", 5)
    assert "5 dimensions" in format_error(corrupt(edit))


def test_element_count_overflow(corrupt):
    def edit(d):
        dims = tensor_fields(d, "token_embd.weight")["dims"]
        put(d, dims, "<Q", 2**40)
        put(d, dims + 8, "<Q", 2**40)
    assert "dimension 1 of 1099511627776 elements is empty or overflows" in format_error(corrupt(edit))


def test_row_not_a_multiple_of_the_block(corrupt):
    def edit(d):
        put(d, tensor_fields(d, "blk.0.attn_q.weight")["dims"], "<Q", 16)
    assert "rows of 16 elements are not whole Q8_0 blocks of 32" in format_error(corrupt(edit))


def test_tensor_name_too_long(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "llama")
    w.add_tensor("x" * 64, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "64 bytes, not 1..63 bytes" in format_error(tmp_path / "long.gguf")


def test_alignment_must_be_a_uint32_power_of_two(tmp_path):
    bad_value = write_gguf(tmp_path / "a3.gguf", alignment=lambda w: w.add_uint32("general.alignment", 3))
    assert "general.alignment 3 is not a power of two" in format_error(bad_value)
    bad_type = write_gguf(tmp_path / "a64.gguf", alignment=lambda w: w.add_uint64("general.alignment", 32))
    assert "general.alignment is a u64, not a u32" in format_error(bad_type)


def test_control_characters_in_names_stay_on_one_line(corrupt):
    def edit(d):
        i = d.index(b"output_norm.weight")
        d[i + 6] = ord("\n")
        put(d, tensor_fields(d, "output\nnorm.weight")["type"], "<I", 99)
    assert "tensor output?norm.weight: unknown type id 99" in format_error(corrupt(edit))


def test_random_corruption_never_escapes_as_another_exception(good, tmp_path):
    data = good.read_bytes()
    with GGUFFile(good) as f:
        header_end = f.data_offset
    rng = random.Random(1234)
    path = tmp_path / "fuzz.gguf"
    for _ in range(300):
        d = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(header_end)
            d[pos] = rng.randrange(256)
        path.write_bytes(bytes(d))
        try:
            with GGUFFile(path) as f:
                for key in f.keys():  # every value reads back
                    f.get(key)
        except ModelFormatError as e:
            assert "\n" not in str(e)
