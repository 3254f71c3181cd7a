"""Build glue: the C core compiles into the cffi extension ``edgespec.capi._lib``.

Metadata lives in pyproject.toml. ``edgespec.models`` carries the built-in
model manifest and the shipped specialized drafters (``drafters/<target>/*.gguf``),
``edgespec.bench`` its prompt suites and results schema and
``edgespec.server`` its chat page as package data.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["edgespec", "edgespec.*"]),
    package_data={"edgespec.models": ["*.json", "drafters/*/*.gguf"], "edgespec.server": ["page/*"],
                  "edgespec.bench": ["results.schema.json", "suites/*.jsonl", "suites/SOURCES.txt"]},
    cffi_modules=["edgespec/capi/build.py:ffibuilder"],
    zip_safe=False,
)
