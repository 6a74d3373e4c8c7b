"""The patterns of Triton's standard Python gRPC client examples (triton-inference-server/
client, src/python/examples), run unchanged against an rsrv worker serving the same models
(``simple``, ``simple_string``, see support/bundles.py). Only the reporting differs:
the examples print and ``sys.exit(1)``, these assert. The shared-memory examples are in
test_shm_e2e.py.

* simple_grpc_health_metadata.py
* simple_grpc_infer_client.py (also with its gzip / deflate compression option)
* simple_grpc_async_infer_client.py
* the streaming pattern of simple_grpc_sequence_stream_infer_client.py, without sequence
  parameters (rsrv has no sequence batcher)
* simple_grpc_string_infer_client.py (the simple_string part)
* grpc_image_client.py: its ``parse_model`` of the model's metadata and config (the
  ``image`` bundle, an ``nchw`` input); its ``class_count`` request needs the
  classification extension, which rsrv does not have, so the test sends a plain request
* grpc_explicit_int_content_client.py and grpc_explicit_byte_content_client.py (plain
  grpc stubs, typed contents; the request building and response reading the two share
  are written once, in :func:`explicit_request` and :func:`explicit_results`)
"""

from __future__ import annotations

import queue
import time
from functools import partial

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import IMAGE_W, make_repo
from support.serving import running, url, worker_config
from tritonclient import utils
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, cache_dir):
    repo = make_repo(tmp_path_factory.mktemp("triton") / "repo", "simple", "simple_string", "image")
    with running(worker_config(repo, cache_dir)) as worker:
        yield url(worker)


def test_simple_grpc_health_metadata(server_url):
    triton_client = grpcclient.InferenceServerClient(url=server_url, verbose=False)
    model_name = "simple"

    assert triton_client.is_server_live(headers={"test": "1", "dummy": "2"})
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready(model_name)

    metadata = triton_client.get_server_metadata()
    assert metadata.name == "rsrv"  # the example expects "triton"

    metadata = triton_client.get_model_metadata(model_name, headers={"test": "1", "dummy": "2"})
    assert metadata.name == model_name

    # Passing incorrect model name: the example's own check
    with pytest.raises(InferenceServerException) as info:
        triton_client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in info.value.message()

    config = triton_client.get_model_config(model_name)
    assert config.config.name == model_name


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_simple_grpc_infer_client(server_url, compression):
    triton_client = grpcclient.InferenceServerClient(
        url=server_url,
        verbose=False,
        ssl=False,
        root_certificates=None,
        private_key=None,
        certificate_chain=None,
    )
    model_name = "simple"

    inputs = []
    outputs = []
    inputs.append(grpcclient.InferInput("INPUT0", [1, 16], "INT32"))
    inputs.append(grpcclient.InferInput("INPUT1", [1, 16], "INT32"))

    input0_data = np.arange(start=0, stop=16, dtype=np.int32)
    input0_data = np.expand_dims(input0_data, axis=0)
    input1_data = np.ones(shape=(1, 16), dtype=np.int32)

    inputs[0].set_data_from_numpy(input0_data)
    inputs[1].set_data_from_numpy(input1_data)

    outputs.append(grpcclient.InferRequestedOutput("OUTPUT0"))
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT1"))

    # Test with outputs
    results = triton_client.infer(
        model_name=model_name,
        inputs=inputs,
        outputs=outputs,
        client_timeout=None,
        headers={"test": "1"},
        compression_algorithm=compression,
    )

    statistics = triton_client.get_inference_statistics(model_name=model_name)
    assert len(statistics.model_stats) == 1, "FAILED: Inference Statistics"

    output0_data = results.as_numpy("OUTPUT0")
    output1_data = results.as_numpy("OUTPUT1")
    for i in range(16):
        assert input0_data[0][i] + input1_data[0][i] == output0_data[0][i], "incorrect sum"
        assert input0_data[0][i] - input1_data[0][i] == output1_data[0][i], "incorrect diff"

    # Test with no outputs
    results = triton_client.infer(
        model_name=model_name, inputs=inputs, outputs=None, compression_algorithm=compression
    )
    output0_data = results.as_numpy("OUTPUT0")
    output1_data = results.as_numpy("OUTPUT1")
    for i in range(16):
        assert input0_data[0][i] + input1_data[0][i] == output0_data[0][i], "incorrect sum"
        assert input0_data[0][i] - input1_data[0][i] == output1_data[0][i], "incorrect diff"


