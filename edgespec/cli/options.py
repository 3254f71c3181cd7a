"""The option sets the commands share, each defined once: the engine options
(every command that opens an Engine takes them) and the sampling options
(every command that generates with one fixed set of sampling settings).

A command names a set with its decorator and receives it as one frozen
dataclass in the parameter of that name; the set's options take the place of
that parameter in the command's signature (and so in ``--help``)::

    @app.command()
    @engine_options
    @sampling_options
    def generate(prompt: str = typer.Argument(...), engine: EngineOptions = ...,
                 sampling: SamplingOptions = ...): ...

Out-of-range values raise InvalidArgumentError naming the option, before any
model is loaded; edgespec.cli.main prints it as one line with exit code 2.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import typer

from ..engine import DEFAULT_DRAFT_MAX
from .. import moe
from ..errors import InvalidArgumentError
from ..sampling import SamplingParams
from ..text import utf8_text

DRAFT_MAX_LIMIT = 63  # the engine's bound: draft_max < min(n_batch, 64)


@dataclass(frozen=True)
class EngineOptions:
    """How a command opens its Engine (the fields are Engine's keyword arguments)."""

    model: Optional[str]
    backend: Optional[str]
    ep: Optional[str]
    threads: Optional[int]
    n_ctx: Optional[int]
    gpu_layers: int
    drafter: str
    draft_model: Optional[str]
    draft_backend: Optional[str]
    draft_max: int
    ngram_cache: Optional[str]
    drafter_dir: Optional[str]
    router: str
    ctx_extend: bool
    force_threads: bool
    verbose: bool
    expert_cache_mb: Optional[int]
    expert_precision: str
    expert_policy: str
    expert_prefetch: int

    def __post_init__(self):
        if self.threads is not None and self.threads <= 0:
            raise InvalidArgumentError(f"--threads must be > 0, got {self.threads}")
        if self.gpu_layers < 0:
            raise InvalidArgumentError(f"--gpu-layers must be >= 0, got {self.gpu_layers}")
        if not 1 <= self.draft_max <= DRAFT_MAX_LIMIT:
            raise InvalidArgumentError(f"--draft-max must be in [1, {DRAFT_MAX_LIMIT}], got {self.draft_max}")
        moe.ExpertCache.of(self.expert_cache_mb, self.expert_precision, self.expert_policy,
                           self.expert_prefetch, self.backend)

    def open(self):
        """The Engine these options describe (use it in a ``with``)."""
        from ..engine import Engine

        kwargs = dataclasses.asdict(self)
        return Engine(kwargs.pop("model"), **kwargs)


@dataclass(frozen=True)
class SamplingOptions:
    """How tokens are chosen: Engine.generate/stream keyword arguments."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: Optional[int]
    stop: tuple[str, ...]
    json_schema: Optional[str]   # file paths
    grammar: Optional[str]

    def __post_init__(self):
        # SamplingParams holds the ranges; checked here so that they fail before a model loads.
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                       repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, seed=0 if self.seed is None else self.seed)
        for s in self.stop:
            utf8_text(s, "--stop")
        if self.json_schema and self.grammar:
            raise InvalidArgumentError("give --json-schema or --grammar, not both")
        object.__setattr__(self, "_grammar", self._read_grammar())

    def _read_grammar(self):
        from ..grammar import Grammar

        path = self.json_schema or self.grammar
        if not path:
            return None
        flag = "--json-schema" if self.json_schema else "--grammar"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"{flag} {path}: {e.strerror if isinstance(e, OSError) else 'not UTF-8'}") from None
        return Grammar.json_schema(text) if self.json_schema else Grammar.from_text(text)

    def kwargs(self) -> dict:
        d = dataclasses.asdict(self)
        del d["json_schema"]
        return {**d, "stop": list(self.stop), "grammar": self._grammar}


MODEL_HELP = "Built-in model name, GGUF path, or hf:owner/repo/file.gguf (default: the built-in default)."

ENGINE_OPTIONS = {
    "model": (Optional[str], typer.Option(None, "--model", "-m", help=MODEL_HELP)),
    "backend": (Optional[str], typer.Option(
        None, "--backend", help="llama (llama.cpp), native (edgespec's own C engine) or onnx (ONNX Runtime; "
        "--model may also be a folder from `edgespec export-onnx`, a GGUF is exported into the cache on first use) "
        "(default: native for llama, qwen2 and gemma3 models, llama for other architectures and with --gpu-layers; "
        "`edgespec models info` says which).")),
    "ep": (Optional[str], typer.Option(
        None, "--ep", help="ONNX Runtime execution provider of whichever model runs on the onnx backend: "
        "cpu, qnn, openvino, dml, coreml or cuda (default: cpu); openvino:CPU, openvino:NPU or openvino:GPU "
        "picks OpenVINO's device.")),
    "threads": (Optional[int], typer.Option(None, "--threads", help="CPU threads, > 0 (default: physical cores).")),
    "n_ctx": (Optional[int], typer.Option(None, "--ctx", help="Context window in tokens, >= 16 (default: 4096, or "
                                              "the model's training context if smaller; longer needs --ctx-extend).")),
    "ctx_extend": (bool, typer.Option(False, "--ctx-extend", help="Allow a context longer than the model's "
                                                                  "training context.")),
    "gpu_layers": (int, typer.Option(0, "--gpu-layers", help="Layers to offload to Metal/CUDA/Vulkan if "
                                                             "llama.cpp was built with one, >= 0 (llama backend).")),
    "drafter": (str, typer.Option("auto", "--drafter", help="none, ngram, recycle, cache, model or auto "
                                                            "(chooses per step among ngram, cache and the draft "
                                                            "model, and decodes plainly when speculation does not "
                                                            "pay).")),
    "draft_model": (Optional[str], typer.Option(None, "--draft-model", help="Draft model for the model and auto "
                                                "drafters (default: the model's paired draft model, if the registry "
                                                "names one; a draft model with another tokenizer drafts text in "
                                                "cross-tokenizer mode).")),
    "draft_backend": (Optional[str], typer.Option(None, "--draft-backend", help="Backend of the draft model "
                                                  "(default: the target's), e.g. onnx on an NPU with a llama target.")),
    "draft_max": (int, typer.Option(DEFAULT_DRAFT_MAX, "--draft-max", help=f"Most draft tokens per target step, "
                                                                           f"[1, {DRAFT_MAX_LIMIT}].")),
    "ngram_cache": (Optional[str], typer.Option(None, "--ngram-cache", help="N-gram cache file for the cache and "
                                                "auto drafters (`edgespec drafter ngram` builds one).")),
    "drafter_dir": (Optional[str], typer.Option(None, "--drafters", metavar="DIR", help="Specialized drafters "
                                                "for auto: the GGUF files of DIR and DIR/<model name>/ (default: "
                                                "the shipped ones and $EDGESPEC_HOME/drafters/<model name>/; "
                                                "`edgespec drafter list` shows them).")),
    "router": (str, typer.Option("profile", "--router", help="How auto picks one specialized drafter per request: "
                                 "profile (the prompt's scripts and character n-grams against each drafter's), "
                                 "or module:Class of your own (an edgespec.drafters.router.Router).")),
    "force_threads": (bool, typer.Option(False, "--force-threads", help="Allow more than 4 threads per CPU.")),
    "verbose": (bool, typer.Option(False, "--verbose", help="Show the backend's own log (llama.cpp's).")),
    "expert_cache_mb": (Optional[int], typer.Option(
        None, "--expert-cache", metavar="MB", help="MoE models on the native backend: keep at most MB "
        "megabytes of expert weights in memory, reading the rest from disk on demand (default: all mapped).")),
    "expert_precision": (str, typer.Option(
        "exact", "--expert-precision", help="exact (output identical to an unlimited cache), balanced (a "
        "missing expert of small routing weight is served from its low-precision copy) or fast (every missing "
        "expert is); balanced and fast need `edgespec moe prepare`.")),
    "expert_policy": (str, typer.Option("adaptive", "--expert-policy", help="Expert cache eviction: adaptive "
                                        "(frequency and layer distance) or lru.")),
    "expert_prefetch": (int, typer.Option(moe.DEFAULT_PREFETCH, "--expert-prefetch", help="Most layers ahead "
                                          "whose experts are predicted and read early, [0, 64]; 0 = off.")),
}

SAMPLING_OPTIONS = {
    "temperature": (float, typer.Option(0.0, "--temperature", "-t", help="0 = greedy; otherwise >= 1e-6, "
                                                                          "sampled.")),
    "top_k": (int, typer.Option(0, "--top-k", help="Keep the k most likely tokens, >= 0; 0 = off.")),
    "top_p": (float, typer.Option(1.0, "--top-p", help="Nucleus mass in (0, 1]; 1 = off.")),
    "min_p": (float, typer.Option(0.0, "--min-p", help="Drop tokens below min_p x p(best), [0, 1); 0 = off.")),
    "repeat_penalty": (float, typer.Option(1.0, "--repeat-penalty", help="Repetition penalty, > 0; 1 = off.")),
    "presence_penalty": (float, typer.Option(0.0, "--presence-penalty", help="Subtracted from the logit of each "
                                                                            "recent token; 0 = off.")),
    "frequency_penalty": (float, typer.Option(0.0, "--frequency-penalty", help="Subtracted per occurrence of a "
                                                                              "recent token; 0 = off.")),
    "seed": (Optional[int], typer.Option(None, "--seed", help="RNG seed for sampling, [0, 2**64) "
                                                              "(default: random).")),
    "stop": (Optional[list[str]], typer.Option(None, "--stop", help="Stop string (repeatable).")),
    "json_schema": (Optional[str], typer.Option(None, "--json-schema", help="JSON schema file: the output is "
                                                                            "JSON valid against it.")),
    "grammar": (Optional[str], typer.Option(None, "--grammar", help="Grammar file (Lark, or GBNF with ::=): "
                                                                    "the output follows it.")),
}


def envvar(info) -> str:
    """The environment variable of an option: EDGESPEC_ and its long flag (--draft-max: EDGESPEC_DRAFT_MAX)."""
    flag = next(d for d in info.param_decls if d.startswith("--"))
    return "EDGESPEC_" + flag[2:].upper().replace("-", "_")


def with_envvar(info):
    """A copy of a typer.Option that is also read from its environment variable."""
    info = copy.copy(info)
    info.envvar = envvar(info)
    return info


def _option_set(param: str, cls: type, options: dict, convert: Callable[[dict], dict] = dict):
    """A decorator that replaces a command's parameter ``param`` by ``options``
    and calls the command with those values as one ``cls``. ``exclude`` leaves
    options out of the command (they keep their defaults); ``envvars`` reads
    each from its environment variable too (see envvar)."""

    def decorator(command=None, *, exclude: tuple[str, ...] = (), envvars: bool = False):
        def wrap(command):
            own = inspect.signature(command, eval_str=True).parameters
            if param not in own:
                raise TypeError(f"{command.__name__} has no parameter '{param}'")
            params = []
            for p in own.values():
                if p.name == param:
                    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                                 default=with_envvar(info) if envvars else info, annotation=tp)
                               for name, (tp, info) in options.items() if name not in exclude]
                else:
                    params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

            @functools.wraps(command)
            def run(**values):
                mine = {name: values.pop(name) if name in values else info.default
                        for name, (_, info) in options.items()}
                return command(**values, **{param: cls(**convert(mine))})

            del run.__wrapped__  # typer reads the signature below, not the command's
            run.__signature__ = inspect.Signature(params)
            run.__annotations__ = {p.name: p.annotation for p in params}
            return run

        return wrap if command is None else wrap(command)

    return decorator


engine_options = _option_set("engine", EngineOptions, ENGINE_OPTIONS)
sampling_options = _option_set("sampling", SamplingOptions, SAMPLING_OPTIONS,
                               lambda v: {**v, "stop": tuple(v["stop"] or ())})
