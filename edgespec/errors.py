"""Typed exceptions. Every failure a user can cause maps to one of these; the
CLI turns them into a one-line message and exit code 2."""
from __future__ import annotations


class EdgespecError(Exception):
    """Base class of every error edgespec raises on purpose."""


class InvalidArgumentError(EdgespecError, ValueError):
    """A parameter is out of range or of the wrong kind (empty prompt, top_p > 1, ...)."""


class ModelNotFoundError(EdgespecError, LookupError):
    """An unknown built-in model name, or a path that does not exist."""


class ModelFormatError(EdgespecError):
    """A model file that is not a valid GGUF (truncated, corrupt, unsupported)."""


class UnsupportedModelError(ModelFormatError):
    """A valid model this backend cannot run (architecture, weight type, variant)."""


class ModelFetchError(EdgespecError):
    """A model could not be downloaded or failed its checksum."""


class CacheError(ModelFetchError):
    """The cache (EDGESPEC_HOME) could not be written: a full disk, a read-only
    folder. The message names the path and the cause. A ModelFetchError, as a
    model that cannot be stored cannot be fetched either."""


class ContextOverflowError(EdgespecError):
    """The prompt (plus what must be generated) does not fit the context window."""


class EngineClosedError(EdgespecError):
    """The engine (or backend) was used after ``close()``."""


class EngineBusyError(EdgespecError):
    """A non-blocking call found the engine running another generation."""


class BackendError(EdgespecError):
    """The inference backend (llama.cpp, native, onnxruntime) failed."""


class ExtraNotInstalledError(EdgespecError, ImportError):
    """A feature of an optional extra whose packages are not installed
    (the llama backend and llama.cpp peers: ``pip install 'edgespec[llama]'``)."""


class IncompatibleDraftModelError(InvalidArgumentError):
    """A draft model whose tokenizer differs from the target's."""


class DrafterError(EdgespecError):
    """A drafter's data cannot be used: an n-gram cache file that is missing,
    unreadable or fails its checks, a corpus that is not UTF-8 text."""


class NativeError(EdgespecError):
    """The C core returned an error status."""

    def __init__(self, status: int, where: str, text: str):
        super().__init__(f"{where}: {text} (status {status})")
        self.status = status
        self.where = where


class NativeInvalidArgument(NativeError, InvalidArgumentError):
    pass


class NativeOutOfMemory(NativeError, MemoryError):
    pass


class GrammarError(InvalidArgumentError):
    """A JSON schema or grammar the grammar engine cannot compile; the message
    names the construct (an unsupported keyword, an unknown rule, a bad regex)."""


class GenerationAbandonedError(EdgespecError):
    """A stream resumed after the engine ended it: its thread left it suspended
    and started another generation (the cache no longer holds its text)."""


def check_whole(name: str, value, minimum: int) -> int:
    """``value`` if it is a whole number (not a bool) >= ``minimum``, else
    InvalidArgumentError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be a whole number >= {minimum}, got {value!r}"[:200])
    return value