def test_simple_grpc_async_infer_client(server_url):
    triton_client = grpcclient.InferenceServerClient(url=server_url, verbose=False)
    model_name = "simple"

    inputs = []
    outputs = []
    inputs.append(grpcclient.InferInput("INPUT0", [1, 16], "INT32"))
    inputs.append(grpcclient.InferInput("INPUT1", [1, 16], "INT32"))
    input0_data = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    input1_data = np.ones(shape=(1, 16), dtype=np.int32)
    inputs[0].set_data_from_numpy(input0_data)
    inputs[1].set_data_from_numpy(input1_data)
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT0"))
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT1"))

    def callback(user_data, result, error):
        if error:
            user_data.append(error)
        else:
            user_data.append(result)

    user_data = []
    triton_client.async_infer(
        model_name=model_name,
        inputs=inputs,
        callback=partial(callback, user_data),
        outputs=outputs,
        client_timeout=None,
    )

    # Wait until the results are available in user_data (the example polls each second;
    # a generous bound here, for a loaded test machine)
    time_out = 600
    while (len(user_data) == 0) and time_out > 0:
        time_out = time_out - 1
        time.sleep(0.1)

    assert len(user_data) == 1
    assert not isinstance(user_data[0], InferenceServerException), user_data[0]
    output0_data = user_data[0].as_numpy("OUTPUT0")
    output1_data = user_data[0].as_numpy("OUTPUT1")
    for i in range(16):
        assert input0_data[0][i] + input1_data[0][i] == output0_data[0][i], "incorrect sum"
        assert input0_data[0][i] - input1_data[0][i] == output1_data[0][i], "incorrect diff"


class UserData:
    def __init__(self):
        self._completed_requests = queue.Queue()


def stream_callback(user_data, result, error):
    if error:
        user_data._completed_requests.put(error)
    else:
        user_data._completed_requests.put(result)


def async_stream_send(triton_client, values, batch_size, stream_id, model_name):
    count = 1
    for value in values:
        value_data = np.full(shape=[batch_size, 16], fill_value=value, dtype=np.int32)
        inputs = []
        inputs.append(grpcclient.InferInput("INPUT0", value_data.shape, "INT32"))
        inputs.append(grpcclient.InferInput("INPUT1", value_data.shape, "INT32"))
        inputs[0].set_data_from_numpy(value_data)
        inputs[1].set_data_from_numpy(np.ones_like(value_data))
        outputs = []
        outputs.append(grpcclient.InferRequestedOutput("OUTPUT0"))
        triton_client.async_stream_infer(
            model_name=model_name, inputs=inputs, outputs=outputs, request_id=f"{stream_id}_{count}"
        )
        count = count + 1


def test_simple_grpc_stream_infer_client(server_url):
    model_name = "simple"
    values = [11, 7, 5, 3, 2, 0, 1]
    stream_id0, stream_id1 = 1000, 1001
    result0_list, result1_list = {}, {}
    user_data = UserData()

    # As the example advises, the client is used within a with-clause for streaming.
    with grpcclient.InferenceServerClient(url=server_url, verbose=False) as triton_client:
        triton_client.start_stream(
            callback=partial(stream_callback, user_data), stream_timeout=None
        )
        async_stream_send(triton_client, [0] + values, 1, stream_id0, model_name)
        async_stream_send(
            triton_client, [100] + [-1 * v for v in values], 2, stream_id1, model_name
        )

        recv_count = 0
        while recv_count < 2 * (len(values) + 1):
            data_item = user_data._completed_requests.get(timeout=60)
            assert not isinstance(data_item, InferenceServerException), data_item
            this_id, count = data_item.get_response().id.split("_")
            if int(this_id) == stream_id0:
                result0_list[int(count)] = data_item.as_numpy("OUTPUT0")
            elif int(this_id) == stream_id1:
                result1_list[int(count)] = data_item.as_numpy("OUTPUT0")
            else:
                pytest.fail(f"unexpected stream id returned by the server: {this_id}")
            recv_count = recv_count + 1

    for i, value in enumerate([0] + values):
        assert result0_list[i + 1].shape == (1, 16)
        assert (result0_list[i + 1] == value + 1).all()
    for i, value in enumerate([100] + [-1 * v for v in values]):
        assert result1_list[i + 1].shape == (2, 16)
        assert (result1_list[i + 1] == value + 1).all()


