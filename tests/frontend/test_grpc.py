"""A real server on localhost and real gRPC clients: streaming, greedy parity with transformers
and with the offline LLM, text (UTF-8, stop strings), logprobs, n > 1, Abort, cancellation and
deadlines (blocks back in the pool), reflection, model info, `raypaged generate --server`."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from raypaged.client import AsyncClient, Client, RequestError
from raypaged.proto.v1 import SERVICE_NAME
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import cpu_server
from tests.support.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.integration

MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(checkpoint_dir("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    with cpu_server(model_dir, num_gpu_blocks_override=96, max_num_seqs=MAX_NUM_SEQS) as running:
        yield running


@pytest.fixture
def client(server):
    with Client(server.address) as c:
        yield c


def greedy(**kwargs) -> dict:
    return dict(temperature=0.0, ignore_eos=True, **kwargs)


def test_model_info_and_health(server, client):
    info = client.model_info()
    assert (info.name, info.architecture) == ("llama", "LlamaForCausalLM")
    assert (info.max_model_len, info.block_size, info.num_blocks) == (256, 16, server.num_blocks)
    assert info.vocab_size == 320 and info.tensor_parallel_size == 1 and list(info.eos_token_ids) == [2]
    assert client.health() == "SERVING" and client.health("") == "SERVING"


def test_stream_greedy_equals_transformers(server, client, model_dir):
    prompt = random_prompts([11], 320, seed=1)[0]
    chunks = list(client.stream(prompt, max_tokens=20, **greedy()))
    assert len(chunks) >= 10  # streamed as produced (one step at a time), not in one message
    token_ids = [t for c in chunks for o in c.outputs for t in o.token_ids]
    assert token_ids == hf_greedy(model_dir, tuple(prompt), 20)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].outputs[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 20)
    text = "".join(o.text for c in chunks for o in c.outputs)
    assert text == server.tokenizer.decode(token_ids, skip_special_tokens=True,
                                           clean_up_tokenization_spaces=False)
    server.wait_pool_whole()


def test_32_concurrent_streams_equal_offline_llm(server, model_dir):
    from raypaged.core.sampling_params import SamplingParams
    from raypaged.llm import LLM

    rng = random.Random(7)
    prompts = random_prompts([rng.randint(3, 40) for _ in range(32)], 320, seed=3)
    max_tokens = [rng.randint(4, 24) for _ in prompts]

    async def run_all():
        async with AsyncClient(server.address) as c:
            return await asyncio.gather(*[c.generate(p, max_tokens=m, **greedy())
                                          for p, m in zip(prompts, max_tokens)])

    results = asyncio.run(run_all())
    llm = LLM(model_dir, device="cpu", num_gpu_blocks_override=96, max_num_seqs=MAX_NUM_SEQS)
    try:
        expected = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                 for m in max_tokens])
    finally:
        llm.shutdown()
    for got, want, m in zip(results, expected, max_tokens):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == m
    assert len({r.request_id for r in results}) == 32
    server.wait_pool_whole()


def test_text_prompt_utf8_split_across_tokens(server, client):
    tokenizer = server.tokenizer
    prompt = "héllo 日本 😀 wörld"
    chunks = list(client.stream(prompt, max_tokens=48, **greedy()))
    token_ids = [t for c in chunks for o in c.outputs for t in o.token_ids]
    texts = [o.text for c in chunks for o in c.outputs]
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert "".join(texts) == tokenizer.decode(token_ids, skip_special_tokens=True,
                                              clean_up_tokenization_spaces=False)
    # Bytes of a split character are held back, never streamed as U+FFFD ahead of their rest.
    assert not any(t.endswith("\ufffd") for t in texts[:-1])
    # The check above means something only if the output does split characters.
    assert any(not tokenizer.decode([t]).isascii() or "\ufffd" in tokenizer.decode([t]) for t in token_ids)


def _token_texts(tokenizer, ids):
    return [tokenizer.decode([t]) for t in ids]


def test_stop_string_split_across_tokens_truncates_and_frees(server, client):
    tokenizer = server.tokenizer
    prompt = random_prompts([9], 320, seed=5)[0]
    full = client.generate(prompt, max_tokens=40, **greedy()).outputs[0]
    pieces = _token_texts(tokenizer, full.token_ids)
    # A stop string spanning a token boundary: the end of one token's text and the start of the next.
    k = next(i for i in range(3, len(pieces) - 1)
             if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
             and pieces[i].isprintable() and pieces[i + 1].isprintable())
    stop = pieces[k][-1] + pieces[k + 1][:1]
    index = full.text.find(stop)
    assert index >= 0
    got = client.generate(prompt, max_tokens=40, stop=[stop], **greedy()).outputs[0]
    assert got.text == full.text[:index]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.token_ids == full.token_ids[:len(got.token_ids)] and len(got.token_ids) < 40
    server.wait_pool_whole()


def test_stop_string_with_n_samples(server, client):
    prompt = random_prompts([9], 320, seed=5)[0]
    full = client.generate(prompt, max_tokens=40, **greedy()).outputs[0]
    stop = next(full.text[i:i + 2] for i in range(4, len(full.text) - 2)
                if full.text[i:i + 2].isprintable() and "\ufffd" not in full.text[i:i + 2])
    result = client.generate(prompt, max_tokens=40, n=3, stop=[stop], **greedy())
    assert [o.index for o in result.outputs] == [0, 1, 2]
    for out in result.outputs:  # greedy: every sample is the same text, cut at the same place
        expected = (full.text[:full.text.find(stop)], "stop", stop)
        assert (out.text, out.finish_reason, out.stop_reason) == expected
    server.wait_pool_whole()


def test_stop_token_id(server, client):
    prompt = random_prompts([6], 320, seed=9)[0]
    full = client.generate(prompt, max_tokens=12, **greedy()).outputs[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    got = client.generate(prompt, max_tokens=12, stop_token_ids=[stop_id], **greedy()).outputs[0]
    assert got.token_ids == full.token_ids[:first + 1]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)


def test_logprobs(server, client):
    prompt = random_prompts([6], 320, seed=10)[0]
    chunks = list(client.stream(prompt, max_tokens=5, logprobs=3, **greedy()))
    for chunk in chunks:
        for out in chunk.outputs:
            assert len(out.logprobs) == len(out.token_ids)
            for token_id, position in zip(out.token_ids, out.logprobs):
                top = sorted(position.items(), key=lambda kv: -kv[1])
                assert top[0][0] == token_id  # greedy: the sampled token is the likeliest
                assert len(position) == 3 and all(v <= 0.0 for v in position.values())


def test_n_samples_seeded_are_reproducible(server, client):
    prompt = random_prompts([8], 320, seed=11)[0]
    a = client.generate(prompt, max_tokens=10, n=3, temperature=1.0, seed=1234, ignore_eos=True)
    b = client.generate(prompt, max_tokens=10, n=3, temperature=1.0, seed=1234, ignore_eos=True)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the samples differ from each other
    assert a.usage.completion_tokens == 30 and a.usage.prompt_tokens == 8
    server.wait_pool_whole()


def test_abort_rpc_ends_the_stream(server, client):
    prompt = random_prompts([8], 320, seed=12)[0]
    stream = client.stream(prompt, request_id="to-abort", max_tokens=240, **greedy())
    first = next(stream)
    assert first.request_id == "to-abort"
    with Client(server.address) as other:
        other.abort("to-abort")
    rest = list(stream)
    assert rest[-1].outputs[0].finish_reason == "abort" and rest[-1].usage is not None
    assert sum(len(o.token_ids) for c in [first, *rest] for o in c.outputs) < 240
    server.wait_pool_whole()
    with pytest.raises(RequestError) as error:
        client.abort("to-abort")
    assert error.value.code == grpc.StatusCode.NOT_FOUND


class StartedCall:
    """A Generate sent at once (the blocking Client sends on the first read), its messages read
    in full by `finish`; the call's own deadline keeps a stream that never ends from hanging."""

    def __init__(self, server, prompt, request_id: str, **sampling) -> None:
        import raypaged.proto.v1.raypaged_pb2_grpc as pb_grpc
        from raypaged.client import build_request

        self.channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.RaypagedServiceStub(self.channel)
        self.request_id = request_id
        self.call = stub.Generate(build_request(prompt, request_id=request_id, **sampling), timeout=60)

    def abort(self, client) -> None:
        """Abort once the server knows the request (NOT_FOUND until its Generate arrived)."""
        for _ in range(500):
            try:
                return client.abort(self.request_id)
            except RequestError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND, e
            time.sleep(0.01)
        raise AssertionError(f"the server never knew {self.request_id!r}")

    def finish(self) -> tuple[dict[int, int], object]:
        """Each sample's finish reason and the usage: the stream must end by itself."""
        reasons, usage = {}, None
        try:
            for message in self.call:
                for delta in message.outputs:
                    if delta.finish_reason:
                        assert delta.index not in reasons, f"sample {delta.index} ended twice"
                        reasons[delta.index] = delta.finish_reason
                if message.HasField("usage"):
                    usage = message.usage
        finally:
            self.channel.close()
        return reasons, usage


