"""The API without a server: generated stubs (importable on the GPU machine's grpcio 1.84 /
protobuf 7, and not stale against the .proto), request building and validation defaults, and
the output processor's handling of stop strings for n > 1 and failed requests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raypaged.client import build_request, chunk_from_proto
from raypaged.core.errors import InvalidRequestError, RequestFailedError
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.structured_output import StructuredOutput
from raypaged.frontend.validation import ModelLimits, prepare_request
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.text.output_processor import RequestOutputProcessor

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelLimits(max_model_len=64, vocab_size=100)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_stubs_import_on_the_gpu_machines_versions():
    """grpcio 1.84 refuses stubs generated for a newer grpcio; protobuf refuses gencode newer
    than its runtime. The GPU machine has grpcio 1.84 and protobuf 7.x."""
    grpc_stub = (ROOT / "raypaged/proto/v1/raypaged_pb2_grpc.py").read_text()
    generated_for = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    assert _version(generated_for) <= (1, 84, 0)
    messages = (ROOT / "raypaged/proto/v1/raypaged_pb2.py").read_text()
    gencode = re.search(r"# Protobuf Python Version: ([\d.]+)", messages).group(1)
    assert _version(gencode) < (7, 0, 0)  # older major: accepted by every protobuf 7 runtime


def test_stubs_match_the_proto_source(tmp_path):
    """Regenerating from protos/ gives the same descriptor: the committed stubs are not stale."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    from google.protobuf import descriptor_pb2

    out = tmp_path / "descriptor.pb"
    assert protoc.main(["protoc", f"-Iraypaged/proto={ROOT / 'protos/raypaged'}",
                        f"--descriptor_set_out={out}", str(ROOT / "protos/raypaged/v1/raypaged.proto")]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    messages = list(fresh.message_type)
    while messages:  # protoc fills json_name; the embedded descriptor omits it (nested ones too)
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(committed)
    assert fresh == committed


def test_build_request_from_kwargs_and_sampling_params():
    message = build_request("hi", max_tokens=5, temperature=0.0, stop="\n", stop_token_ids=[3])
    params = message.sampling_params
    assert message.prompt == "hi" and not message.prompt_token_ids
    assert (params.max_tokens, params.temperature) == (5, 0.0)
    assert (list(params.stop), list(params.stop_token_ids)) == (["\n"], [3])
    assert not params.HasField("top_p") and not params.HasField("seed")  # unset: server defaults
    from_params = build_request([1, 2], SamplingParams(max_tokens=5, temperature=0.0, stop=("\n",),
                                                        stop_token_ids=(3,)))
    assert list(from_params.prompt_token_ids) == [1, 2]
    assert from_params.sampling_params.max_tokens == 5 and from_params.sampling_params.HasField("top_p")
    with pytest.raises(TypeError, match="unknown sampling parameters: nucleus"):
        build_request("hi", nucleus=0.9)


def test_validation_defaults():
    class Tokenizer:
        def encode(self, text):
            return [ord(c) % 100 for c in text]

    prepared = prepare_request(pb.GenerateRequest(prompt="x" * 60), Tokenizer(), MODEL)
    params = prepared.request.sampling_params
    assert params.max_tokens == 4  # vLLM's 16, cut to the room left in the context
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, -1)
    assert prepared.skip_special_tokens and len(prepared.request.request_id) == 32
    explicit = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=pb.SamplingParams(
        temperature=0.0, skip_special_tokens=False))
    prepared = prepare_request(explicit, Tokenizer(), MODEL)
    assert prepared.request.sampling_params.greedy and not prepared.skip_special_tokens
    with pytest.raises(InvalidRequestError, match="the prompt is empty after tokenization"):
        prepare_request(pb.GenerateRequest(prompt="x"), type("T", (), {"encode": lambda s, t: []})(), MODEL)


