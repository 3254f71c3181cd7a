"""edgespec: on-device LLM generation made faster by lossless speculative decoding.

    import edgespec
    with edgespec.Engine("smollm2-135m") as engine:
        print(engine.generate("The capital of France is", max_tokens=16).text)
"""
from .errors import (  # noqa: F401
    BackendError,
    CacheError,
    ContextOverflowError,
    DrafterError,
    EdgespecError,
    EngineBusyError,
    EngineClosedError,
    ExtraNotInstalledError,
    GenerationAbandonedError,
    GrammarError,
    IncompatibleDraftModelError,
    InvalidArgumentError,
    ModelFetchError,
    ModelFormatError,
    ModelNotFoundError,
    NativeError,
    UnsupportedModelError,
)

__version__ = "0.2.0"

# The engine pulls in llama.cpp and the compiled C core; import it on first use
# so that `edgespec models ...` and the registry stay light.
_LAZY = {"Engine": "engine", "EngineConfig": "config", "Result": "results", "GenerationStats": "results",
         "SamplingParams": "sampling", "Grammar": "grammar",
         # Making specialized drafters: distill_model(model, out, DistillParams(...)), train_model(model, data, out, TrainParams(...)).
         "DistillParams": "training.distill", "distill_model": "training.distill",
         "TrainParams": "training.train", "train_model": "training.train"}


_ERRORS = ["BackendError", "CacheError", "ContextOverflowError", "DrafterError", "EdgespecError", "EngineBusyError",
           "EngineClosedError", "ExtraNotInstalledError", "GenerationAbandonedError", "GrammarError", "IncompatibleDraftModelError",
           "InvalidArgumentError", "ModelFetchError", "ModelFormatError", "ModelNotFoundError", "NativeError",
           "UnsupportedModelError"]
__all__ = ["__version__", *_ERRORS, *_LAZY]


def __dir__():
    """The lazy names too, so that IDEs and ``dir(edgespec)`` complete them."""
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