def test_simple_grpc_string_infer_client(server_url):
    triton_client = grpcclient.InferenceServerClient(url=server_url, verbose=False)
    model_name = "simple_string"

    inputs = []
    outputs = []
    inputs.append(grpcclient.InferInput("INPUT0", [1, 16], "BYTES"))
    inputs.append(grpcclient.InferInput("INPUT1", [1, 16], "BYTES"))

    in0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    in1 = np.ones(shape=(1, 16), dtype=np.int32)
    expected_sum = np.add(in0, in1)
    expected_diff = np.subtract(in0, in1)

    in0n = np.array([str(x).encode("utf-8") for x in in0.reshape(in0.size)], dtype=np.object_)
    input0_data = in0n.reshape(in0.shape)
    in1n = np.array([str(x).encode("utf-8") for x in in1.reshape(in1.size)], dtype=np.object_)
    input1_data = in1n.reshape(in1.shape)

    inputs[0].set_data_from_numpy(input0_data)
    inputs[1].set_data_from_numpy(input1_data)

    outputs.append(grpcclient.InferRequestedOutput("OUTPUT0"))
    outputs.append(grpcclient.InferRequestedOutput("OUTPUT1"))

    results = triton_client.infer(model_name=model_name, inputs=inputs, outputs=outputs)

    output0_data = results.as_numpy("OUTPUT0")
    output1_data = results.as_numpy("OUTPUT1")
    assert output0_data.dtype == np.object_ and output0_data.shape == (1, 16)
    for i in range(16):
        r0 = int(output0_data[0][i])
        r1 = int(output1_data[0][i])
        assert expected_sum[0][i] == r0, "incorrect sum"
        assert expected_diff[0][i] == r1, "incorrect difference"


def explicit_request(model_name, datatype, field, input0_data, input1_data):
    """The request both explicit-content examples build: INPUT0 and INPUT1 [1, 16] as
    typed ``contents.<field>``, OUTPUT0 and OUTPUT1 requested."""
    request = service_pb2.ModelInferRequest()
    request.model_name = model_name
    request.model_version = ""

    for name, data in (("INPUT0", input0_data), ("INPUT1", input1_data)):
        tensor = service_pb2.ModelInferRequest().InferInputTensor()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend([1, 16])
        getattr(tensor.contents, field).extend(data)
        request.inputs.extend([tensor])

    for name in ("OUTPUT0", "OUTPUT1"):
        output = service_pb2.ModelInferRequest().InferRequestedOutputTensor()
        output.name = name
        request.outputs.extend([output])
    return request


def explicit_results(response, decode) -> list:
    """The examples' reading of the response: each raw output decoded, then shaped."""
    output_results = []
    for index, output in enumerate(response.outputs):
        shape = list(output.shape)
        output_results.append(decode(response.raw_output_contents[index]))
        output_results[-1] = np.resize(output_results[-1], shape)
    assert len(output_results) == 2, "expected two output results"
    return output_results


def test_grpc_explicit_int_content_client(server_url):
    channel = grpc.insecure_channel(server_url)
    grpc_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    input0_data = [i for i in range(16)]
    input1_data = [1 for i in range(16)]
    request = explicit_request("simple", "INT32", "int_contents", input0_data, input1_data)

    response = grpc_stub.ModelInfer(request)

    output_results = explicit_results(response, lambda raw: np.frombuffer(raw, dtype=np.int32))
    for i in range(16):
        assert input0_data[i] + input1_data[i] == output_results[0][0][i], "incorrect sum"
        assert input0_data[i] - input1_data[i] == output_results[1][0][i], "incorrect diff"

    # Populating additional content field should generate an error
    request.raw_input_contents.extend([np.array(input0_data[0:8]).tobytes()])
    request.inputs[0].contents.int_contents[:] = input0_data[8:]
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ModelInfer(request)
    # the example's own check, word for word
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "contents field must not be specified when using "
        "raw_input_contents for 'INPUT0' for model 'simple'" in info.value.details()
    )
    channel.close()


def test_grpc_explicit_byte_content_client(server_url):
    channel = grpc.insecure_channel(server_url)
    grpc_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    input0_data = [f"{i}".encode() for i in range(16)]
    input1_data = [b"1" for _ in range(16)]
    request = explicit_request("simple_string", "BYTES", "bytes_contents", input0_data, input1_data)

    response = grpc_stub.ModelInfer(request)

    output_results = explicit_results(response, utils.deserialize_bytes_tensor)
    for i in range(16):
        assert i + 1 == int(output_results[0][0][i]), "incorrect sum"
        assert i - 1 == int(output_results[1][0][i]), "incorrect difference"
    channel.close()


