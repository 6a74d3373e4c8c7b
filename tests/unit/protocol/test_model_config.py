"""ModelConfig derived from a manifest, and RepositoryModelLoad's parameters: the config
override subset, the fields it must leave as derived, and file: contents."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from support.bundles import template

from rsrv.bundle import load_bundle
from rsrv.errors import InvalidArgument
from rsrv.protocol import load_parameters, model_config
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.inference import model_config_pb2 as mc
from rsrv.versions import DEFAULT_POLICY, VersionPolicy


@pytest.fixture(scope="module")
def image():
    return load_bundle(template("image"))


@pytest.fixture(scope="module")
def unbatched():
    return load_bundle(template("unbatched"))


def test_model_config_derives_what_the_manifest_knows(image):
    config = model_config(image, "cpu", 4, VersionPolicy(latest=2))
    (x,) = config.input
    assert (x.name, x.data_type, list(x.dims)) == ("x", mc.TYPE_FP32, [3, 8, 8])
    assert x.format == mc.ModelInput.FORMAT_NCHW
    assert [(o.name, list(o.dims)) for o in config.output] == [("scores", [4])]
    assert config.max_batch_size == 4
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 4]
    assert config.version_policy.latest.num_versions == 2
    assert config.parameters["kind"].string_value == "model"
    assert config.parameters["compiled_batch_sizes"].string_value == "1,4"
    assert config.parameters["description"].string_value.startswith("scores of")
    assert config.parameters["provenance.source"].string_value == "tests/support/bundles.py"

    capped = model_config(image, "cpu", 2, DEFAULT_POLICY)
    assert capped.max_batch_size == 2
    assert list(capped.dynamic_batching.preferred_batch_size) == [1]  # sizes above the cap
    assert capped.version_policy.latest.num_versions == 1
    assert capped.dynamic_batching.max_queue_delay_microseconds == 0


def test_model_config_reports_the_queue_delay(image, unbatched):
    config = model_config(image, "cpu", 4, DEFAULT_POLICY, 0.0025)
    assert config.dynamic_batching.max_queue_delay_microseconds == 2500
    as_json = json_format.MessageToDict(config, preserving_proto_field_name=True)
    assert as_json["dynamic_batching"]["max_queue_delay_microseconds"] == "2500"
    # no batch axis: no dynamic batching at all
    assert not model_config(unbatched, "cpu", 0, DEFAULT_POLICY, 0.0025).HasField(
        "dynamic_batching"
    )


def test_model_config_formats(unbatched, image):
    (x,) = model_config(unbatched, "cpu", 0, DEFAULT_POLICY).input
    assert x.format == mc.ModelInput.FORMAT_NONE  # no image letters
    policy = model_config(unbatched, "cpu", 0, VersionPolicy(all=True)).version_policy
    assert policy.WhichOneof("policy_choice") == "all"
    policy = model_config(unbatched, "cpu", 0, VersionPolicy(specific=(3, 1))).version_policy
    assert list(policy.specific.versions) == [1, 3]


def params(**values) -> dict:
    request = pb.RepositoryModelLoadRequest()
    for key, value in values.items():
        key = key.replace("__", ":").replace("_slash_", "/")
        if isinstance(value, bytes):
            request.parameters[key].bytes_param = value
        elif isinstance(value, bool):
            request.parameters[key].bool_param = value
        else:
            request.parameters[key].string_param = value
    return request.parameters


def test_no_parameters():
    assert load_parameters("m", params(), "cpu") == (None, {})


def test_config_override_applies_the_subset(image):
    config = {
        "name": "image",
        "max_batch_size": 2,
        "version_policy": {"specific": {"versions": [1, 3]}},
        "dynamic_batching": {"preferred_batch_size": [1]},
    }
    override, files = load_parameters("image", params(config=json.dumps(config)), "cpu")
    assert files == {}
    assert override.max_batch_size == 2
    assert override.version_policy == VersionPolicy(specific=(1, 3))
    assert override.max_queue_delay is None  # not given: the node file's
    override.check(image, 2, override.version_policy)  # nothing it asks contradicts


@pytest.mark.parametrize(
    ("batching", "delay"),
    [
        ({"max_queue_delay_microseconds": 2500}, 0.0025),
        ({"maxQueueDelayMicroseconds": "1000000", "preferred_batch_size": [4]}, 1.0),
        ({"max_queue_delay_microseconds": 0}, 0.0),  # given as 0: no delay, for this load
        ({"preferred_batch_size": [1]}, None),
    ],
)
def test_config_override_sets_the_queue_delay(image, batching, delay):
    config = json.dumps({"dynamic_batching": batching})
    override, _ = load_parameters("image", params(config=config), "cpu")
    assert override.max_queue_delay == delay
    assert override.max_batch_size is None and override.version_policy is None
    override.check(image, 4, DEFAULT_POLICY)


def test_a_queue_delay_needs_compiled_batch_sizes(unbatched):
    config = '{"dynamic_batching": {"max_queue_delay_microseconds": 100}}'
    override, _ = load_parameters("unbatched", params(config=config), "cpu")
    with pytest.raises(InvalidArgument, match="max_queue_delay_microseconds must be 0"):
        override.check(unbatched, 0, DEFAULT_POLICY)
    config = '{"dynamic_batching": {"max_queue_delay_microseconds": 0}}'
    override, _ = load_parameters("unbatched", params(config=config), "cpu")
    override.check(unbatched, 0, DEFAULT_POLICY)


def test_config_override_may_repeat_what_model_config_reports(image):
    """A round trip: ModelConfig as JSON (what tritonclient's as_json gives), with a new
    max_batch_size, is accepted; changing a derived field is not."""
    reported = json_format.MessageToDict(
        model_config(image, "cpu", 4, DEFAULT_POLICY, 0.002), preserving_proto_field_name=True
    )
    reported["max_batch_size"] = 2
    override, _ = load_parameters("image", params(config=json.dumps(reported)), "cpu")
    override.check(image, 2, DEFAULT_POLICY)
    assert override.max_queue_delay == 0.002

    reported["input"][0]["dims"] = ["3", "16", "16"]
    override, _ = load_parameters("image", params(config=json.dumps(reported)), "cpu")
    with pytest.raises(InvalidArgument, match="field 'input' differs from what rsrv derives"):
        override.check(image, 2, DEFAULT_POLICY)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "Invalid config override: "),
        ("[1, 2]", "Invalid config override: expected a JSON object, got list"),
        ('{"max_batch_siz": 2}', "Invalid config override: "),
        ('{"instance_group": [{"count": 2}]}', "field 'instance_group' is not supported"),
        ('{"sequence_batching": {}}', "field 'sequence_batching' is not supported"),
        ('{"name": "other"}', "field 'name' is 'other'; a config cannot rename the model"),
        ('{"max_batch_size": -1}', "field 'max_batch_size' must be >= 0"),
        ('{"version_policy": {}}', "give one of latest, all or specific"),
        ('{"version_policy": {"latest": {"num_versions": 0}}}', "num_versions must be >= 1"),
        (
            '{"dynamic_batching": {"preserve_ordering": true}}',
            "field 'dynamic_batching.preserve_ordering' is not supported",
        ),
        (
            '{"dynamic_batching": {"max_queue_delay_microseconds": 1000001}}',
            "'dynamic_batching.max_queue_delay_microseconds' must be at most 1000000 (1 s)",
        ),
        (
            '{"dynamic_batching": {"max_queue_delay_microseconds": -1}}',
            "Invalid config override: ",
        ),
    ],
)
def test_config_overrides_refused(config, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_parameters("image", params(config=config), "cpu")


def test_preferred_sizes_must_be_compiled(image):
    override, _ = load_parameters(
        "image", params(config='{"dynamic_batching": {"preferred_batch_size": [3]}}'), "cpu"
    )
    with pytest.raises(InvalidArgument, match=r"\[3\] not among the compiled batch sizes"):
        override.check(image, 4, DEFAULT_POLICY)


def test_files_and_unknown_parameters():
    override, files = load_parameters(
        "m", params(file__1_slash_model_b1=b"abc", file__weights=b""), "cpu"
    )
    assert override is None
    assert files == {"1/model_b1": b"abc", "weights": b""}
    with pytest.raises(InvalidArgument) as info:
        load_parameters("m", params(unload_dependents=True), "cpu")
    assert str(info.value).startswith(
        "Unrecognized load parameter 'unload_dependents' with type 'bool_param'"
    )
    with pytest.raises(InvalidArgument, match="Unrecognized load parameter 'file:x'"):
        load_parameters("m", params(file__x="text, not bytes"), "cpu")
