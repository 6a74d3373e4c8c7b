"""Generated protocol code: freshness, and wire compatibility with tritonclient."""

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from support import ROOT
from tritonclient.grpc import model_config_pb2 as t_cfg
from tritonclient.grpc import service_pb2 as t_svc

from rsrv.protocol.generated.inference import grpc_service_grpc
from rsrv.protocol.generated.inference import grpc_service_pb2 as o_svc
from rsrv.protocol.generated.inference import model_config_pb2 as o_cfg

GENERATED = ROOT / "src" / "rsrv" / "protocol" / "generated"


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_fresh():
    with tempfile.TemporaryDirectory() as tmp:
        gen = [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", tmp]
        subprocess.run(gen, check=True)
        fresh = tree(Path(tmp))
    committed = tree(GENERATED)
    assert sorted(fresh) == sorted(committed), "file set differs: run `just proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run `just proto`"


# --- wire compatibility ------------------------------------------------------------------
# Each case builds the same message from either side's modules: (svc, cfg) -> message.

CASES = {
    "ModelInferRequest": lambda svc, cfg: svc.ModelInferRequest(
        model_name="resnet",
        model_version="3",
        id="req-1",
        parameters={
            "priority": {"uint64_param": 2**40},
            "timeout": {"int64_param": -5},
            "binary_data_output": {"bool_param": True},
            "tag": {"string_param": "x"},
            "scale": {"double_param": 0.25},
        },
        inputs=[
            {
                "name": "INPUT0",
                "datatype": "FP32",
                "shape": [2, 3],
                "parameters": {"binary_data_size": {"int64_param": 24}},
            },
            {
                "name": "INPUT1",
                "datatype": "INT64",
                "shape": [1],
                "contents": {"int64_contents": [-7], "bytes_contents": [b"\x00\xff"]},
            },
        ],
        outputs=[{"name": "OUTPUT0", "parameters": {"classification": {"int64_param": 3}}}],
        raw_input_contents=[bytes(range(24)), b""],
    ),
    "ModelInferResponse": lambda svc, cfg: svc.ModelInferResponse(
        model_name="resnet",
        model_version="3",
        id="req-1",
        parameters={"sequence_end": {"bool_param": False}},
        outputs=[
            {
                "name": "OUTPUT0",
                "datatype": "BYTES",
                "shape": [1, 2],
                "contents": {
                    "fp32_contents": [1.5],
                    "fp64_contents": [2.5],
                    "uint_contents": [7],
                    "bool_contents": [True],
                },
            }
        ],
        raw_output_contents=[b"\x01\x02\x03\x04"],
    ),
    "ModelConfigResponse": lambda svc, cfg: svc.ModelConfigResponse(
        config=cfg.ModelConfig(
            name="resnet",
            platform="stablehlo",
            backend="rsrv",
            runtime="pjrt",
            max_batch_size=8,
            version_policy={"specific": {"versions": [1, 3]}},
            input=[
                {
                    "name": "INPUT0",
                    "data_type": "TYPE_FP32",
                    "format": "FORMAT_NCHW",
                    "dims": [3, -1],
                    "reshape": {"shape": [3]},
                    "optional": True,
                }
            ],
            output=[
                {
                    "name": "OUTPUT0",
                    "data_type": "TYPE_BF16",
                    "dims": [10],
                    "label_filename": "labels.txt",
                }
            ],
            dynamic_batching={
                "preferred_batch_size": [4, 8],
                "max_queue_delay_microseconds": 100,
                "priority_queue_policy": {2: {"timeout_action": "DELAY"}},
            },
            instance_group=[{"name": "g", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}],
            optimization={
                "cuda": {
                    "graphs": True,
                    "graph_spec": [{"batch_size": 4, "input": {"INPUT0": {"dim": [3, 224]}}}],
                }
            },
            parameters={"weights": {"string_value": "w.safetensors"}},
            model_warmup=[
                {
                    "name": "w",
                    "batch_size": 1,
                    "inputs": {
                        "INPUT0": {"data_type": "TYPE_FP32", "dims": [3], "zero_data": True}
                    },
                }
            ],
            metric_tags={"team": "ml"},
        )
    ),
    "ModelConfigResponse(ensemble)": lambda svc, cfg: svc.ModelConfigResponse(
        config=cfg.ModelConfig(
            name="pipeline",
            platform="ensemble",
            ensemble_scheduling={
                "step": [
                    {
                        "model_name": "a",
                        "model_version": -1,
                        "input_map": {"x": "IN"},
                        "output_map": {"y": "OUT"},
                    }
                ]
            },
        ),
    ),
    "RepositoryIndexResponse": lambda svc, cfg: svc.RepositoryIndexResponse(
        models=[
            {"name": "a", "version": "1", "state": "READY"},
            {"name": "b", "state": "UNAVAILABLE", "reason": "unloaded"},
        ]
    ),
    "ModelStatisticsResponse": lambda svc, cfg: svc.ModelStatisticsResponse(
        model_stats=[
            {
                "name": "a",
                "version": "1",
                "last_inference": 1_700_000_000_000,
                "inference_count": 10,
                "execution_count": 4,
                "inference_stats": {
                    "success": {"count": 10, "ns": 12345},
                    "queue": {"count": 10, "ns": 99},
                    "fail": {"count": 1, "ns": 7},
                },
                "batch_stats": [{"batch_size": 4, "compute_infer": {"count": 2, "ns": 500}}],
                "memory_usage": [{"type": "GPU", "id": 0, "byte_size": 1 << 30}],
                "response_stats": {"r": {"compute_output": {"count": 1, "ns": 2}}},
            }
        ]
    ),
    "SystemSharedMemoryRegisterRequest": lambda svc, cfg: svc.SystemSharedMemoryRegisterRequest(
        name="region0", key="/shm0", offset=64, byte_size=4096
    ),
}


def assert_same(a, b, path):
    """Field-by-field comparison of two messages that may come from different pools."""
    fields_a, fields_b = a.ListFields(), b.ListFields()
    names = [[(f.number, f.name) for f, _ in fields] for fields in (fields_a, fields_b)]
    assert names[0] == names[1], path
    for (field, va), (_, vb) in zip(fields_a, fields_b, strict=True):
        where = f"{path}.{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            assert sorted(va) == sorted(vb), where
            value_field = field.message_type.fields_by_name["value"]
            for key in va:
                assert_value(value_field, va[key], vb[key], f"{where}[{key!r}]")
        elif field.is_repeated:
            assert len(va) == len(vb), where
            for i, (x, y) in enumerate(zip(va, vb, strict=True)):
                assert_value(field, x, y, f"{where}[{i}]")
        else:
            assert_value(field, va, vb, where)


def assert_value(field, x, y, where):
    if field.message_type is not None:
        assert_same(x, y, where)
    else:
        assert x == y, where


@pytest.mark.parametrize("direction", ["triton->ours", "ours->triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_wire_compatible(case, direction):
    src, dst = ((t_svc, t_cfg), (o_svc, o_cfg))[:: 1 if direction == "triton->ours" else -1]
    sent = CASES[case](*src)
    received = getattr(dst[0], type(sent).__name__).FromString(sent.SerializeToString())
    assert type(received) is not type(sent)  # separate descriptor pools, separate classes
    assert_same(sent, received, case)
    # Same bytes back: nothing was dropped as an unknown or mis-typed field.
    assert received.SerializeToString(deterministic=True) == sent.SerializeToString(
        deterministic=True
    )


def test_service_methods_match_triton():
    theirs = t_svc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    ours = o_svc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    stub_methods = grpc_service_grpc.GRPCInferenceServiceServicer().service.methods
    for method in theirs.methods:
        mine = ours.methods_by_name.get(method.name)
        assert mine is not None, method.name
        assert mine.input_type.full_name == method.input_type.full_name, method.name
        assert mine.output_type.full_name == method.output_type.full_name, method.name
        assert (mine.client_streaming, mine.server_streaming) == (
            method.client_streaming,
            method.server_streaming,
        ), method.name
        # The purerpc servicer serves it with our classes for those message types.
        signature = stub_methods[method.name].signature
        assert signature.request_type.DESCRIPTOR.full_name == method.input_type.full_name
        assert signature.response_type.DESCRIPTOR.full_name == method.output_type.full_name


@pytest.mark.parametrize("ours, theirs", [(o_svc, t_svc), (o_cfg, t_cfg)])
def test_descriptors_identical_to_triton(ours, theirs):
    """Whole-file check: only the file name and import path differ from tritonclient's.

    Fails after a tritonclient upgrade that changes Triton's protocol: sync proto/inference.
    """

    def load(module):
        proto = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        proto.name = Path(proto.name).name
        proto.dependency[:] = [Path(d).name for d in proto.dependency]
        return proto

    assert load(ours) == load(theirs)
