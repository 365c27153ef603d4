"""Every refusal is a gRPC status with a clear message; afterwards the server is still SERVING,
the engine holds nothing it should not (the pool is whole) and other streams are unharmed.

The engine here schedules one step at a time (--no-async-scheduling); the other frontend modules
run the default, asynchronous scheduling."""

from __future__ import annotations

import threading

import grpc
import pytest

from raypaged.client import Client, RequestError
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.proto.v1 import raypaged_pb2_grpc
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import cpu_server
from tests.support.hf_oracle import hf_greedy

pytestmark = pytest.mark.integration

MAX_NUM_SEQS = 2
MAX_WAITING = 2
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(checkpoint_dir("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    with cpu_server(model_dir, num_gpu_blocks_override=64, max_num_seqs=MAX_NUM_SEQS,
                    max_waiting_requests=MAX_WAITING, async_scheduling=False) as running:
        yield running


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield raypaged_pb2_grpc.RaypagedServiceStub(channel)


def request(prompt="hello", ids=(), request_id="", **params) -> pb.GenerateRequest:
    stop = params.pop("stop", [])
    stop_ids = params.pop("stop_token_ids", [])
    message = pb.GenerateRequest(request_id=request_id, prompt=prompt, prompt_token_ids=list(ids),
                                 sampling_params=pb.SamplingParams(**params))
    message.sampling_params.stop.extend(stop)
    message.sampling_params.stop_token_ids.extend(stop_ids)
    return message


BAD_REQUESTS = [
    ("empty prompt", request(prompt=""), "the prompt is empty"),
    ("text and ids", request(prompt="hi", ids=[5, 6]), "not both"),
    ("token id past the vocabulary", request(prompt="", ids=[5, 320]), "prompt_token_ids[1] = 320"),
    ("negative token id", request(prompt="", ids=[-1]), "prompt_token_ids[0] = -1"),
    ("prompt fills the context", request(prompt="", ids=[5] * 256), "leaves no room"),
    ("text prompt too long", request(prompt="x" * (256 * 64 + 1)), "characters"),
    ("max_tokens 0", request(max_tokens=0), "max_tokens must be >= 1"),
    ("max_tokens past the context", request(max_tokens=300), "maximum context length is 256"),
    ("n 0", request(n=0), "n must be in [1, 16]"),
    ("n above the limit", request(n=17), "n must be in [1, 16]"),
    ("negative temperature", request(temperature=-1.0), "temperature must be >= 0"),
    ("NaN temperature", request(temperature=float("nan")), "temperature must be a finite number"),
    ("infinite temperature", request(temperature=float("inf")), "temperature must be a finite number"),
    ("top_p 0", request(top_p=0.0), "top_p must be in (0, 1]"),
    ("top_p above 1", request(top_p=1.5), "top_p must be in (0, 1]"),
    ("top_k -5", request(top_k=-5), "top_k must be"),
    ("min_p above 1", request(min_p=2.0), "min_p must be in [0, 1]"),
    ("repetition_penalty 0", request(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    ("presence_penalty 3", request(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
    ("logprobs 21", request(logprobs=21), "logprobs must be in [0, 20]"),
    ("min_tokens above max_tokens", request(max_tokens=4, min_tokens=5), "min_tokens"),
    ("empty stop string", request(stop=["ok", ""]), "stop[1] must have 1 to 256 characters"),
    ("too many stop strings", request(stop=[f"s{i}" for i in range(17)]), "at most 16 stop strings"),
    ("stop string too long", request(stop=["x" * 257]), "stop[0] must have 1 to 256"),
    ("stop token id past the vocabulary", request(stop_token_ids=[2, 999]), "stop_token_ids[1] = 999"),
    ("request id with '#'", request(request_id="a#1"), "must not contain '#'"),
    ("request id too long", request(request_id="r" * 129), "request_id has 129 characters"),
    ("request id unprintable", request(request_id="a\nb"), "request_id must be printable"),
]


@pytest.fixture(scope="module")
def background_stream(server, model_dir):
    """A healthy stream that runs while the bad requests come in; it must end untouched."""
    prompt = [5, 17, 42, 99, 23, 7]
    result = {}

    def run():
        with Client(server.address) as c:
            result["out"] = c.generate(prompt, max_tokens=120, temperature=0.0, ignore_eos=True)

    thread = threading.Thread(target=run)
    thread.start()
    server.wait_until(lambda s: s.num_running == 1, what="the background stream to run")
    yield
    thread.join(timeout=60)
    assert result["out"].outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 120)
    server.wait_pool_whole()


@pytest.mark.parametrize("name, message, fragment", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_invalid_argument(server, stub, background_stream, name, message, fragment):
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(message, timeout=30))
    assert error.value.code() == INVALID, error.value.details()
    assert fragment in error.value.details()
    assert "Traceback" not in error.value.details()
    with Client(server.address) as c:
        assert c.health() == "SERVING"
    stats = server.stats()  # nothing of the refused request reached the engine
    assert stats.num_waiting == 0 and stats.num_running <= 1


def test_table_is_large_enough():
    assert len(BAD_REQUESTS) >= 15


def test_duplicate_request_id_in_flight(server, stub):
    first = stub.Generate(request(ids=[5, 6, 7], prompt="", request_id="dup", max_tokens=100,
                                  temperature=0.0, ignore_eos=True))
    next(first)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request(request_id="dup")))
    assert error.value.code() == INVALID and "already in use" in error.value.details()
    rest = list(first)  # the first stream goes on to its end
    assert rest[-1].outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(o.token_ids) for r in rest for o in r.outputs) == 99
    server.wait_pool_whole()


def drain(call, ends: list) -> None:
    try:
        for _ in call:
            pass
        ends.append("completed")
    except grpc.RpcError as e:
        ends.append(e.code())


def test_queue_full_is_resource_exhausted(server, stub):
    long = dict(prompt="", ids=[5, 6, 7, 8], max_tokens=200, temperature=0.0, ignore_eos=True)
    calls, readers, ends = [], [], []

    def start(count: int) -> None:
        for _ in range(count):
            calls.append(stub.Generate(request(**long)))
            readers.append(threading.Thread(target=drain, args=(calls[-1], ends)))
            readers[-1].start()

    try:
        # The bound applies when a request arrives: fill the batch first, then the queue.
        start(MAX_NUM_SEQS)
        server.wait_until(lambda s: s.num_running == MAX_NUM_SEQS, what="a full batch")
        start(MAX_WAITING)
        server.wait_until(lambda s: s.num_running == MAX_NUM_SEQS and s.num_waiting == MAX_WAITING,
                          what="a full batch and a full queue")
        with Client(server.address) as c:
            with pytest.raises(RequestError) as error:
                c.generate("hello", max_tokens=4)
            assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waiting" in error.value.message and "try again later" in error.value.message
            assert c.health() == "SERVING"
    finally:
        for call in calls:
            call.cancel()
        for reader in readers:
            reader.join(timeout=30)
    assert ends == [grpc.StatusCode.CANCELLED] * len(calls)  # none refused, none finished early
    server.wait_pool_whole()
    with Client(server.address) as c:  # and it serves again
        assert c.generate("hello", max_tokens=3, ignore_eos=True).outputs[0].finish_reason == "length"


def test_abort_unknown_request_is_not_found(server, stub):
    with pytest.raises(grpc.RpcError) as error:
        stub.Abort(pb.AbortRequest(request_id="nobody"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in error.value.details()
