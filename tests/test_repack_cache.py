"""The native engine's repacked weights kept in the cache between loads
(es_model_params.repack_cache): the first load writes them, later loads map
them, and the logits are bit-identical to repacking in memory and to no
repacking at all; a file written for another model or layout, cut short or
damaged is never used but written again; a cache that cannot be written
costs nothing but the repack."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner

from edgespec.backends import open_backend
from edgespec.capi import ffi, lib
from edgespec.cli import app as cli_app
from edgespec.cli import models as _models_commands  # noqa: F401  (registers `models prune`)
from edgespec.models import registry
from tiny_gguf import write_tiny_qwen2

TEXT = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGESPEC_REPACK", raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory, tiny_vocab_path):
    path = tmp_path_factory.mktemp("repack") / "qwen2-q4k.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, dtype=Q.Q4_K)
    return path


def run(path, repack: str | None = None):
    """(where the repacked weights came from, the logits of TEXT in batches of 4)."""
    if repack is not None:
        os.environ["EDGESPEC_REPACK"] = repack
    try:
        with open_backend("native", path, n_ctx=64, threads=2) as b:
            tokens = b.tokenize(TEXT)[:16]
            rows = []
            for i in range(0, len(tokens), 4):
                addr = b.decode(tokens[i:i + 4], logits_from=0)
                n = len(tokens[i:i + 4])
                rows.append(np.ctypeslib.as_array((ctypes.c_float * (n * b.n_vocab)).from_address(addr))
                            .reshape(n, b.n_vocab).copy())
            return b.packed_from, np.concatenate(rows)
    finally:
        os.environ.pop("EDGESPEC_REPACK", None)


def packs(home) -> list:
    return sorted((home / registry.REPACKED_DIR).glob("*.pack"))


def test_written_once_then_mapped_with_the_same_logits(home, q4k_model):
    written, first = run(q4k_model)
    assert written == lib.ES_PACKED_WRITTEN and len(packs(home)) == 1
    assert packs(home)[0].with_suffix(".source").read_bytes() == os.fsencode(q4k_model.resolve())
    mapped, again = run(q4k_model)
    assert mapped == lib.ES_PACKED_MAPPED
    in_memory, memory_logits = run(q4k_model, "memory")
    unpacked, plain = run(q4k_model, "0")
    assert (in_memory, unpacked) == (lib.ES_PACKED_REPACKED, lib.ES_PACKED_NONE)
    assert np.array_equal(first, again) and np.array_equal(first, memory_logits) and np.array_equal(first, plain)
    assert len(packs(home)) == 1


def resident_bytes(path) -> int:
    """Bytes of ``path``'s mappings in this process's resident memory (Linux)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
@pytest.mark.parametrize("repack", [None, "memory"])
def test_the_source_rows_a_repack_serves_leave_resident_memory(home, q4k_model, repack, monkeypatch):
    """The checks at open read every block's scales; the rows the repacked
    copy serves (mapped from the cache, or repacked in memory) are then
    released, leaving the few the engine still reads (embeddings, norms)."""
    run(q4k_model)  # the cache file written: the next load maps it
    path = q4k_model.resolve()
    if repack is not None:
        monkeypatch.setenv("EDGESPEC_REPACK", repack)
    with open_backend("native", path, n_ctx=64, threads=2) as b:
        assert b.packed_from == (lib.ES_PACKED_MAPPED if repack is None else lib.ES_PACKED_REPACKED)
        weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
                      if t.name.startswith("blk.") and "norm" not in t.name)
        assert weights > 0.5 * path.stat().st_size
        assert resident_bytes(path) < path.stat().st_size - 0.9 * weights, (resident_bytes(path), weights)


@pytest.mark.parametrize("damage", ["flip a weight byte", "cut short", "another model's file"])
def test_a_file_not_whole_or_not_this_models_is_written_again(home, q4k_model, tmp_path, tiny_vocab_path, damage):
    _, expected = run(q4k_model)
    pack = packs(home)[0]
    if damage == "flip a weight byte":
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0x40
        pack.write_bytes(bytes(data))
    elif damage == "cut short":
        with open(pack, "r+b") as f:
            f.truncate(pack.stat().st_size - 4096)
    else:   # the same shapes, other weights: the file of another model under this one's name
        other = tmp_path / "other.gguf"
        write_tiny_qwen2(other, tiny_vocab_path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                         dtype=Q.Q4_K, seed=7)
        run(other)
        theirs = next(p for p in packs(home) if p != pack)
        os.replace(theirs, pack)
    source, got = run(q4k_model)
    assert source == lib.ES_PACKED_WRITTEN
    assert np.array_equal(got, expected)
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED


def test_a_cache_that_cannot_be_written_only_costs_the_repack(home, q4k_model, monkeypatch):
    # A cache folder that is not there: no file can be made in it, whoever runs this.
    monkeypatch.setattr(registry, "repacked_cache", lambda model: (str(home / "gone" / "x-"), bytes(32)))
    source, got = run(q4k_model)
    assert source == lib.ES_PACKED_REPACKED
    assert np.array_equal(got, run(q4k_model, "0")[1])
    assert not (home / "gone").exists()


def test_a_folder_where_the_file_goes_is_left_alone(home, q4k_model):
    run(q4k_model)
    blocker = packs(home)[0]
    _remove_pack(blocker)
    (blocker / "x").mkdir(parents=True)
    source, got = run(q4k_model)
    assert source == lib.ES_PACKED_FOREIGN   # not a regular file: neither read nor replaced
    assert np.array_equal(got, run(q4k_model, "0")[1])
    assert sorted(p.name for p in (home / registry.REPACKED_DIR).iterdir()) == [registry.SECRET, blocker.name]


def _remove_pack(pack) -> None:
    pack.unlink()
    pack.with_suffix(".source").unlink()


def test_files_of_models_that_are_gone_or_unused_are_pruned(home, q4k_model, tmp_path, tiny_vocab_path):
    gone = tmp_path / "gone.gguf"
    write_tiny_qwen2(gone, tiny_vocab_path, n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, dtype=Q.Q4_K)
    run(gone)
    run(q4k_model)
    assert len(packs(home)) == 2
    gone.unlink()
    old = next(p for p in packs(home) if p.name.startswith("qwen2-q4k"))
    past = time.time() - registry.REPACKED_UNUSED_S - 60
    os.utime(old.with_suffix(".source"), (past, past))   # its last use (registry.repacked_used)
    part = home / registry.REPACKED_DIR / "x.pack.part-abcdef"
    part.write_bytes(b"half")
    os.utime(part, (past, past))
    registry.repacked_cache(q4k_model)
    assert packs(home) == [] and not part.exists()
    assert not list((home / registry.REPACKED_DIR).glob("*.source"))


def test_removing_a_model_removes_its_repacked_weights(home, q4k_model):
    run(q4k_model)
    assert packs(home)
    registry.remove_repacked(q4k_model)
    assert [p.name for p in (home / registry.REPACKED_DIR).iterdir()] == [registry.SECRET]


# ---- hardening: a stale, foreign or forged file is never used ------------------------------

def test_weights_changed_in_place_with_their_times_restored_are_repacked(home, tmp_path, tiny_vocab_path):
    """rsync --inplace -t: the same inode, size and times, other weights
    (between the sampled pages): the ctime, which no user sets, tells."""
    path = tmp_path / "inplace.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, dtype=Q.Q4_K)
    assert run(path)[0] == lib.ES_PACKED_WRITTEN
    st = path.stat()
    start = gguf.GGUFReader(path).data_offset
    gap = (st.st_size - start - 4096) // 15   # es__packed_source's 16 sampled pages are this far apart
    assert gap > 3 * 4096
    with open(path, "r+b") as f:   # a byte between the first two samples
        f.seek(start + 4096 + gap // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (st.st_size, st.st_mtime_ns,
                                                                                  st.st_ino)
    source, got = run(path)
    assert source == lib.ES_PACKED_WRITTEN
    assert np.array_equal(got, run(path, "memory")[1])


def put_foreign(pack, kind: str, tmp_path) -> None:
    """Puts what ``kind`` names at ``pack``'s path (the whole file elsewhere in
    tmp_path): "symlink", "fifo", "group-writable" or "another user's"."""
    if kind == "symlink":
        os.replace(pack, tmp_path / "elsewhere.pack")
        pack.symlink_to(tmp_path / "elsewhere.pack")
    elif kind == "fifo":
        pack.unlink()
        os.mkfifo(pack)
    elif kind == "group-writable":
        pack.chmod(0o664)
    else:   # another user's
        os.chown(pack, os.geteuid() + 1000, -1)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "group-writable",
                                  pytest.param("another user's", marks=pytest.mark.skipif(
                                      os.geteuid() != 0, reason="only root gives a file away"))])
def test_what_is_not_this_users_own_regular_file_is_left_alone(home, q4k_model, tmp_path, kind):
    """Neither read (a FIFO would block an open) nor replaced: the load
    repacks in memory and says why once, in one line. Run in a process of
    its own under a timeout, so that a load blocked on a FIFO fails the test
    and does not hang it."""
    _, expected = run(q4k_model)
    pack = packs(home)[0]
    put_foreign(pack, kind, tmp_path)
    before = pack.lstat()
    code = (f"import numpy, sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "from edgespec.cli import _show_notices\n"
            "from test_repack_cache import run\n"
            "_show_notices()\n"
            f"for _ in range(2): source, logits = run({str(q4k_model)!r}); print(source)\n"
            f"numpy.save({str(tmp_path / 'logits.npy')!r}, logits)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EDGESPEC_HOME": str(home)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(lib.ES_PACKED_FOREIGN)] * 2
    notices = [line for line in done.stderr.splitlines() if str(pack) in line]
    assert len(notices) == 1 and "repacked in memory" in notices[0], done.stderr
    assert np.array_equal(np.load(tmp_path / "logits.npy"), expected)
    after = pack.lstat()
    assert (after.st_mode, after.st_ino, after.st_uid) == (before.st_mode, before.st_ino, before.st_uid)