def test_abort_of_n_samples_waiting_to_be_scheduled_ends_every_sample(server, client):
    """Issue 24: aborted before its prompt ran (so before its samples fork), an n > 1 stream got
    sample 0's abort only and stayed open forever."""
    from raypaged.proto.v1 import raypaged_pb2 as pb

    # Every sequence slot taken (and blocks for all), so the group waits for one.
    blockers = [StartedCall(server, random_prompts([8], 320, seed=40 + i)[0], f"blocker-{i}",
                            max_tokens=70, **greedy()) for i in range(MAX_NUM_SEQS)]
    try:
        server.wait_until(lambda s: s.num_running == MAX_NUM_SEQS, 60, "the blockers to run")
        group = StartedCall(server, "def fib(n):", "waiting-group", n=3, max_tokens=198, temperature=0.8)
        server.wait_until(lambda s: s.num_waiting == 1, 60, "the group to wait")
        group.abort(client)
        reasons, usage = group.finish()
        assert reasons == {i: pb.FINISH_REASON_ABORT for i in range(3)} and usage is not None
    finally:
        for blocker in blockers:
            blocker.call.cancel()
            blocker.channel.close()
    server.wait_pool_whole(timeout=30)


@pytest.mark.parametrize("n", [2, 4])
def test_abort_of_n_samples_at_any_moment_ends_every_sample(server, client, n):
    """The issue's reproducer: Generate then Abort at once or soon after (before scheduling,
    during prefill, at the fork, after it): every sample ends, and the usage closes the stream."""
    from raypaged.proto.v1 import raypaged_pb2 as pb

    for k, delay in enumerate([0.0, 0.0, 0.005, 0.02, 0.1]):
        call = StartedCall(server, "def fib(n):", f"any-moment-{n}-{k}", n=n, max_tokens=198,
                           temperature=0.8)
        time.sleep(delay)
        call.abort(client)
        reasons, usage = call.finish()
        assert set(reasons) == set(range(n)) and usage is not None, (delay, reasons)
        assert pb.FINISH_REASON_ABORT in reasons.values()
    server.wait_pool_whole(timeout=30)


