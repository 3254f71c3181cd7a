"""Models: the built-in registry and cache (``registry``, ``manifest.json``) and
reading GGUF files (``gguf``)."""
