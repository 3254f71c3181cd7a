"""cffi out-of-line API build of the C core (csrc/) as ``edgespec._core``.

The cdef is the public header itself, less the preprocessor lines, so the
Python view of the ABI cannot drift from csrc/edgespec.h.
"""
import pathlib
import re

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
SOURCES = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.c"))


def public_cdef() -> str:
    text = (CSRC / "edgespec.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # block comments
    text = re.sub(r"//[^\n]*", "", text)                # line comments
    keep = []
    skip = 0
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#ifdef __cplusplus"):
            skip = 1
            continue
        if skip:
            if s.startswith("#endif"):
                skip = 0
            continue
        if s.startswith("#") or s in {"}", 'extern "C" {'}:
            continue
        keep.append(line)
    return "\n".join(keep)


ffibuilder = FFI()
ffibuilder.cdef(public_cdef())
ffibuilder.set_source(
    "edgespec._core",
    '#include "edgespec.h"',
    sources=SOURCES,
    include_dirs=[str(CSRC.relative_to(ROOT))],
    extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],  # the native engine's thread pool; older glibc needs it
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
