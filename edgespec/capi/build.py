"""cffi out-of-line API build of the C core (csrc/) as ``edgespec.capi._lib``
(``pip install -e .``, or ``python setup.py build_ext --inplace`` after a C change).

The cdef is the public headers themselves (the shared base, then the
speculative core and the inference engine), less the preprocessor lines, so
the Python view of the ABI cannot drift from them.

The x86 kernel sets' files take their instruction-set flags (ISA_FLAGS,
the same as CMakeLists.txt's) through setup.py's build_ext, which adds them
to those files' compile lines alone: the library runs on any x86-64 and
picks a set at run time.
"""
import pathlib
import platform
import re

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
HEADERS = ("es_base.h", "speculative/es_spec.h", "native/es_native.h")
# The version lives in edgespec/__init__.py; the C library reports it (es_version).
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "edgespec" / "__init__.py").read_text(), re.M).group(1)
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# Extra compiler flags per source file (paths relative to the repository root).
ISA_FLAGS = {
    "csrc/native/kernels/avx2.c": _AVX2,
    "csrc/native/kernels/avx512.c": [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
} if platform.machine().lower() in ("x86_64", "amd64") else {}
SOURCES = sorted(str(p.relative_to(ROOT)) for p in
                 [CSRC / "base.c", *CSRC.glob("speculative/**/*.c"), *CSRC.glob("native/**/*.c")])


def public_cdef() -> str:
    keep = []
    for header in HEADERS:
        text = (CSRC / header).read_text()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # block comments
        text = re.sub(r"//[^\n]*", "", text)                # line comments
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
    "edgespec.capi._lib",
    "".join(f'#include "{h}"\n' for h in HEADERS),
    sources=SOURCES,
    include_dirs=[str(CSRC.relative_to(ROOT))],
    # -g1 (line tables, no variable locations) after Python's own -g: full
    # debug info doubled the install's longest compile (the AVX2 tile kernels,
    # 64 s against 33 s on a Zen 4 core) and changes no generated code.
    extra_compile_args=["-O3", "-g1", "-std=gnu11", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],  # the native engine's thread pool; older glibc needs it
    libraries=["m"],
    define_macros=[("ES_VERSION", f'"{VERSION}"')],
)
