"""Raw layer over the C core: ``ffi``/``lib`` from the cffi extension, and the
helpers that turn a C status code into a typed exception."""
from __future__ import annotations

import os

from ._lib import ffi, lib  # noqa: F401  (re-exported for the wrappers)
from ..errors import (InvalidArgumentError, ModelFormatError, ModelNotFoundError, NativeError, NativeInvalidArgument,
                      NativeOutOfMemory, UnsupportedModelError)

_BY_STATUS = {
    lib.ES_ERR_INVALID_ARG: NativeInvalidArgument,
    lib.ES_ERR_NO_MEMORY: NativeOutOfMemory,
}


def check(status: int, where: str) -> int:
    """Return ``status`` when it is ES_OK (or a non-negative count); raise otherwise."""
    if status >= 0:
        return status
    text = ffi.string(lib.es_status_str(status)).decode()
    raise _BY_STATUS.get(status, NativeError)(status, where, text)


def kernel_set() -> str:
    """The name of the kernel set the native engine runs in this process
    (es_kernels_name: "avx512", "avx2", "neon" or "scalar")."""
    return ffi.string(lib.es_kernels_name()).decode()


ERR_CAP = 512  # bytes of the err buffers handed to es_gguf_open / es_model_load


def check_file(status: int, err, path: os.PathLike | str, where: str) -> None:
    """The status and one-line ``err`` text of a C call that opened the model
    file ``path`` (es_gguf_open, es_model_load) as a typed exception naming
    the file: ModelNotFoundError when it does not exist, UnsupportedModelError
    for what this build cannot run, ModelFormatError for a damaged or
    unreadable file, NativeOutOfMemory with the reason (the sizes) where one
    was given."""
    if status == lib.ES_OK:
        return
    if status == lib.ES_ERR_IO and not os.path.lexists(path):
        raise ModelNotFoundError(f"{path}: no such file")
    reason = ffi.string(err).decode("utf-8", "replace") or ffi.string(lib.es_status_str(status)).decode()
    if status == lib.ES_ERR_UNSUPPORTED:
        raise UnsupportedModelError(f"{path}: {reason}")
    if status in (lib.ES_ERR_FORMAT, lib.ES_ERR_IO):
        raise ModelFormatError(f"{path}: {reason}")
    if status == lib.ES_ERR_INVALID_ARG and err[0] != b"\0":
        raise InvalidArgumentError(f"{path}: {reason}")
    if status == lib.ES_ERR_NO_MEMORY and err[0] != b"\0":
        raise NativeOutOfMemory(status, where, f"{path}: {reason}")
    check(status, where)


class Closing:
    """Calls ``close()`` (which must be safe to call twice) when a ``with``
    block ends and when the object is collected."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


class Owned(Closing):
    """Base of the owning wrappers: holds one C object in ``_ptr`` and frees it
    exactly once with the class's ``_free``."""

    _ptr = None   # set by the subclass once its es_*_init succeeded
    _free = None  # the lib function that frees _ptr

    @property
    def handle(self):
        """The C object, for another wrapper's calls that take it (its owner
        keeps it alive; None once closed)."""
        return self._ptr

    def close(self) -> None:
        if self._ptr is not None:
            type(self)._free(self._ptr)
            self._ptr = None
