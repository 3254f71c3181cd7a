"""Raw layer over the C core: ``ffi``/``lib`` from the cffi extension, and the
one helper that turns a C status code into a typed exception."""
from __future__ import annotations

from ._lib import ffi, lib  # noqa: F401  (re-exported for the wrappers)
from ..errors import NativeError, NativeInvalidArgument, NativeOutOfMemory

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

    def close(self) -> None:
        if self._ptr is not None:
            type(self)._free(self._ptr)
            self._ptr = None
