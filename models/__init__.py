"""The built-in models' manifest (``manifest.json``: names, PyPI parts,
sizes, sha256, paired draft models) and the shipped specialized drafters
(``drafters/<target>/*.gguf``), packaged as ``edgespec.builtin``: data only,
read through importlib.resources by edgespec.models.registry and
edgespec.drafters.routed."""
