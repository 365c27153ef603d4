"""Chat messages (and tools) → prompt token ids, through the tokenizer's own chat template when it
has one.

Tokenizers without a template (the built-in demo model's, the test checkpoints') get
DEFAULT_CHAT_TEMPLATE: one `role: content` line per message, then `assistant:` to prompt the
reply. It is plain on purpose: a base model has no chat format to match, and a readable
transcript is the least surprising thing to continue. Tools are listed first, one
`tool <name>: <description> <parameters schema>` line each; an assistant's calls are written
Hermes-style (`<tool_call>{"name": …, "arguments": …}</tool_call>`) and a tool's result as
`tool (<tool_call_id>): <content>`.
"""

from __future__ import annotations

import json
from typing import Any

from raypaged.core.errors import InvalidRequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% for tool in tools or [] %}"
    "tool {{ tool['function']['name'] }}: {{ tool['function'].get('description', '') }} "
    "{{ tool['function'].get('parameters', {}) | tojson }}\n"
    "{% endfor %}"
    "{% for message in messages %}"
    "{{ message['role'] }}"
    "{% if message.get('tool_call_id') %} ({{ message['tool_call_id'] }}){% endif %}: "
    "{{ message['content'] if message['content'] is not none else '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>"
    "{% endfor %}{{ '\\n' }}"  # a literal newline after a block tag would be trimmed
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def chat_prompt_token_ids(tokenizer: Any, messages: list[dict[str, Any]], max_chars: int,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """max_chars bounds the rendered text before it is tokenized (a prompt that long could not
    fit the context anyway, and tokenizing megabytes would stall the replica). tools: OpenAI's
    tool list, handed to the template (HF's `tools=` convention)."""
    total = sum(len(m["content"] or "") for m in messages) + (len(json.dumps(tools)) if tools else 0)
    if total > max_chars:
        raise InvalidRequestError(
            f"the messages (and tools) have {total} characters; at most {max_chars} can fit this model's context")
    own_template = getattr(tokenizer, "chat_template", None)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, chat_template=own_template or DEFAULT_CHAT_TEMPLATE,
            tokenize=False, add_generation_prompt=True)
    except Exception as e:  # templates raise on what they do not accept (e.g. role order)
        raise InvalidRequestError(f"the chat template cannot render these messages: {e}") from None
    # A model's own template writes its special tokens (BOS) itself; the default one does not,
    # so those prompts get them as a plain completion prompt would.
    return tokenizer.encode(text, add_special_tokens=not own_template)
