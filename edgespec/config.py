"""How an Engine opens: every engine option, declared once.

``EngineConfig`` is the one place an option lives. Each field carries its
command-line flag, help and range (``option(...)`` metadata); the config is
validated once, when it is made (``EngineConfig(**options)`` or
``dataclasses.replace``), with InvalidArgumentError naming the option. The
CLI's engine options (edgespec.cli.options), the benchmark's configurations,
the server's EnginePool and the drafters' DrafterConfig are derived from it.
Defaults the C engine owns are read from its ``*_default_params()``.

    config = EngineConfig(model="qwen2.5-coder-1.5b", drafter="auto", threads=2)
    with Engine(config=config) as engine: ...
    Engine("qwen2.5-coder-1.5b", drafter="auto", threads=2)    # the same
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .capi import ffi, lib
from .errors import InvalidArgumentError
from .moe import DEFAULT_PREFETCH, POLICIES, PRECISIONS, ExpertCache

BACKENDS = ("llama", "native", "onnx")
DRAFTERS = ("none", "ngram", "recycle", "cache", "model", "head", "auto")
DEFAULT_DRAFT_MAX = 16    # most draft tokens (tree nodes) per target step
MAX_DRAFT = 64            # draft_max < min(n_batch, MAX_DRAFT)
MIN_CTX = 16              # smaller caches trip llama.cpp's asserts, and hold no useful text
MAX_CTX = 2**31 - 1       # positions are int32 in every backend
MAX_SLOTS = 64            # KV-cache slots per backend
MAX_PARALLEL = 16         # generations decoding together in one batch per step
AUTO_PARALLEL = 4         # the most parallel=None chooses
MAX_PREFETCH = 64         # expert prefetch depth, in layers
THREADS_PER_CPU = 4       # more threads per CPU than this needs force_threads

# The native engine's kernel sets on this CPU, best first ("auto": the best).
KERNEL_SETS = ("auto", *(ffi.string(lib.es_kernels_available(i)).decode()
                         for i in range(16) if lib.es_kernels_available(i) != ffi.NULL))
REPACK_MODES = ("cached", "memory", "off")
EXPERT_WEIGHTS = ("mapped", "f32")
CACHE_TYPES = ("f16", "q8_0")   # KV-cache key and value types (llama.cpp's -ctk / -ctv names)

_C_CONTEXT = lib.es_context_default_params()
DEFAULT_CTX = int(_C_CONTEXT.n_ctx)      # the KV cache size when none is asked for (capped at the training context)
DEFAULT_BATCH = int(_C_CONTEXT.n_batch)


def option(default: Any, *flags: str, help: str, minimum: int | None = None, maximum: int | None = None,
           choices: tuple[str, ...] | None = None, metavar: str | None = None, cli_default: Any = ...,
           factory: Callable[[], Any] | None = None) -> Any:
    """A config field: its default, command-line ``flags`` (none: not on the
    command line), ``help`` (saying the default and range), the range or
    choices it is checked against, and ``cli_default`` where the command line's
    default differs from the library's (``--drafter``: auto, Engine: none).
    ``factory`` makes the default when a config is made instead (from_env).
    EngineConfig's fields and SamplingParams' are declared with it; the
    command line's options are derived from them (edgespec.cli.options)."""
    metadata = {"flags": flags, "help": help, "minimum": minimum, "maximum": maximum, "choices": choices,
                "metavar": metavar, "cli_default": default if cli_default is ... else cli_default}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def from_env(variable: str, meanings: dict[str, str], takes: str) -> Callable[[], str]:
    """A field's default read from the environment when a config is made:
    the meaning of ``variable``'s value (unset: ""), or an InvalidArgumentError
    naming the variable and what it ``takes``."""
    def read() -> str:
        value = os.environ.get(variable, "")
        if value not in meanings:
            raise InvalidArgumentError(f"{variable}={value}: {takes}"[:300])
        return meanings[value]
    return read


MODEL_HELP = "Built-in model name, GGUF path, or hf:owner/repo/file.gguf (default: the built-in default)."