class CharTokenizer:
    """Token id = a character's code point: decoding is plain concatenation."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


def out(sample: int, text: str, finish: FinishReason | None = None, **kwargs) -> EngineCoreOutput:
    req_id = "r" if sample == 0 else f"r#{sample}"
    return EngineCoreOutput(req_id, "r", sample, [ord(c) for c in text], finish_reason=finish,
                            num_prompt_tokens=2, **kwargs)


def test_stop_string_ends_one_sample_and_late_records_are_dropped():
    request = Request("r", [ord("a"), ord("b")], SamplingParams(n=2, stop=("xy",), max_tokens=10))
    processor = RequestOutputProcessor(request, CharTokenizer())
    assert processor.process(out(1, "hex")).delta.text == "he"  # "x" held: it may start "xy"
    ended = processor.process(out(1, "y!"))
    assert (ended.delta.text, ended.delta.stop_string, ended.finish_reason) == ("", "xy", "stop")
    assert processor.samples_stopped_by_strings() == [1] and not processor.finished
    assert processor.process(out(1, "zz")) is None  # the engine had not heard yet
    assert processor.process(out(1, "", FinishReason.ABORT)) is None
    last = processor.process(out(0, "fine", FinishReason.LENGTH))
    assert last.delta.text == "fine" and last.delta.finish_reason == pb.FINISH_REASON_LENGTH
    assert processor.finished
    assert processor.usage().completion_tokens == 5 + 4  # up to the stop string's token; sample 0
    chunk = chunk_from_proto(pb.GenerateResponse(request_id="r", outputs=[ended.delta]))
    assert chunk.outputs[0].stop_reason == "xy" and chunk.outputs[0].finish_reason == "stop"


def test_engine_error_fails_the_request():
    request = Request("r", [1, 2], SamplingParams(max_tokens=4))
    processor = RequestOutputProcessor(request, CharTokenizer())
    with pytest.raises(RequestFailedError, match="workers failed"):
        processor.process(out(0, "", FinishReason.ABORT, error="the model workers failed"))


@pytest.mark.integration
def test_client_is_light():
    """The client runs where neither torch nor Ray is installed."""
    import subprocess
    import sys

    code = ("import sys, raypaged.client\n"
            "bad = [m for m in ('torch', 'ray', 'transformers', 'numpy') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("spec, expected", [
    (pb.StructuredOutput(json_schema='{"type": "object"}'), StructuredOutput(json='{"type": "object"}')),
    (pb.StructuredOutput(json_object=True), StructuredOutput(json_object=True)),
    (pb.StructuredOutput(regex="[0-9]+"), StructuredOutput(regex="[0-9]+")),
    (pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choice=["yes", "no"])),
     StructuredOutput(choice=("yes", "no"))),
    (pb.StructuredOutput(grammar='root ::= "x"'), StructuredOutput(grammar='root ::= "x"')),
])
def test_structured_output_maps_to_sampling_params(spec, expected):
    message = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=pb.SamplingParams(
        structured_output=spec))
    assert prepare_request(message, None, MODEL).request.sampling_params.structured_output == expected
    unset = pb.GenerateRequest(prompt_token_ids=[1, 2])
    assert prepare_request(unset, None, MODEL).request.sampling_params.structured_output is None


@pytest.mark.parametrize("spec, says", [
    (pb.StructuredOutput(), "must set one of"),
    (pb.StructuredOutput(json_object=False), "json_object must be true"),
    (pb.StructuredOutput(json_schema="{nope"), "json schema is not valid JSON"),
    (pb.StructuredOutput(json_schema="[1]"), "must be a JSON object"),
    (pb.StructuredOutput(regex=""), "regex must be a non-empty string"),
    (pb.StructuredOutput(choice=pb.StructuredOutput.Choices()), "choice must be non-empty strings"),
])
def test_invalid_structured_output_is_refused(spec, says):
    message = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=pb.SamplingParams(
        structured_output=spec))
    with pytest.raises(InvalidRequestError, match=says):
        prepare_request(message, None, MODEL)


def test_client_sends_structured_output():
    spec = StructuredOutput(choice=("a", "b"))
    for message in (build_request("hi", structured_output=spec),
                    build_request("hi", structured_output={"choice": ["a", "b"]}),
                    build_request("hi", SamplingParams(structured_output=spec))):
        params = prepare_request(message, type("T", (), {"encode": lambda s, t: [1]})(), MODEL)
        assert params.request.sampling_params.structured_output == spec
    assert not build_request("hi").sampling_params.HasField("structured_output")
