"""Models: the built-in registry and cache (``registry``, ``manifest.json``) and
reading and validating GGUF files (``gguf``, ``validate``)."""
