"""Built-in model manifest (manifest.json), installed as ``edgespec.models``."""