# The digest of packed_file.c, mirrored: 16 multiply-xor lanes over the
# weights' 32-bit words, then SipHash-2-4 over the lanes and the length.
M64 = (1 << 64) - 1
LANES = 16


def _lanes(words: np.ndarray, seeds: list[int]) -> list[int]:
    """The lanes' end values as 64-bit words: word i goes to lane i % LANES."""
    h = np.array(seeds, dtype=np.uint32)
    whole = len(words) // LANES * LANES
    tail = np.zeros(LANES, dtype=np.uint32)
    tail[:len(words) - whole] = words[whole:]
    with np.errstate(over="ignore"):
        for row, lanes in [*((r, LANES) for r in words[:whole].reshape(-1, LANES)), (tail, len(words) - whole)]:
            h[:lanes] = (h[:lanes] ^ row[:lanes]) * np.uint32(0x85ebca6b)
            h[:lanes] ^= h[:lanes] >> np.uint32(15)
    return np.frombuffer(h.tobytes(), dtype="<u8").tolist()


def _siphash(k0: int, k1: int, words: list[int]) -> int:
    v = [k0 ^ 0x736f6d6570736575, k1 ^ 0x646f72616e646f6d, k0 ^ 0x6c7967656e657261, k1 ^ 0x7465646279746573]

    def rotl(x, b):
        return ((x << b) | (x >> (64 - b))) & M64

    def rounds(n):
        for _ in range(n):
            v[0] = (v[0] + v[1]) & M64; v[1] = rotl(v[1], 13) ^ v[0]; v[0] = rotl(v[0], 32)  # noqa: E702
            v[2] = (v[2] + v[3]) & M64; v[3] = rotl(v[3], 16) ^ v[2]                          # noqa: E702
            v[0] = (v[0] + v[3]) & M64; v[3] = rotl(v[3], 21) ^ v[0]                          # noqa: E702
            v[2] = (v[2] + v[1]) & M64; v[1] = rotl(v[1], 17) ^ v[2]; v[2] = rotl(v[2], 32)  # noqa: E702

    for w in [*words, ((len(words) * 8) & 0xff) << 56]:
        v[3] ^= w
        rounds(2)
        v[0] ^= w
    v[2] ^= 0xff
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def keyed_digest(secret: bytes, weights: bytes) -> int:
    k = np.frombuffer(secret, dtype="<u8").tolist()
    seed = np.frombuffer(secret[16:], dtype="<u4").tolist()
    seeds = [seed[i % 4] ^ ((0x9e3779b9 * (i + 1)) & 0xffffffff) for i in range(LANES)]
    return _siphash(k[0], k[1], [*_lanes(np.frombuffer(weights, dtype="<u4"), seeds), len(weights)])


def plain_digest(weights: bytes) -> int:
    """A digest anyone can compute (the lanes from fixed seeds, FNV-1a over
    them), as packs had before theirs was keyed."""
    lanes = _lanes(np.frombuffer(weights, dtype="<u4"), [(0x9e3779b9 * (i + 1)) & 0xffffffff for i in range(LANES)])
    h = len(weights)
    for byte in np.array(lanes, dtype="<u8").tobytes():
        h = ((h ^ byte) * 0x100000001b3) & M64
    return h


HEADER = 4096   # packed_file.c's HEADER_BYTES; the digest is the u64 after the magic (8) and the key (24)


@pytest.mark.parametrize("forger", ["the cache's secret", "no secret (the plain digest)", "another secret"])
def test_altered_weights_need_the_caches_secret_for_their_digest(home, q4k_model, forger):
    """Only a digest keyed with the cache's secret makes altered weights
    load; one recomputed without it (the plain digest anyone can compute,
    or another key) is refused and the file written again."""
    _, expected = run(q4k_model)
    pack = packs(home)[0]
    data = bytearray(pack.read_bytes())
    data[HEADER + 100] ^= 0x01   # a weight's bit
    weights = bytes(data[HEADER:])
    secret = (home / registry.REPACKED_DIR / registry.SECRET).read_bytes()
    digest = {"the cache's secret": lambda: keyed_digest(secret, weights),
              "no secret (the plain digest)": lambda: plain_digest(weights),
              "another secret": lambda: keyed_digest(bytes(32), weights)}[forger]()
    data[32:40] = digest.to_bytes(8, "little")
    pack.write_bytes(bytes(data))
    source, got = run(q4k_model)
    if forger == "the cache's secret":   # the mirror computes the engine's digest: the test can fail
        assert source == lib.ES_PACKED_MAPPED
    else:
        assert source == lib.ES_PACKED_WRITTEN and np.array_equal(got, expected)


