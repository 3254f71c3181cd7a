"""The option sets the commands share, each defined once: the engine options
(every command that opens an Engine takes them: the fields of
edgespec.config.EngineConfig that have flags) and the sampling options
(every command that generates with one fixed set of sampling settings: the
fields of edgespec.sampling.SamplingParams that have flags, stop strings and
a grammar file).

A command names a set with its decorator and receives it as one frozen
dataclass in the parameter of that name; the set's options take the place of
that parameter in the command's signature (and so in ``--help``)::

    @app.command()
    @engine_options
    @sampling_options
    def generate(prompt: str = typer.Argument(...), engine: EngineConfig = ...,
                 sampling: SamplingOptions = ...): ...

Out-of-range values raise InvalidArgumentError naming the option, before any
model is loaded; edgespec.cli.main prints it as one line with exit code 2.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import typer

from ..config import EngineConfig
from ..errors import InvalidArgumentError
from ..sampling import SamplingParams
from ..text import utf8_text
from .base import fail


def _cli_options(cls: type) -> dict:
    """The command-line form of every field of ``cls`` (EngineConfig,
    SamplingParams) that has flags: its type and a typer.Option with the
    field's flags, help and command-line default."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        m = f.metadata
        if m.get("flags"):
            tp = hints[f.name]
            if m["cli_default"] is None:   # typer wants Optional[X] for an option that may be absent
                tp = Optional[next((a for a in typing.get_args(tp) if a is not type(None)), tp)]
            out[f.name] = (tp, typer.Option(m["cli_default"], *m["flags"], help=m["help"], metavar=m["metavar"]))
    return out


ENGINE_OPTIONS = _cli_options(EngineConfig)
SAMPLING_PARAMS = _cli_options(SamplingParams)   # the sampler's own options
SAMPLING_OPTIONS = {
    **SAMPLING_PARAMS,
    "stop": (Optional[list[str]], typer.Option(None, "--stop", help="Stop string (repeatable).")),
    "json_schema": (Optional[str], typer.Option(None, "--json-schema", help="JSON schema file: the output is "
                                                                            "JSON valid against it.")),
    "grammar": (Optional[str], typer.Option(None, "--grammar", help="Grammar file (Lark, or GBNF with ::=): "
                                                                    "the output follows it.")),
}


@dataclass(frozen=True)
class SamplingOptions:
    """How tokens are chosen, as the command line gives it: Engine.generate/stream
    keyword arguments. ``params``: the SamplingParams fields that have flags
    (seed None: random); stop strings; a grammar from a file."""

    params: dict
    stop: tuple[str, ...]
    json_schema: Optional[str]   # file paths
    grammar: Optional[str]

    def __post_init__(self):
        # SamplingParams holds the ranges; checked here so that they fail before a model loads.
        SamplingParams(**{**self.params, "seed": self.params["seed"] or 0})
        for s in self.stop:
            utf8_text(s, "--stop")
        if self.json_schema and self.grammar:
            raise InvalidArgumentError("give --json-schema or --grammar, not both")
        object.__setattr__(self, "_grammar", self._read_grammar())

    @classmethod
    def of(cls, **values) -> "SamplingOptions":
        """From the command line's values, one per SAMPLING_OPTIONS entry."""
        return cls(params={name: values[name] for name in SAMPLING_PARAMS}, stop=tuple(values["stop"] or ()),
                   json_schema=values["json_schema"], grammar=values["grammar"])

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
        return {**self.params, "stop": list(self.stop), "grammar": self._grammar}


def envvar(info) -> str:
    """The environment variable of an option: EDGESPEC_ and its long flag (--draft-max: EDGESPEC_DRAFT_MAX)."""
    flag = next(d for d in info.param_decls if d.startswith("--"))
    return "EDGESPEC_" + flag[2:].upper().replace("-", "_")


def _by_flag(error: InvalidArgumentError, options: dict) -> str:
    """The message of ``error`` about an option (its ``option`` attribute)
    with the option's name, where the message starts with it, replaced by its
    long flag: on the command line, threads is --threads."""
    name = getattr(error, "option", None)
    message = str(error)
    if name in options and message.startswith(name):
        flag = next(d for d in options[name][1].param_decls if d.startswith("--"))
        return flag + message[len(name):]
    return message


def _with_default(info, default):
    """A copy of a typer.Option with another default."""
    info = copy.copy(info)
    info.default = default
    return info


def with_envvar(info):
    """A copy of a typer.Option that is also read from its environment variable."""
    info = copy.copy(info)
    info.envvar = envvar(info)
    return info


def _option_set(param: str, make: Callable[..., object], options: dict):
    """A decorator that replaces a command's parameter ``param`` by ``options``
    and calls the command with those values made into one object by ``make``
    (called with one keyword per option). ``exclude`` leaves
    options out of the command (they keep their defaults); ``envvars`` reads
    each from its environment variable too (see envvar); ``defaults`` gives
    this command's own defaults for some (serve keeps 3 slots)."""

    def decorator(command=None, *, exclude: tuple[str, ...] = (), envvars: bool = False,
                  defaults: dict | None = None):
        own_options = {name: (tp, _with_default(info, defaults[name]) if name in (defaults or {}) else info)
                       for name, (tp, info) in options.items()}

        def wrap(command):
            own = inspect.signature(command, eval_str=True).parameters
            if param not in own:
                raise TypeError(f"{command.__name__} has no parameter '{param}'")
            params = []
            for p in own.values():
                if p.name == param:
                    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                                 default=with_envvar(info) if envvars else info, annotation=tp)
                               for name, (tp, info) in own_options.items() if name not in exclude]
                else:
                    params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

            @functools.wraps(command)
            def run(**values):
                mine = {name: values.pop(name) if name in values else info.default
                        for name, (_, info) in own_options.items()}
                try:
                    chosen = make(**mine)
                except InvalidArgumentError as e:   # one line, exit 2, from the app itself
                    raise fail(_by_flag(e, own_options)) from None
                return command(**values, **{param: chosen})

            del run.__wrapped__  # typer reads the signature below, not the command's
            run.__signature__ = inspect.Signature(params)
            run.__annotations__ = {p.name: p.annotation for p in params}
            return run

        return wrap if command is None else wrap(command)

    return decorator


engine_options = _option_set("engine", EngineConfig, ENGINE_OPTIONS)
sampling_options = _option_set("sampling", SamplingOptions.of, SAMPLING_OPTIONS)


def with_chat_model(engine: EngineConfig, *, quiet: bool = False) -> tuple[EngineConfig, str]:
    """The config of a command that chats (demo, chat, serve): its --model,
    else the strongest built-in chat model this machine runs at a readable
    speed (registry.chat_model, from the memory available and the measured
    read bandwidth), said in one line on stderr unless ``quiet``. Returns the
    config and why its model."""
    if engine.model is not None:
        return engine, "named with --model"
    from ..backends import default_threads
    from ..costs import available_memory, bandwidth
    from ..models import registry

    name, why = registry.chat_model(available_memory(), bandwidth(engine.threads or default_threads()))
    if not quiet:
        typer.echo(f"model: {name}, {why} (--model picks another)", err=True)
    return engine.but(model=name), why