def test_client_cancel_frees_blocks(server, client):
    prompt = random_prompts([40], 320, seed=13)[0]
    stream = client.stream(prompt, max_tokens=200, **greedy())
    next(stream), next(stream)
    held = server.stats().kv_cache
    assert held.num_free_blocks < server.num_blocks  # the request holds blocks while it streams
    stream.close()  # leaving the stream cancels the call
    server.wait_pool_whole(timeout=5)


def test_deadline_frees_blocks(server, client):
    prompt = random_prompts([40], 320, seed=14)[0]
    with pytest.raises(RequestError) as error:
        client.generate(prompt, max_tokens=210, timeout=0.3, **greedy())
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_pool_whole(timeout=5)
    assert client.health() == "SERVING"


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
        file = database.FindFileContainingSymbol(SERVICE_NAME)
        methods = {m.name for s in file.service for m in s.method}
        assert methods == {"Generate", "Abort", "GetModelInfo"}


def test_generate_cli_streams_from_the_server(server, capsys):
    from raypaged.cli import main

    assert main(["generate", "--server", server.address, "--prompt", "The quick brown",
                 "--max-tokens", "8", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    with Client(server.address) as c:
        expected = c.generate("The quick brown", max_tokens=8, **greedy()).outputs[0].text
    assert out == "The quick brown" + expected + "\n"
