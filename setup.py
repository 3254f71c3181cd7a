"""Build glue: the C core compiles into the cffi extension ``edgespec._core``.

Metadata lives in pyproject.toml. The top-level ``models/`` folder (the
built-in model manifest) is installed as the subpackage ``edgespec.models``;
``edgespec.bench`` carries its prompt suites and results schema as data.
"""
from setuptools import setup

setup(
    packages=["edgespec", "edgespec.backends", "edgespec.bench", "edgespec.drafters", "edgespec.models"],
    package_dir={"edgespec.models": "models"},
    package_data={"edgespec.models": ["*.json"],
                  "edgespec.bench": ["results.schema.json", "suites/*.jsonl", "suites/SOURCES.txt"]},
    cffi_modules=["edgespec/_build_core.py:ffibuilder"],
    zip_safe=False,
)
