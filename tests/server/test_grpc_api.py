"""The gRPC front door's pieces without a server: the checked-in descriptor set, its wire compatibility
with tritonclient's definitions of the same protocol, tensors in and out, and errors as status codes."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor

from compiler.errors import BadRequestError, NotFoundError, PayloadTooLargeError, UnavailableError
from compiler.models.signature import Signature, TensorSpec
from server.grpc_api import messages as pb
from server.grpc_api.codec import decode_request, encode_response, typed_elements
from server.grpc_api.messages import DESCRIPTOR_SET, POOL, SERVICE
from server.grpc_api.servicer import status_of
from server.v2_codec import InferRequest

SIGNATURE = Signature(
    inputs=(TensorSpec("x", "float32", ("batch", 4)), TensorSpec("ids", "int8", ("batch",))),
    outputs=(TensorSpec("probs", "float32", ("batch", 3)), TensorSpec("half", "float16", ("batch",))),
)
Tensor = pb.ModelInferRequest.InferInputTensor


def test_the_checked_in_descriptor_set_is_what_make_proto_generates(tmp_path):
    out = tmp_path / "inference.binpb"
    proto = DESCRIPTOR_SET.with_suffix(".proto")
    root = proto.parents[2]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(root), f"--descriptor_set_out={out}",
         str(proto.relative_to(root))],
        check=True,
    )  # fmt: skip
    assert out.read_bytes() == DESCRIPTOR_SET.read_bytes(), "run `make proto` and commit inference.binpb"


def _fields(descriptor) -> dict[str, tuple]:
    return {
        f.name: (f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else None)
        for f in descriptor.fields
    }


def _messages(descriptor):
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _messages(nested)


def test_every_message_and_method_matches_tritonclients_definition():
    """A client built on tritonclient's protos (or KServe's, a subset of them) reads and writes our messages."""
    from tritonclient.grpc import service_pb2

    triton_pool = service_pb2.DESCRIPTOR.pool
    file = POOL.FindFileByName("server/grpc_api/inference.proto")
    compared = 0
    for top in file.message_types_by_name.values():
        for ours in _messages(top):
            theirs = triton_pool.FindMessageTypeByName(ours.full_name)
            assert _fields(ours) == {k: v for k, v in _fields(theirs).items() if k in _fields(ours)}, ours.full_name
            assert set(_fields(ours)) <= set(_fields(theirs))
            compared += 1
    assert compared >= 30
    theirs = {m.name: m for m in triton_pool.FindServiceByName(SERVICE).methods}
    for method in POOL.FindServiceByName(SERVICE).methods:
        assert method.input_type.full_name == theirs[method.name].input_type.full_name
        assert method.output_type.full_name == theirs[method.name].output_type.full_name
    # InferParameter keeps the fields Triton added (double, uint64) that KServe's own proto lacks
    parameter = _fields(POOL.FindMessageTypeByName("inference.InferParameter"))
    assert parameter["double_param"][1] == FieldDescriptor.TYPE_DOUBLE


def raw_request(x: np.ndarray, ids: np.ndarray, **fields) -> pb.ModelInferRequest:
    return pb.ModelInferRequest(
        model_name="m",
        inputs=[Tensor(name="x", datatype="FP32", shape=x.shape), Tensor(name="ids", datatype="INT8", shape=ids.shape)],
        raw_input_contents=[x.tobytes(), ids.tobytes()],
        **fields,
    )


def test_raw_and_typed_contents_decode_to_the_same_arrays():
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    ids = np.array([-128, 127], dtype=np.int8)
    raw = decode_request(raw_request(x, ids, id="r1"), SIGNATURE)
    typed_request = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            Tensor(name="x", datatype="FP32", shape=[2, 4], contents={"fp32_contents": x.ravel().tolist()}),
            Tensor(name="ids", datatype="INT8", shape=[2], contents={"int_contents": ids.tolist()}),
        ],
    )
    typed = decode_request(typed_request, SIGNATURE)
    for decoded in (raw, typed):
        np.testing.assert_array_equal(decoded.inputs["x"], x)
        np.testing.assert_array_equal(decoded.inputs["ids"], ids)
        assert decoded.inputs["ids"].dtype == np.int8
    assert raw.id == "r1" and typed.id is None
    assert typed_elements(typed_request) == 10 and typed_elements(raw_request(x, ids)) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.raw_input_contents.pop(), "raw_input_contents has 1 entries for 2 inputs"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 31), "has 31 bytes, not the 32 bytes"),
        (lambda r: r.inputs[0].__setattr__("datatype", "FP64"), "has datatype 'FP64'; the model takes FP32"),
        (lambda r: r.inputs[0].__setattr__("name", "y"), "unknown input 'y'"),
        (lambda r: r.inputs[1].__setattr__("name", "x"), "input 'x' is given twice"),
        (lambda r: r.inputs[0].shape.__setitem__(0, -2), "'shape' must be a list of non-negative integers"),
        (lambda r: r.inputs[0].shape.__setitem__(0, 2**40), "not the 17592186044416 bytes"),
        (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "has contents although the request sends raw"),
        (lambda r: r.outputs.add(name="nope"), "outputs[0] must name one of the model's outputs"),
    ],
)
def test_bad_requests_are_refused_naming_the_problem(change, message):
    request = raw_request(np.zeros((2, 4), np.float32), np.zeros(2, np.int8))
    change(request)
    with pytest.raises(BadRequestError, match=message.replace("(", r"\(").replace("[", r"\[")):
        decode_request(request, SIGNATURE)


@pytest.mark.parametrize(
    ("x", "ids", "message"),
    [
        ({"fp32_contents": [1.0] * 7}, {"int_contents": [0, 0]}, "contents.fp32_contents has 7 values, shape"),
        ({"fp64_contents": [1.0] * 8}, {"int_contents": [0, 0]}, "values go in contents.fp32_contents, not fp64"),
        ({"fp32_contents": [1.0] * 8}, {"int_contents": [0, 300]}, r"values outside \[-128, 127\] for INT8"),
    ],
)
def test_typed_contents_are_checked_like_json(x, ids, message):
    request = pb.ModelInferRequest(
        inputs=[
            Tensor(name="x", datatype="FP32", shape=[2, 4], contents=x),
            Tensor(name="ids", datatype="INT8", shape=[2], contents=ids),
        ]
    )
    with pytest.raises(BadRequestError, match=message):
        decode_request(request, SIGNATURE)


def test_fp16_travels_raw_only():
    signature = Signature(inputs=(TensorSpec("h", "float16", (2,)),), outputs=())
    typed = pb.ModelInferRequest(inputs=[Tensor(name="h", datatype="FP16", shape=[2])])
    with pytest.raises(BadRequestError, match="FP16 tensors travel as raw_input_contents only"):
        decode_request(typed, signature)
    raw = pb.ModelInferRequest(
        inputs=[Tensor(name="h", datatype="FP16", shape=[2])], raw_input_contents=[np.ones(2, np.float16).tobytes()]
    )
    assert decode_request(raw, signature).inputs["h"].dtype == np.float16


def test_responses_answer_in_the_form_of_the_request():
    outputs = {"probs": np.arange(6, dtype=np.float32).reshape(2, 3), "half": np.ones(2, np.float16)}
    asked = InferRequest("r9", {}, outputs=["probs"])
    typed = encode_response("m", 3, asked, outputs, raw=False)
    assert (typed.model_name, typed.model_version, typed.id) == ("m", "3", "r9")
    assert list(typed.outputs[0].shape) == [2, 3] and typed.outputs[0].datatype == "FP32"
    assert list(typed.outputs[0].contents.fp32_contents) == list(range(6)) and not typed.raw_output_contents
    raw = encode_response("m", 3, asked, outputs, raw=True)
    assert np.frombuffer(raw.raw_output_contents[0], np.float32).tolist() == list(range(6))
    assert not raw.outputs[0].HasField("contents")
    # FP16 has no typed field: every output goes raw, as the protocol wants them all one way
    both = encode_response("m", 3, InferRequest(None, {}), outputs, raw=False)
    assert [o.name for o in both.outputs] == ["probs", "half"] and len(both.raw_output_contents) == 2
    assert np.frombuffer(both.raw_output_contents[1], np.float16).tolist() == [1.0, 1.0]


def test_errors_map_to_status_codes_with_their_messages(caplog):
    assert status_of(BadRequestError("bad x")) == (grpc.StatusCode.INVALID_ARGUMENT, "bad x")
    assert status_of(NotFoundError("no m"))[0] == grpc.StatusCode.NOT_FOUND
    assert status_of(PayloadTooLargeError("big"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(UnavailableError("full"))[0] == grpc.StatusCode.UNAVAILABLE
    code, message = status_of(KeyError("bug"))
    assert code == grpc.StatusCode.INTERNAL and message.startswith("internal error: KeyError (request id ")
    assert message[-17:-1] in caplog.text  # the id ties the answer to the logged traceback
