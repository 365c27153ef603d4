"""OpenAI requests → raypaged.v1 without a cluster: every field mapped, unsupported features and
wire limits refused as validation errors, and the chat template (the default one when the
tokenizer has none)."""

from __future__ import annotations

import pytest

from raypaged.core.errors import InvalidRequestError
from raypaged.serve.chat_template import DEFAULT_CHAT_TEMPLATE, chat_prompt_token_ids
from raypaged.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.support.checkpoints import checkpoint_dir


# ---- OpenAI requests → raypaged.v1 ---------------------------------------------------------------
def test_completion_request_maps_every_field():
    body = CompletionRequest.model_validate({
        "model": "m", "prompt": ["hello"], "max_tokens": 7, "n": 2, "temperature": 0.5, "top_p": 0.9,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "seed": 3, "stop": "\n", "logprobs": 2,
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 1, "stop_token_ids": [9],
        "ignore_eos": True, "skip_special_tokens": False, "priority": 4, "cache_salt": "s",
        "request_id": "r1", "user": "ignored", "unknown_field": 1})
    message = body.to_generate_request()
    params = message.sampling_params
    assert (message.prompt, message.request_id, message.priority, message.cache_salt) == ("hello", "r1", 4, "s")
    assert (params.max_tokens, params.n, params.seed, params.logprobs, params.top_k,
            params.min_tokens) == (7, 2, 3, 2, 5, 1)
    assert params.temperature == pytest.approx(0.5) and params.min_p == pytest.approx(0.05)
    assert list(params.stop) == ["\n"] and list(params.stop_token_ids) == [9]
    assert params.ignore_eos and not params.skip_special_tokens
    # Unset stays unset: validation then applies vLLM's defaults.
    bare = CompletionRequest.model_validate({"prompt": [1, 2, 3]}).to_generate_request()
    assert list(bare.prompt_token_ids) == [1, 2, 3] and bare.request_id
    assert not bare.sampling_params.HasField("max_tokens") and not bare.sampling_params.HasField("temperature")


def test_chat_request_maps_max_completion_tokens_and_logprobs():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    assert body.message_dicts() == [{"role": "user", "content": "ab"}]
    message = body.to_generate_request([4, 5])
    assert list(message.prompt_token_ids) == [4, 5]
    assert message.sampling_params.max_tokens == 9 and message.sampling_params.logprobs == 3
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert not plain.to_generate_request([1]).sampling_params.HasField("logprobs")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logit_bias": {"one": 2.0}}, "logit_bias keys must be token ids"),
    ({"prompt": "x", "logit_bias": {"4294967296": 2.0}}, "not a token id"),
    ({"prompt": [[1], [2]]}, "one prompt"),
])
def test_unsupported_completion_features_are_refused(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        CompletionRequest.model_validate(body).to_generate_request()


def test_logit_bias_and_prompt_logprobs_reach_the_message():
    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": -100, " 3": 2.5},
                                             "echo": True, "logprobs": 2})
    params = body.to_generate_request().sampling_params
    assert dict(params.logit_bias) == {7: -100.0, 3: 2.5}
    assert params.prompt_logprobs == 2 and params.logprobs == 2  # echo with logprobs scores the prompt
    asked = CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 4, "echo": True, "logprobs": 1})
    assert asked.to_generate_request().sampling_params.prompt_logprobs == 4
    plain = CompletionRequest.model_validate({"prompt": "x", "echo": True}).to_generate_request()
    assert not plain.sampling_params.HasField("prompt_logprobs") and not plain.sampling_params.logit_bias
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "logit_bias": {"5": 1}})
    assert dict(chat.to_generate_request([1]).sampling_params.logit_bias) == {5: 1.0}


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "function"}]}, r"tools\[0\].function must be an object"),
    ({"tool_choice": "auto"}, "tool_choice 'auto' needs a non-empty tools list"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
    ({"response_format": {"type": "xml"}}, "response_format type .xml. is not supported"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
])
def test_unsupported_chat_features_are_refused(extra, message):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **extra})
    with pytest.raises(InvalidRequestError, match=message):
        body.to_generate_request([1])


def test_wire_limits_are_validation_errors():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 2**31})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [2**40]})


# ---- chat template -------------------------------------------------------------------------------
def test_default_chat_template_when_the_tokenizer_has_none():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir("llama")))
    assert not getattr(tokenizer, "chat_template", None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = chat_prompt_token_ids(tokenizer, messages, max_chars=1000)
    assert ids == tokenizer.encode("system: be brief\nuser: hi\nassistant:")
    with pytest.raises(InvalidRequestError, match="characters"):
        chat_prompt_token_ids(tokenizer, messages, max_chars=5)
    # The tokenizer's own template wins, and writes its special tokens itself.
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert chat_prompt_token_ids(tokenizer, messages, 1000) == tokenizer.encode(
        "<system>be brief<user>hi", add_special_tokens=False)
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(InvalidRequestError, match="no system role"):
        chat_prompt_token_ids(tokenizer, messages, 1000)
    assert "add_generation_prompt" in DEFAULT_CHAT_TEMPLATE
