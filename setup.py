"""Build glue: the C core compiles into the cffi extension ``edgespec.capi._lib``.

Metadata lives in pyproject.toml. The top-level ``models/`` folder (the
built-in model manifest and the shipped specialized drafters,
``drafters/<target>/*.gguf``) is packaged as ``edgespec.builtin``;
``edgespec.bench`` carries its prompt suites and results schema and
``edgespec.server`` its chat page as package data.
"""
import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ISA_FLAGS = runpy.run_path(str(Path(__file__).parent / "edgespec/capi/build.py"))["ISA_FLAGS"]


class BuildExt(build_ext):
    """build_ext adding ISA_FLAGS (edgespec/capi/build.py) to the compile
    line of the files they name: setuptools has one flag list per extension."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile

        def _compile(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            flags = ISA_FLAGS.get(Path(src).as_posix(), [])
            compile_one(obj, src, ext_, cc_args, [*extra_postargs, *flags], pp_opts)

        self.compiler._compile = _compile
        try:
            super().build_extension(ext)
        finally:
            del self.compiler._compile


setup(
    packages=[*find_packages(include=["edgespec", "edgespec.*"]), "edgespec.builtin"],
    package_dir={"edgespec.builtin": "models"},
    package_data={"edgespec.builtin": ["*.json", "drafters/*.md", "drafters/*/*.gguf", "token-ranks/*.npy"],
                  "edgespec.server": ["page/*"],
                  "edgespec.bench": ["results.schema.json", "suites/*.jsonl", "suites/SOURCES.txt"]},
    cffi_modules=["edgespec/capi/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