@dataclass(frozen=True)
class EngineConfig:
    """Every option of an Engine (see the module docstring)."""

    model: str | None = option(None, "--model", "-m", help=MODEL_HELP)
    backend: str | None = option(
        None, "--backend", choices=BACKENDS,
        help="llama (llama.cpp), native (edgespec's own C engine) or onnx (ONNX Runtime; --model may also be a "
             "folder from `edgespec export-onnx`, a GGUF is exported into the cache on first use) (default: "
             "native for llama, qwen2 and gemma3 models, llama for other architectures and with --gpu-layers; "
             "`edgespec models info` says which).")
    ep: str | None = option(
        None, "--ep",
        help="ONNX Runtime execution provider of whichever model runs on the onnx backend: cpu, qnn, openvino, "
             "dml, coreml or cuda (default: cpu); openvino:CPU, openvino:NPU or openvino:GPU picks OpenVINO's "
             "device.")
    threads: int | None = option(None, "--threads", "-t", minimum=1,
                                 help="CPU threads, > 0 (default: every logical CPU up to 4, half of them "
                                      "beyond).")
    n_ctx: int | None = option(
        None, "--ctx", minimum=MIN_CTX, maximum=MAX_CTX,
        help=f"Context window in tokens, >= {MIN_CTX} (default: {DEFAULT_CTX}, or the model's training context "
             "if smaller; longer needs --ctx-extend).")
    n_batch: int = option(DEFAULT_BATCH, minimum=1, help="Most tokens one evaluation takes.")
    cache_type_k: str = option(
        "f16", "--cache-type-k", "-ctk", choices=CACHE_TYPES,
        help="The KV cache's key type, as llama.cpp's -ctk: f16 or q8_0 (ggml's blocks of 32 int8 and a scale: "
             "1.06 bytes a value instead of 2; the logits move, so greedy text may differ from f16's, keys more "
             "than values; speculation stays exact against plain decoding with the same types) (native and llama "
             "backends; default: f16).")
    cache_type_v: str = option(
        "f16", "--cache-type-v", "-ctv", choices=CACHE_TYPES,
        help="The KV cache's value type, as llama.cpp's -ctv: f16 or q8_0 (see --cache-type-k) (native and "
             "llama backends; default: f16).")
    slots: int = option(1, "--slots", minimum=1, maximum=MAX_SLOTS,
                        help=f"KV-cache slots, [1, {MAX_SLOTS}]: each keeps one conversation's prefix (a context "
                             "of --ctx tokens each, made when first used).")
    parallel: int | None = option(
        1, "--parallel", minimum=1, maximum=MAX_PARALLEL, metavar="N",
        help=f"Generations decoding together, [1, {MAX_PARALLEL}]: concurrent requests each run in a slot of "
             "their own (slots are raised to N) and their steps, drafts included, are evaluated in one batch "
             "(native backend; on the others requests run one at a time) (default: 1; for serve, and None in "
             "Python, chosen at load from this machine's batch cost curve: the most sequences, up to 4, each "
             "adding at most half a lone step's cost, whose KV caches fit in half the memory available).")
    stream_idle_ms: int = option(
        10_000, minimum=1, metavar="MS",
        help="A stream left idle between pieces (its consumer holds it without asking for the next) for longer "
             "than this while another thread waits for the engine is ended for that thread; resuming it raises "
             "GenerationAbandonedError (default: 10000 ms).")
    context_shift: bool = option(
        False, "--context-shift",
        help="When a generation fills its context, keep the prompt's first n_keep tokens (a request's "
             "n_keep / num_keep; default 0, the BOS token kept), drop the oldest half of the rest and go on, as "
             "llama-server's --context-shift and Ollama do; the kept part is evaluated again (default: off, "
             "the generation ends; a request's context_shift / shift overrides it).")
    gpu_layers: int = option(0, "--gpu-layers", minimum=0,
                             help="Layers to offload to Metal/CUDA/Vulkan if llama.cpp was built with one, >= 0 "
                                  "(llama backend).")
    drafter: str = option(
        "none", "--drafter", choices=DRAFTERS, cli_default="auto",
        help="none, ngram, recycle, cache, model, head or auto (chooses per step among ngram, cache, the "
             "specialized drafters, the draft head and the draft model, and decodes plainly when speculation "
             "does not pay).")
    draft_model: str | None = option(
        None, "--draft-model",
        help="Draft model for the model and auto drafters (default: the model's paired draft model, if the "
             "registry names one; a draft model with another tokenizer drafts text in cross-tokenizer mode).")
    head: str | None = option(
        None, "--head", metavar="FILE",
        help="Draft head file (EAGLE: one layer over the target's own hidden states, a GGUF made for this "
             "target) for the head and auto drafters; native backend (default: none, and auto drafts without "
             "one).")
    draft_backend: str | None = option(
        None, "--draft-backend", choices=BACKENDS,
        help="Backend of the draft model (default: the target's), e.g. onnx on an NPU with a llama target.")
    draft_vocab: int | None = option(
        None, "--draft-vocab", minimum=256, metavar="N",
        help="Trim the draft model's output layer to the N tokens text uses most (a token ranking: the "
             "shipped one, or `edgespec drafter rank`), so each drafted token costs less; output stays "
             "exact. For a draft model sharing the target's vocabulary, on the native backend (default: all).")
    draft_max: int = option(DEFAULT_DRAFT_MAX, "--draft-max", minimum=1, maximum=MAX_DRAFT - 1,
                            help=f"Most draft tokens per target step, [1, {MAX_DRAFT - 1}].")
    ngram_cache: str | None = option(None, "--ngram-cache",
                                     help="N-gram cache file for the cache and auto drafters (`edgespec drafter "
                                          "ngram` builds one).")
    drafter_dir: str | None = option(
        None, "--drafters", metavar="DIR",
        help="Specialized drafters for auto: the GGUF files of DIR and DIR/<model name>/ (default: the shipped "
             "ones and $EDGESPEC_HOME/drafters/<model name>/; `edgespec drafter list` shows them).")
    router: str = option(
        "profile", "--router",
        help="How auto picks one specialized drafter per request: profile (the prompt's scripts and character "
             "n-grams against each drafter's), or module:Class of your own (an edgespec.drafters.router.Router).")
    ctx_extend: bool = option(False, "--ctx-extend", help="Allow a context longer than the model's training "
                                                          "context.")
    force_threads: bool = option(False, "--force-threads",
                                 help=f"Allow more than {THREADS_PER_CPU} threads per CPU.")
    verbose: bool = option(False, "--verbose", help="Show the backend's own log (llama.cpp's).")
    expert_cache_mb: int | None = option(
        None, "--expert-cache", minimum=1, metavar="MB",
        help="MoE models on the native backend: keep at most MB megabytes of expert weights in memory, reading "
             "the rest from disk on demand (default: all mapped).")
    expert_precision: str = option(
        "exact", "--expert-precision", choices=PRECISIONS,
        help="exact (output identical to an unlimited cache), balanced (a missing expert of small routing weight "
             "is served from its low-precision copy) or fast (every missing expert is); balanced and fast need "
             "`edgespec moe prepare`.")
    expert_policy: str = option("adaptive", "--expert-policy", choices=POLICIES,
                                help="Expert cache eviction: adaptive (frequency and layer distance) or lru.")
    expert_prefetch: int = option(DEFAULT_PREFETCH, "--expert-prefetch", minimum=0, maximum=MAX_PREFETCH,
                                  help=f"Most layers ahead whose experts are predicted and read early, "
                                       f"[0, {MAX_PREFETCH}]; 0 = off.")

    # The native engine's switches, read from the environment unless given.
    kernels: str = option(
        None, choices=KERNEL_SETS,
        factory=from_env("EDGESPEC_KERNELS", {"": "auto", **{k: k for k in KERNEL_SETS}},
                         f"not a kernel set this CPU runs (available: {', '.join(KERNEL_SETS)})"),
        help="The native engine's kernel set, for the whole process: auto (the best this CPU runs) or one of "
             f"{', '.join(KERNEL_SETS[1:])} (default: $EDGESPEC_KERNELS, else auto).")
    repack: str = option(
        None, choices=REPACK_MODES,
        factory=from_env("EDGESPEC_REPACK", {"": "cached", "1": "cached", "memory": "memory", "0": "off"},
                         "1 repacks the weights and keeps them in the cache between loads (the default), "
                         "memory repacks them at every load, 0 does not repack"),
        help="Weights repacked at load for the native engine's tile kernels: cached (kept in a file of the "
             "cache between loads), memory (repacked at every load) or off (default: $EDGESPEC_REPACK: "
             "1 cached, memory, 0 off; else cached).")
    expert_weights: str = option(
        None, choices=EXPERT_WEIGHTS,
        factory=from_env("EDGESPEC_EXPERTS", {"": "mapped", "f32": "f32"},
                         "not an expert provider of this build (f32, or unset)"),
        help="How the native engine serves a MoE model's expert matrices: mapped (from the file) or f32 (F32 "
             "copies made on demand, as a cache of experts hands out buffers of its own) (default: "
             "$EDGESPEC_EXPERTS, else mapped).")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name))
        for f in dataclasses.fields(self):   # paths given as Path objects are kept as text
            if isinstance(getattr(self, f.name), os.PathLike):
                object.__setattr__(self, f.name, os.fspath(getattr(self, f.name)))
        if self.threads is not None and not self.force_threads:
            cores = os.cpu_count() or 1
            if self.threads > THREADS_PER_CPU * cores:
                raise _refuse("threads", f"threads {self.threads} is more than {THREADS_PER_CPU} x the {cores} CPUs "
                                         "of this machine (force_threads / --force-threads allows it)")
        if not self.draft_max < min(self.n_batch, MAX_DRAFT):
            raise _refuse("draft_max", f"draft_max must be in [1, {min(self.n_batch, MAX_DRAFT) - 1}], "
                                       f"got {self.draft_max}")
        if self.expert_cache_mb is None and self.expert_precision != "exact":
            raise _refuse("expert_precision", f"expert_precision {self.expert_precision} applies to an expert "
                                              "cache (expert_cache_mb / --expert-cache)")
        if self.expert_cache_mb is not None and self.backend not in (None, "native"):
            raise _refuse("expert_cache_mb", f"expert_cache_mb: an expert cache needs the native backend, "
                                             f"not {self.backend}")

    @classmethod
    def of(cls, **options) -> "EngineConfig":
        """A config from keyword options; an option that does not exist is an
        InvalidArgumentError naming it (a TypeError from the dataclass otherwise)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown engine option{'s' if len(unknown) > 1 else ''} "
                                       f"{', '.join(map(repr, unknown))} (known: {', '.join(sorted(known))})")
        return cls(**options)

    def but(self, **changes) -> "EngineConfig":
        """This config with ``changes`` (checked like ``of``)."""
        return EngineConfig.of(**{**dataclasses.asdict(self), **changes})

    @classmethod
    def default(cls, name: str) -> Any:
        """Field ``name``'s default, as a config made now would have it (the
        environment's, for the native engine's switches)."""
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    @classmethod
    def check(cls, name: str, value: Any) -> Any:
        """``value`` checked as field ``name``'s (InvalidArgumentError naming it)."""
        _check_field(next(f for f in dataclasses.fields(cls) if f.name == name), value)
        return value

    @property
    def native_options(self) -> dict:
        """The native backend's own options (open_backend keyword arguments)."""
        return {"kernels": self.kernels, "repack": self.repack, "expert_weights": self.expert_weights}

    @property
    def cache_types(self) -> dict:
        """The KV-cache types these options ask for other than f16 (open_backend
        keyword arguments: a backend without them refuses any)."""
        return {name: value for name, value in (("cache_type_k", self.cache_type_k),
                                                ("cache_type_v", self.cache_type_v)) if value != "f16"}

    @property
    def expert_cache(self) -> ExpertCache | None:
        """The expert cache these options ask for, or None."""
        if self.expert_cache_mb is None:
            return None
        return ExpertCache(self.expert_cache_mb, self.expert_precision, self.expert_policy, self.expert_prefetch)


def _refuse(option: str, message: str) -> InvalidArgumentError:
    """An InvalidArgumentError about ``option`` (its ``option`` attribute), so
    that the command line can name the option's flag instead."""
    error = InvalidArgumentError(message[:300])
    error.option = option
    return error


def _check_field(f: dataclasses.Field, value: Any) -> None:
    """One field's own range or choices (InvalidArgumentError naming it)."""
    m = f.metadata
    if value is None and (f.default is None or str(f.type).endswith("| None")):   # None: chosen at load
        return
    name = f.name
    if m.get("choices") is not None:
        if value not in m["choices"]:
            raise _refuse(name, f"unknown {name.replace('_', ' ')} {value!r} "
                                f"(available: {', '.join(m['choices'])})")
    elif isinstance(f.default, bool):
        if not isinstance(value, bool):
            raise _refuse(name, f"{name} must be true or false, got {value!r}")
    elif m.get("minimum") is not None or isinstance(f.default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(name, f"{name} must be a whole number, got {value!r}")
        lo, hi = m.get("minimum"), m.get("maximum")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise _refuse(name, f"{name} must be {bound}, got {value}")
    elif not isinstance(value, (str, os.PathLike)):
        raise _refuse(name, f"{name} must be a string, got {value!r}")