def parse_model(model_metadata, model_config):
    """grpc_image_client.py's parse_model, as the example has it (its exceptions kept)."""
    if len(model_metadata.inputs) != 1:
        raise Exception(f"expecting 1 input, got {len(model_metadata.inputs)}")
    if len(model_metadata.outputs) != 1:
        raise Exception(f"expecting 1 output, got {len(model_metadata.outputs)}")

    if len(model_config.input) != 1:
        raise Exception(f"expecting 1 input in model configuration, got {len(model_config.input)}")

    input_metadata = model_metadata.inputs[0]
    input_config = model_config.input[0]
    output_metadata = model_metadata.outputs[0]

    if output_metadata.datatype != "FP32":
        raise Exception(
            "expecting output datatype to be FP32, model '"
            + model_metadata.name
            + "' output type is "
            + output_metadata.datatype
        )

    # Output is expected to be a vector. But allow any number of
    # dimensions as long as all but 1 is size 1 (e.g. { 10 }, { 1, 10
    # }, { 10, 1, 1 } are all ok). Ignore the batch dimension if there
    # is one.
    output_batch_dim = model_config.max_batch_size > 0
    non_one_cnt = 0
    for dim in output_metadata.shape:
        if output_batch_dim:
            output_batch_dim = False
        elif dim > 1:
            non_one_cnt += 1
            if non_one_cnt > 1:
                raise Exception("expecting model output to be a vector")

    # Model input must have 3 dims, either CHW or HWC (not counting
    # the batch dimension), either CHW or HWC
    input_batch_dim = model_config.max_batch_size > 0
    expected_input_dims = 3 + (1 if input_batch_dim else 0)
    if len(input_metadata.shape) != expected_input_dims:
        raise Exception(
            f"expecting input to have {expected_input_dims} dimensions, model "
            f"'{model_metadata.name}' input has {len(input_metadata.shape)}"
        )

    if type(input_config.format) == str:  # noqa: E721 - the example's own test
        FORMAT_ENUM_TO_INT = dict(mc.ModelInput.Format.items())
        input_config.format = FORMAT_ENUM_TO_INT[input_config.format]

    if (input_config.format != mc.ModelInput.FORMAT_NCHW) and (
        input_config.format != mc.ModelInput.FORMAT_NHWC
    ):
        raise Exception(
            "unexpected input format "
            + mc.ModelInput.Format.Name(input_config.format)
            + ", expecting "
            + mc.ModelInput.Format.Name(mc.ModelInput.FORMAT_NCHW)
            + " or "
            + mc.ModelInput.Format.Name(mc.ModelInput.FORMAT_NHWC)
        )

    if input_config.format == mc.ModelInput.FORMAT_NHWC:
        h = input_metadata.shape[1 if input_batch_dim else 0]
        w = input_metadata.shape[2 if input_batch_dim else 1]
        c = input_metadata.shape[3 if input_batch_dim else 2]
    else:
        c = input_metadata.shape[1 if input_batch_dim else 0]
        h = input_metadata.shape[2 if input_batch_dim else 1]
        w = input_metadata.shape[3 if input_batch_dim else 2]

    return (
        model_config.max_batch_size,
        input_metadata.name,
        output_metadata.name,
        c,
        h,
        w,
        input_config.format,
        input_metadata.datatype,
    )


def test_grpc_image_client_parse_model(server_url):
    triton_client = grpcclient.InferenceServerClient(url=server_url, verbose=False)
    model_metadata = triton_client.get_model_metadata(model_name="image", model_version="")
    model_config = triton_client.get_model_config(model_name="image", model_version="").config
    parsed = parse_model(model_metadata, model_config)
    assert parsed == (4, "x", "scores", 3, 8, 8, mc.ModelInput.FORMAT_NCHW, "FP32")
    max_batch_size, input_name, output_name, c, h, w, _, dtype = parsed

    # a batch laid out as the config says (the example's own request asks for
    # class_count, which needs the classification extension)
    batch = np.random.default_rng(0).random((max_batch_size, c, h, w), np.float32)
    inputs = [grpcclient.InferInput(input_name, list(batch.shape), dtype)]
    inputs[0].set_data_from_numpy(batch)
    outputs = [grpcclient.InferRequestedOutput(output_name)]
    scores = triton_client.infer("image", inputs, outputs=outputs).as_numpy(output_name)
    np.testing.assert_allclose(scores, batch.mean(axis=(2, 3)) @ IMAGE_W, rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer(
            "image", inputs, outputs=[grpcclient.InferRequestedOutput(output_name, class_count=2)]
        )
    assert "the classification extension is not supported" in info.value.message()

    as_json = triton_client.get_model_config(model_name="image", as_json=True)["config"]
    assert as_json["input"][0]["format"] == "FORMAT_NCHW"  # what the example reads over HTTP