def test_a_verified_pack_is_stamped_and_any_write_to_it_voids_the_stamp(home, q4k_model):
    """The first load that maps a pack checks its whole digest and stamps it
    (later loads read only its header); weights changed in place after that,
    their times set back, change the ctime the stamp holds: the digest is
    checked again and the pack refused."""
    _, expected = run(q4k_model)
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED
    pack = packs(home)[0]
    stamp = pack.parent / (pack.name + ".ok")
    assert stamp.stat().st_size == 8
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED   # through the stamp
    st = pack.stat()
    data = bytearray(pack.read_bytes())
    data[HEADER + 100] ^= 0x01
    with open(pack, "r+b") as f:   # in place: the same inode
        f.write(data)
    os.utime(pack, ns=(st.st_atime_ns, st.st_mtime_ns))
    source, got = run(q4k_model)
    assert source == lib.ES_PACKED_WRITTEN and np.array_equal(got, expected)
    registry.prune_repacked(max_bytes=0)
    assert not list(pack.parent.glob("*.ok"))   # a stamp goes with its pack


def test_a_secret_that_others_may_read_is_replaced(home, q4k_model):
    run(q4k_model)
    secret = home / registry.REPACKED_DIR / registry.SECRET
    assert secret.stat().st_mode & 0o777 == 0o600
    old = secret.read_bytes()
    secret.chmod(0o644)
    assert run(q4k_model)[0] == lib.ES_PACKED_WRITTEN   # the files keyed with it go with it
    assert secret.read_bytes() != old and secret.stat().st_mode & 0o777 == 0o600
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED


def test_parts_whose_writer_is_gone_are_removed_at_the_next_load(home, q4k_model):
    run(q4k_model)
    folder = home / registry.REPACKED_DIR
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dead, alive = folder / f"x.pack.part-{gone}-abcdef", folder / f"y.pack.part-{os.getpid()}-abcdef"
    dead.write_bytes(b"half")
    alive.write_bytes(b"being written")
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED
    assert not dead.exists() and alive.exists()


@pytest.fixture(scope="module")
def three_models(tmp_path_factory, tiny_vocab_path):
    folder = tmp_path_factory.mktemp("lru")
    paths = [folder / f"m{i}.gguf" for i in range(3)]
    for i, path in enumerate(paths):
        write_tiny_qwen2(path, tiny_vocab_path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                         dtype=Q.Q4_K, seed=10 + i)
    return paths


def test_past_the_bound_the_least_recently_used_files_are_removed(home, three_models, monkeypatch):
    first, second, third = three_models
    run(first)
    run(second)
    size = packs(home)[0].stat().st_size
    monkeypatch.setenv("EDGESPEC_REPACK_MAX_GB", str(2.5 * size / (1 << 30)))   # room for two
    old = time.time() - 3600
    first_pack = next(p for p in packs(home) if p.name.startswith("m0-"))
    os.utime(first_pack.with_suffix(".source"), (old, old))   # its last use
    assert run(second)[0] == lib.ES_PACKED_MAPPED   # a use: m1's is the most recent
    assert run(third)[0] == lib.ES_PACKED_WRITTEN
    assert sorted(p.name[:2] for p in packs(home)) == ["m1", "m2"]
    assert not first_pack.with_suffix(".source").exists()


def test_models_prune_applies_the_bound_by_hand(home, three_models):
    for path in three_models:
        run(path)
    assert len(packs(home)) == 3
    done = CliRunner().invoke(cli_app, ["models", "prune", "--max-gb", "0"])
    assert done.exit_code == 0, done.output
    assert "freed" in done.output and packs(home) == []


def test_kernel_sets_that_lay_the_weights_out_alike_share_one_file(home, q4k_model, monkeypatch):
    """AVX2 and the scalar set repack Q4_K alike: one file, written by one
    and mapped by the other (the name carries the layout, not the set)."""
    available = [ffi.string(lib.es_kernels_available(i)).decode()
                 for i in range(8) if lib.es_kernels_available(i) != ffi.NULL]
    if "avx2" not in available:
        pytest.skip("needs a CPU with AVX2")
    monkeypatch.setenv("EDGESPEC_KERNELS", "avx2")
    assert run(q4k_model)[0] == lib.ES_PACKED_WRITTEN
    monkeypatch.setenv("EDGESPEC_KERNELS", "scalar")
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED
    assert len(packs(home)) == 1
