"""System shared memory end to end, with tritonclient.utils.shared_memory against a real
worker: Triton's simple_grpc_shm_client and simple_grpc_shm_string_client patterns
(inputs AND outputs in shared memory), the SystemSharedMemory* RPCs, every bad use (each a
precise status and a message naming the region and the tensor), the configuration switch,
and release of every registration at shutdown.

POSIX shared-memory keys carry a random suffix: /dev/shm is shared by everything on the
machine.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from support.bundles import make_repo
from support.clients import connect, infer_input, raises_status
from support.serving import hook_globals, running, url, worker_config
from support.waiting import wait_until
from tritonclient import utils
from tritonclient.grpc import service_pb2


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("shm") / "repo", "simple", "simple_string", "slow")


@pytest.fixture
def triton(worker):
    c = connect(worker)
    yield c
    c.unregister_system_shared_memory()
    c.close()


def key(name: str) -> str:
    return f"/{name}_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def regions():
    """Create POSIX shared-memory regions; every one is destroyed afterwards."""
    made = []

    def create(name: str, byte_size: int):
        handle = shm.create_shared_memory_region(name, key(name), byte_size)
        made.append(handle)
        return handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def shm_key(handle) -> str:
    return handle._shm_key


# -- Triton's examples ----------------------------------------------------------------------------


def test_simple_grpc_shm_client(worker, regions):
    """simple_grpc_shm_client.py, unchanged but for the keys and the reporting."""
    triton_client = grpcclient.InferenceServerClient(url=url(worker), verbose=False)

    # To make sure no shared memory regions are registered with the server.
    triton_client.unregister_system_shared_memory()
    triton_client.unregister_cuda_shared_memory()

    model_name = "simple"
    input0_data = np.arange(start=0, stop=16, dtype=np.int32)
    input1_data = np.ones(shape=16, dtype=np.int32)
    input_byte_size = input0_data.size * input0_data.itemsize
    output_byte_size = input_byte_size

    shm_op_handle = regions("output_data", output_byte_size * 2)
    triton_client.register_system_shared_memory(
        "output_data", shm_key(shm_op_handle), output_byte_size * 2
    )

    shm_ip_handle = regions("input_data", input_byte_size * 2)
    shm.set_shared_memory_region(shm_ip_handle, [input0_data])
    shm.set_shared_memory_region(shm_ip_handle, [input1_data], offset=input_byte_size)
    triton_client.register_system_shared_memory(
        "input_data", shm_key(shm_ip_handle), input_byte_size * 2
    )

    inputs = []
    inputs.append(grpcclient.InferInput("INPUT0", [1, 16], "INT32"))
    inputs[-1].set_shared_memory("input_data", input_byte_size)
    inputs.append(grpcclient.InferInput("INPUT1", [1, 16], "INT32"))
    inputs[-1].set_shared_memory("input_data", input_byte_size, offset=input_byte_size)

    outputs = []
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT0"))
    outputs[-1].set_shared_memory("output_data", output_byte_size)
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT1"))
    outputs[-1].set_shared_memory("output_data", output_byte_size, offset=output_byte_size)

    results = triton_client.infer(model_name=model_name, inputs=inputs, outputs=outputs)

    output0 = results.get_output("OUTPUT0")
    assert output0 is not None, "OUTPUT0 is missing in the response."
    output0_data = shm.get_contents_as_numpy(
        shm_op_handle, utils.triton_to_np_dtype(output0.datatype), output0.shape
    )
    output1 = results.get_output("OUTPUT1")
    assert output1 is not None, "OUTPUT1 is missing in the response."
    output1_data = shm.get_contents_as_numpy(
        shm_op_handle,
        utils.triton_to_np_dtype(output1.datatype),
        output1.shape,
        offset=output_byte_size,
    )

    for i in range(16):
        assert input0_data[i] + input1_data[i] == output0_data[0][i], "incorrect sum"
        assert input0_data[i] - input1_data[i] == output1_data[0][i], "incorrect difference"

    status = triton_client.get_system_shared_memory_status()
    assert sorted(status.regions) == ["input_data", "output_data"]
    triton_client.unregister_system_shared_memory()
    assert len(triton_client.get_system_shared_memory_status().regions) == 0
    triton_client.close()


def test_simple_grpc_shm_string_client(worker, regions):
    """simple_grpc_shm_string_client.py: BYTES tensors in and out of shared memory."""
    triton_client = grpcclient.InferenceServerClient(url=url(worker), verbose=False)
    triton_client.unregister_system_shared_memory()
    triton_client.unregister_cuda_shared_memory()

    model_name = "simple_string"
    in0 = np.arange(start=0, stop=16, dtype=np.int32)
    in0n = np.array([str(x).encode("utf-8") for x in in0.flatten()], dtype=object)
    input0_data = in0n.reshape(in0.shape)
    in1 = np.ones(shape=16, dtype=np.int32)
    in1n = np.array([str(x).encode("utf-8") for x in in1.flatten()], dtype=object)
    input1_data = in1n.reshape(in1.shape)

    expected_sum = np.array(
        [str(x).encode("utf-8") for x in np.add(in0, in1).flatten()], dtype=object
    )
    expected_diff = np.array(
        [str(x).encode("utf-8") for x in np.subtract(in0, in1).flatten()], dtype=object
    )
    expected_sum_serialized = utils.serialize_byte_tensor(expected_sum)
    expected_diff_serialized = utils.serialize_byte_tensor(expected_diff)

    input0_data_serialized = utils.serialize_byte_tensor(input0_data)
    input1_data_serialized = utils.serialize_byte_tensor(input1_data)
    input0_byte_size = utils.serialized_byte_size(input0_data_serialized)
    input1_byte_size = utils.serialized_byte_size(input1_data_serialized)
    output0_byte_size = utils.serialized_byte_size(expected_sum_serialized)
    output1_byte_size = utils.serialized_byte_size(expected_diff_serialized)

    shm_op0_handle = regions("output0_data", output0_byte_size)
    shm_op1_handle = regions("output1_data", output1_byte_size)
    triton_client.register_system_shared_memory(
        "output0_data", shm_key(shm_op0_handle), output0_byte_size
    )
    triton_client.register_system_shared_memory(
        "output1_data", shm_key(shm_op1_handle), output1_byte_size
    )

    shm_ip0_handle = regions("input0_data", input0_byte_size)
    shm_ip1_handle = regions("input1_data", input1_byte_size)
    shm.set_shared_memory_region(shm_ip0_handle, [input0_data_serialized])
    shm.set_shared_memory_region(shm_ip1_handle, [input1_data_serialized])
    triton_client.register_system_shared_memory(
        "input0_data", shm_key(shm_ip0_handle), input0_byte_size
    )
    triton_client.register_system_shared_memory(
        "input1_data", shm_key(shm_ip1_handle), input1_byte_size
    )

    inputs = []
    inputs.append(grpcclient.InferInput("INPUT0", [1, 16], "BYTES"))
    inputs[-1].set_shared_memory("input0_data", input0_byte_size)
    inputs.append(grpcclient.InferInput("INPUT1", [1, 16], "BYTES"))
    inputs[-1].set_shared_memory("input1_data", input1_byte_size)

    outputs = []
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT0"))
    outputs[-1].set_shared_memory("output0_data", output0_byte_size)
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT1"))
    outputs[-1].set_shared_memory("output1_data", output1_byte_size)

    results = triton_client.infer(model_name=model_name, inputs=inputs, outputs=outputs)

    output0 = results.get_output("OUTPUT0")
    assert output0 is not None
    output0_data = shm.get_contents_as_numpy(
        shm_op0_handle, utils.triton_to_np_dtype(output0.datatype), output0.shape
    )
    output1 = results.get_output("OUTPUT1")
    assert output1 is not None
    output1_data = shm.get_contents_as_numpy(
        shm_op1_handle, utils.triton_to_np_dtype(output1.datatype), output1.shape
    )

    for i in range(16):
        assert expected_sum[i] == output0_data[0][i], "incorrect sum"
        assert expected_diff[i] == output1_data[0][i], "incorrect difference"

    assert len(triton_client.get_system_shared_memory_status().regions) == 4
    triton_client.unregister_system_shared_memory()
    triton_client.close()


# -- the RPCs ------------------------------------------------------------------------------------


def test_register_status_unregister(triton, regions):
    handle = regions("rpc", 256)
    triton.register_system_shared_memory("rpc_a", shm_key(handle), 128)
    triton.register_system_shared_memory("rpc_b", shm_key(handle), 64, offset=128)

    status = triton.get_system_shared_memory_status()
    assert {name: (r.name, r.key, r.offset, r.byte_size) for name, r in status.regions.items()} == {
        "rpc_a": ("rpc_a", shm_key(handle), 0, 128),
        "rpc_b": ("rpc_b", shm_key(handle), 128, 64),
    }
    one = triton.get_system_shared_memory_status("rpc_b")
    assert list(one.regions) == ["rpc_b"]
    as_json = triton.get_system_shared_memory_status(as_json=True)
    assert sorted(as_json["regions"]) == ["rpc_a", "rpc_b"]

    with raises_status("NOT_FOUND", "Unable to find system shared memory region: 'nope'"):
        triton.get_system_shared_memory_status("nope")
    with raises_status("ALREADY_EXISTS", "shared memory region 'rpc_a' already in manager"):
        triton.register_system_shared_memory("rpc_a", shm_key(handle), 16)

    triton.unregister_system_shared_memory("rpc_a")
    triton.unregister_system_shared_memory("nope")  # unknown: fine
    assert list(triton.get_system_shared_memory_status().regions) == ["rpc_b"]
    triton.register_system_shared_memory("rpc_a", shm_key(handle), 16)  # the name is free
    triton.unregister_system_shared_memory()
    assert len(triton.get_system_shared_memory_status().regions) == 0


@pytest.mark.parametrize(
    ("key_of", "offset", "size", "message"),
    [
        (lambda k: "/../../etc/passwd", 0, 16, "invalid shm key"),
        (lambda k: "dir/name", 0, 16, "invalid shm key"),
        (lambda k: "", 0, 16, "invalid shm key"),
        (
            lambda k: f"/no_such_object_{uuid.uuid4().hex}",
            0,
            16,
            "Unable to open shared memory region: '/no_such_object_",
        ),
        (
            lambda k: k,
            0,
            1024,
            "offset 0 + byte_size 1024 exceeds the size 256 of shared memory object",
        ),
        (lambda k: k, 200, 100, "offset 200 + byte_size 100 exceeds the size 256"),
        (lambda k: k, 0, 0, "byte_size 0 must be > 0"),
    ],
)
def test_register_rejects(triton, regions, key_of, offset, size, message):
    handle = regions("bad", 256)
    with raises_status("INVALID_ARGUMENT", message):
        triton.register_system_shared_memory("bad", key_of(shm_key(handle)), size, offset=offset)
    assert len(triton.get_system_shared_memory_status().regions) == 0


# -- bad use in inference ----------------------------------------------------------------------


def simple_shm_inputs(region: str, size0=64, size1=64, offset0=0, offset1=64):
    inputs = [
        grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(region, size0, offset=offset0)
    inputs[1].set_shared_memory(region, size1, offset=offset1)
    return inputs


@pytest.fixture
def simple_region(triton, regions):
    """Region "in" (128 bytes: INPUT0 then INPUT1) and "out" (128 bytes)."""
    handle = regions("in", 128)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    shm.set_shared_memory_region(handle, [np.full(16, 2, np.int32)], offset=64)
    triton.register_system_shared_memory("in", shm_key(handle), 128)
    out = regions("out", 128)
    triton.register_system_shared_memory("out", shm_key(out), 128)
    return handle, out


@pytest.mark.parametrize(
    ("code", "inputs", "input_error", "output", "output_error"),
    [
        pytest.param(  # Triton's message for the same mistake: tritonclient users know it
            "NOT_FOUND",
            {"region": "nope"},
            [
                "Unable to find shared memory region: 'nope'",
                "input tensor 'INPUT0' for model 'simple'",
            ],
            ("nope", 64, 0),
            [
                "Unable to find shared memory region: 'nope'",
                "output tensor 'OUTPUT0' for model 'simple'",
            ],
            id="unregistered region",
        ),
        pytest.param(
            "INVALID_ARGUMENT",
            {"region": "in", "offset1": 96},
            [
                "Invalid offset + byte size for shared memory region: 'in'",
                "offset 96 + byte size 64 exceeds the region's 128 bytes",
                "input tensor 'INPUT1' for model 'simple'",
            ],
            ("out", 64, 100),
            [
                "Invalid offset + byte size for shared memory region: 'out'",
                "output tensor 'OUTPUT0' for model 'simple'",
            ],
            id="offset and size beyond the region",
        ),
        pytest.param(
            "INVALID_ARGUMENT",
            {"region": "in", "size0": 60},
            [
                "input tensor 'INPUT0' for model 'simple': shared_memory_byte_size of region "
                "'in' holds 60 bytes but shape [1, 16] of INT32 needs 16 x 4 = 64"
            ],
            ("out", 32, 0),
            [
                "output tensor 'OUTPUT0' for model 'simple' needs 64 bytes but its "
                "shared_memory_byte_size in region 'out' is 32"
            ],
            id="byte size must match the tensor",
        ),
    ],
)
def test_bad_region_use(triton, simple_region, code, inputs, input_error, output, output_error):
    """Each mistake made for an input, then for an output (with good inputs): a precise
    status, and a message naming the region and the tensor of model 'simple'."""
    with raises_status(code, *input_error):
        triton.infer("simple", simple_shm_inputs(**inputs))
    region, size, offset = output
    requested = grpcclient.InferRequestedOutput("OUTPUT0")
    requested.set_shared_memory(region, size, offset=offset)
    with raises_status(code, *output_error):
        triton.infer("simple", simple_shm_inputs("in"), outputs=[requested])


def test_shared_memory_with_raw_and_output_offsets(triton, simple_region):
    """One input in shared memory and one sent raw; one output in shared memory at an
    offset, one returned raw; the region is read at request time."""
    handle, out = simple_region
    shm_input = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    shm_input.set_shared_memory("in", 64)
    raw_input = infer_input("INPUT1", np.full((1, 16), 5, np.int32))
    in_shm = grpcclient.InferRequestedOutput("OUTPUT1")
    in_shm.set_shared_memory("out", 64, offset=64)
    raw = grpcclient.InferRequestedOutput("OUTPUT0")
    result = triton.infer("simple", [shm_input, raw_input], outputs=[in_shm, raw])

    response = result.get_response()
    assert [o.name for o in response.outputs] == ["OUTPUT1", "OUTPUT0"]
    assert list(response.raw_output_contents)[0] == b""  # its data is in the region
    params = response.outputs[0].parameters
    assert params["shared_memory_region"].string_param == "out"
    assert params["shared_memory_byte_size"].int64_param == 64
    assert params["shared_memory_offset"].int64_param == 64
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(16)[None] + 5)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(out, np.int32, [1, 16], offset=64), np.arange(16)[None] - 5
    )

    shm.set_shared_memory_region(handle, [np.full(16, 100, np.int32)])  # new data, same region
    result = triton.infer("simple", [shm_input, raw_input], outputs=[raw])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 105))


def test_a_request_uses_its_region_as_registered_whatever_becomes_of_the_name(
    worker, triton, regions
):
    """The region unregistered, and its name registered for another client's object,
    while a request using it runs: the request reads and writes the object its client
    registered, as in Triton (which defers the unregister). Its output went to the
    other object, answered OK."""
    mine, other = regions("mine", 64), regions("other", 64)
    triton.register_system_shared_memory("r", shm_key(mine), 64)
    shm.set_shared_memory_region(mine, [np.full((1, 4), 1.0, np.float32)])  # (1 s in slow)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_shared_memory("r", 16)
    y = grpcclient.InferRequestedOutput("y")
    y.set_shared_memory("r", 16, offset=32)
    active = hook_globals(worker, "slow")["ACTIVE"]
    with ThreadPoolExecutor(1) as pool, connect(worker) as client:
        answer = pool.submit(client.infer, "slow", [x], outputs=[y])
        wait_until(lambda: active[0] == 1, what="the request to be in its preprocess")
        triton.unregister_system_shared_memory("r")
        triton.register_system_shared_memory("r", shm_key(other), 64)
        answer.result(timeout=60)
    got = shm.get_contents_as_numpy(mine, np.float32, [1, 4], offset=32)
    np.testing.assert_array_equal(got, np.full((1, 4), 2.0))
    assert not shm.get_contents_as_numpy(other, np.uint8, [64]).any()


def test_shared_memory_with_typed_contents(worker, simple_region):
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name, offset in (("INPUT0", 0), ("INPUT1", 64)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.parameters["shared_memory_region"].string_param = "in"
        tensor.parameters["shared_memory_byte_size"].int64_param = 64
        tensor.parameters["shared_memory_offset"].int64_param = offset
    request.inputs[0].contents.int_contents.extend(range(16))
    with connect(worker) as triton:
        with pytest.raises(grpc.RpcError) as info:
            triton._client_stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "input tensor 'INPUT0' for model 'simple': typed 'contents' must not be set when "
        "the input is in shared memory region 'in'" in info.value.details()
    )


# -- configuration and shutdown ------------------------------------------------------------------


def test_disabled_by_configuration(repo, cache_dir, regions):
    config = worker_config(repo, cache_dir, ENDPOINTS_SYSTEM_SHARED_MEMORY="false")
    with running(config) as w, connect(w) as triton:
        assert "system_shared_memory" not in triton.get_server_metadata().extensions
        handle = regions("off", 128)
        with raises_status(
            "FAILED_PRECONDITION",
            "cannot register shared memory region 'off'",
            "system shared memory is disabled by configuration (endpoints.system_shared_memory)",
        ):
            triton.register_system_shared_memory("off", shm_key(handle), 128)
        assert len(triton.get_system_shared_memory_status().regions) == 0
        triton.unregister_system_shared_memory()  # what the examples call first: fine
        with raises_status(
            "FAILED_PRECONDITION",
            "input tensor 'INPUT0' for model 'simple' uses shared memory region 'off'",
            "disabled by configuration",
        ):
            triton.infer("simple", simple_shm_inputs("off"))


def test_registrations_are_released_at_shutdown(repo, cache_dir, regions):
    handle = regions("bye", 128)
    with running(worker_config(repo, cache_dir)) as w, connect(w) as triton:
        triton.register_system_shared_memory("bye", shm_key(handle), 128)
        assert len(w.shm) == 1
    assert len(w.shm) == 0
