"""One validation pass over a GGUF file before any engine loads it.

The C reader opens the file and ``es_gguf_validate`` (csrc/native/validate.c)
checks what llama.cpp would otherwise assert on or misread: hyperparameters in
range, a vocabulary of unique tokens with consistent token types, scores,
merges and special ids, and every tensor of the architecture present with its
expected type and shape. A failure is one ModelFormatError line naming the
file and the key, tensor or token.
"""
from __future__ import annotations

import os

from ..capi import check, ffi, lib
from ..errors import ModelFormatError, UnsupportedModelError

_ERR_CAP = 512


def validate_gguf(path: str | os.PathLike) -> None:
    """Raise ModelFormatError (UnsupportedModelError for a tensor type the
    reader does not know) unless `path` is a GGUF file both engines can read."""
    out = ffi.new("es_gguf **")
    err = ffi.new("char[]", _ERR_CAP)
    status = lib.es_gguf_open(os.fsencode(path), out, err, _ERR_CAP)
    if status == lib.ES_OK:
        try:
            status = lib.es_gguf_validate(out[0], err, _ERR_CAP)
        finally:
            lib.es_gguf_close(out[0])
    if status in (lib.ES_ERR_FORMAT, lib.ES_ERR_IO, lib.ES_ERR_UNSUPPORTED):
        reason = ffi.string(err).decode("utf-8", "replace")
        error = UnsupportedModelError if status == lib.ES_ERR_UNSUPPORTED else ModelFormatError
        raise error(f"{path}: {reason}")
    check(status, f"validating {path}")
