"""The engine's command-line flags, shared by `flotilla engine serve` and the benchmarks, and their
mapping onto EngineConfig: both read flotilla.contract.ENGINE_KNOBS, where each knob is declared once
(flag, help, default, parser, choices). Import-light: no torch."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from flotilla.contract import (
    ENGINE_KNOBS,
    Knob,
    parse_positive_count,
    parse_positive_counts,
    parse_tenant_weights,
    parse_thread_count,
)
from flotilla.engine.config import EngineConfig
from flotilla.quantity import parse_byte_size

T = TypeVar("T")


def argparse_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` (text -> value, or a ValueError that says what is wrong) as an argparse type that keeps the
    error's words: of a plain ValueError argparse says only "invalid <function> value". int, float and str
    stay argparse's own ("invalid int value: 'x'")."""
    if parse in (int, float, str):
        return parse

    @functools.wraps(parse)
    def read(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


# Value parsers of flags, as argparse types (the benchmarks' own flags use them too).
parse_bytes = argparse_type(parse_byte_size)  # '4GiB', '512MiB', '1e9' or a plain number of bytes
thread_count = argparse_type(parse_thread_count)  # 0 (the default count) or more
positive_count = argparse_type(parse_positive_count)  # 1 or more (prompts, tokens, repeats)
positive_counts = argparse_type(parse_positive_counts)  # comma-separated, each 1 or more, e.g. 1,32
tenant_weights = argparse_type(parse_tenant_weights)  # tenant=weight,tenant=weight


def add_knob_args(group: Any, names: Iterable[str] | None = None) -> None:
    """Declares the flags of the knobs `names` (default: every knob, in the table's order) on `group` (a
    parser or an argument group), as ENGINE_KNOBS declares them."""
    for knob in [ENGINE_KNOBS[name] for name in names] if names is not None else ENGINE_KNOBS.values():
        group.add_argument(knob.flag, **_argument(knob))


def _argument(knob: Knob) -> dict[str, Any]:
    if knob.parse is None:  # a switch: given, the knob takes knob.switch (engine_config_from_args)
        return {"action": "store_true", "help": knob.help}
    options: dict[str, Any] = {"help": knob.help}
    if knob.required:
        options["required"] = True
    else:
        options["default"] = knob.fresh_default()
    if knob.parse is not str:
        options["type"] = argparse_type(knob.parse)
    if knob.choices and knob.parser_checks:
        options["choices"] = knob.choices
    elif knob.choices:  # EngineConfig refuses another value, naming the flag, the value and the rule
        options["metavar"] = "{" + ",".join(map(str, knob.choices)) + "}"
    if knob.metavar:
        options["metavar"] = knob.metavar
    return options


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every knob's flag, in an "engine" group of `parser`."""
    add_knob_args(parser.add_argument_group("engine"))


def add_quantization_args(group: Any) -> None:
    """--quantization and --quantization-group-size (also declared by `bench offline`)."""
    add_knob_args(group, ("quantization", "quantization_group_size"))


def engine_config_from_args(args: argparse.Namespace, show_progress: bool = False) -> EngineConfig:
    """The EngineConfig of parsed flags (every knob's: add_engine_args). EngineConfig checks the values
    together, and names the flag, the value and the rule of one it refuses."""
    values = {knob.name: _value(knob, getattr(args, knob.dest)) for knob in ENGINE_KNOBS.values()}
    return EngineConfig(**values, show_progress=show_progress)


def _value(knob: Knob, parsed: Any) -> Any:
    if knob.parse is None:
        return knob.switch if parsed else knob.default
    return dict(parsed) if isinstance(parsed, Mapping) else parsed
