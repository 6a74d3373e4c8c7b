"""Model versions: the version policy (manifest and node file), client version strings
with Triton's messages, and version directory names."""

from __future__ import annotations

import msgspec
import pytest

from rsrv.config import ModelSchedConfig
from rsrv.errors import InvalidArgument
from rsrv.versions import (
    DEFAULT_POLICY,
    MAX_VERSION,
    VersionPolicy,
    parse_version,
    version_dir_number,
)


@pytest.mark.parametrize(
    ("policy", "available", "selected"),
    [
        (DEFAULT_POLICY, [1, 2, 3], [3]),
        (VersionPolicy(), [3, 1, 2], [3]),  # nothing given: latest 1
        (VersionPolicy(latest=2), [1, 2, 3], [2, 3]),
        (VersionPolicy(latest=5), [2, 7], [2, 7]),
        (VersionPolicy(all=True), [3, 1], [1, 3]),
        (VersionPolicy(specific=(1, 3, 9)), [1, 2, 3], [1, 3]),
        (VersionPolicy(specific=(9,)), [1, 2], []),
        (DEFAULT_POLICY, [], []),
    ],
)
def test_policy_selects(policy, available, selected):
    assert policy.select(available) == selected


def test_policy_describes_itself():
    assert DEFAULT_POLICY.describe() == "latest 1"
    assert VersionPolicy(all=True).describe() == "all"
    assert VersionPolicy(specific=(3, 1)).describe() == "specific [1, 3]"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{latest: 2, all: true}", "is one of latest, all or specific, got latest and all"),
        ("{specific: []}", "list at least one version"),
        ("{latest: 0}", "Expected `int` >= 1"),
        ("{newest: 2}", "unknown field `newest`"),
    ],
)
def test_bad_policies_name_the_field(text, message):
    with pytest.raises(msgspec.ValidationError, match="version_policy") as info:
        msgspec.yaml.decode(f"version_policy: {text}", type=ModelSchedConfig)
    assert message in str(info.value)


def test_node_file_policy_decodes():
    config = msgspec.yaml.decode("version_policy: {specific: [1, 3]}", type=ModelSchedConfig)
    assert config.version_policy == VersionPolicy(specific=(1, 3))
    assert not config.allow_file_overrides


@pytest.mark.parametrize(
    ("text", "number"),
    [("", None), ("1", 1), ("0", 0), ("0042", 42), ("0" * 25 + "7", 7), ("-0", 0), ("-000", 0)],
)
def test_version_strings(text, number):
    assert parse_version(text) == number


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("wrong_specification", "not a decimal integer"),
        ("1.5", "not a decimal integer"),
        (" 1", "not a decimal integer"),
        ("+1", "not a decimal integer"),
        (str(MAX_VERSION + 1), f"above the largest version {MAX_VERSION}"),
        ("1" * 5000, f"above the largest version {MAX_VERSION}"),  # (int() refuses it)
    ],
)
def test_malformed_version_strings_get_tritons_message(text, detail):
    with pytest.raises(InvalidArgument) as info:
        parse_version(text)
    shown = text if len(text) <= 80 else text[:80] + "..."
    assert str(info.value) == (
        f"failed to get model version from specified version string '{shown}' "
        f"(details: {detail}), version should be an integral value > 0"
    )


def test_negative_version_string_gets_tritons_message():
    with pytest.raises(InvalidArgument) as info:
        parse_version("-3")
    assert str(info.value) == (
        "invalid model version specified '-3' , version should be an integral value > 0"
    )


@pytest.mark.parametrize(
    ("name", "number"),
    [("1", 1), ("12", 12), ("0", None), ("01", None), ("v2", None), ("-1", None), ("", None)],
)
def test_version_directory_names(name, number):
    assert version_dir_number(name) == number
