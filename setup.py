"""Build glue: the C core compiles into the cffi extension ``edgespec._core``.

Metadata lives in pyproject.toml. The top-level ``models/`` folder (the
built-in model manifest) is installed as the subpackage ``edgespec.models``.
"""
from setuptools import setup

setup(
    packages=["edgespec", "edgespec.backends", "edgespec.drafters", "edgespec.models"],
    package_dir={"edgespec.models": "models"},
    package_data={"edgespec.models": ["*.json"]},
    cffi_modules=["edgespec/_build_core.py:ffibuilder"],
    zip_safe=False,
)
