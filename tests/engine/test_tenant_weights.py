"""Fair-share weights as text (flotilla.contract's tenant=weight,tenant=weight) and the engine flags that
carry them and the scheduling policy into EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from flotilla.contract import (
    FLAG_SCHEDULING_POLICY,
    FLAG_TENANT_WEIGHTS,
    SCHEDULING_POLICIES,
    format_tenant_weights,
    parse_tenant_weights,
)
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine_args import add_engine_args, engine_config_from_args, tenant_weights


@pytest.mark.parametrize(
    "weights",
    [{}, {"team-a": 2.0}, {"team-a": 2.0, "b": 0.5}, {"z.z": 1.0, "a": 3.25, "m-1": 1e-3}, {"big": 1e6}],
)
def test_format_then_parse_gives_the_weights_back(weights):
    assert parse_tenant_weights(format_tenant_weights(weights)) == weights


def test_format_is_sorted_so_equal_weights_give_equal_text():
    pairs = (("b", 1.0), ("a", 2.0))
    assert format_tenant_weights(pairs) == format_tenant_weights(dict(reversed(pairs))) == "a=2,b=1"


def test_parse_skips_blanks_and_spaces():
    assert parse_tenant_weights(" a=2 , ,b=1,") == {"a": 2.0, "b": 1.0}
    assert parse_tenant_weights("") == {}


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("a", "a"),
        ("a=", "a="),
        ("=2", "=2"),
        ("a=x", "a=x"),
        ("a=0", "a=0"),
        ("a=-1", "a=-1"),
        ("a=nan", "a=nan"),
        ("ok=1,b=two", "b=two"),
    ],
)
def test_parse_refuses_a_bad_entry_naming_it(text, bad):
    with pytest.raises(ValueError, match="is not tenant=weight with a positive weight") as caught:
        parse_tenant_weights(text)
    assert repr(bad) in str(caught.value)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve", exit_on_error=False)
    add_engine_args(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_defaults_are_fcfs_and_no_weights():
    config = engine_config_from_args(_parse())
    default = EngineConfig(model="m")
    assert (config.scheduling_policy, config.tenant_weights) == ("fcfs", {})
    assert (config.scheduling_policy, config.tenant_weights) == (
        default.scheduling_policy,
        default.tenant_weights,
    )


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_every_policy_reaches_the_config(policy):
    assert engine_config_from_args(_parse(FLAG_SCHEDULING_POLICY, policy)).scheduling_policy == policy


def test_weights_reach_the_config():
    args = _parse(FLAG_SCHEDULING_POLICY, "fair", FLAG_TENANT_WEIGHTS, "team-a=2,team-b=0.5")
    config = engine_config_from_args(args)
    assert config.scheduling_policy == "fair"
    assert config.tenant_weights == {"team-a": 2.0, "team-b": 0.5}


def test_bad_weights_are_an_argument_error_naming_the_entry():
    with pytest.raises(argparse.ArgumentTypeError, match="'b=0' is not tenant=weight"):
        tenant_weights("a=1,b=0")


def test_unknown_policy_is_refused():
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'lottery'"):
        _parse(FLAG_SCHEDULING_POLICY, "lottery")
