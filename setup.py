"""Build glue: the C core compiles into the cffi extension ``edgespec.capi._lib``.

Metadata lives in pyproject.toml. The top-level ``models/`` folder (the
built-in model manifest and the shipped specialized drafters,
``drafters/<target>/*.gguf``) is packaged as ``edgespec.builtin``;
``edgespec.bench`` carries its prompt suites and results schema and
``edgespec.server`` its chat page as package data.
"""
from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["edgespec", "edgespec.*"]), "edgespec.builtin"],
    package_dir={"edgespec.builtin": "models"},
    package_data={"edgespec.builtin": ["*.json", "drafters/*.md", "drafters/*/*.gguf"], "edgespec.server": ["page/*"],
                  "edgespec.bench": ["results.schema.json", "suites/*.jsonl", "suites/SOURCES.txt"]},
    cffi_modules=["edgespec/capi/build.py:ffibuilder"],
    zip_safe=False,
)
