"""Token bytes to streamed text: never splits a UTF-8 character, and holds
back text that may turn out to be the start of a stop string."""
from __future__ import annotations

import codecs
from typing import Sequence

from .errors import InvalidArgumentError


def utf8_text(text: str, what: str) -> str:
    """``text``, or InvalidArgumentError when it cannot be encoded as UTF-8:
    bytes that did not decode (command-line arguments and piped input arrive
    with them as lone surrogates, Python's surrogateescape) are named by value
    and byte offset, e.g. "prompt is not valid UTF-8 (byte 0xff at offset 3)"."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        if 0xDC80 <= bad <= 0xDCFF:  # surrogateescape's stand-in for the byte bad - 0xDC00
            where = f"byte 0x{bad - 0xDC00:02x} at offset {len(text[:e.start].encode('utf-8'))}"
        else:
            where = f"lone surrogate U+{bad:04X} at character {e.start}"
        raise InvalidArgumentError(f"{what} is not valid UTF-8 ({where})") from None


def complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n if back == 1 else n - back + 1
        if b >= 0xC0:  # a lead byte: is its character complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n


class TextStream:
    """Feed token pieces (bytes) in; get out text that is safe to show.

    ``stopped`` turns true when a stop string appears; the text before it is
    everything that will ever be emitted.
    """

    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""       # decoded text not yet emitted
        self.text = ""        # everything emitted so far
        self.stopped = False
        self.matched: str | None = None   # the stop string that stopped it

    def push(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what is held (an incomplete character becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        cut = min((i for i in (held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.matched = next(s for s in self._stop if held.find(s) == cut)
            out, self._held = held[:cut], ""
        elif final or not self._stop:
            out, self._held = held, ""
        else:
            keep = self._partial_stop_len(held)
            out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        self.text += out
        return out

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
