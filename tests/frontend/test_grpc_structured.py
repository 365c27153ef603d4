"""Structured output through a real gRPC server on the demo model: the random model's output is
whatever the grammar lets through, so a small schema's output must parse and validate; a spec
the grammar engine rejects is INVALID_ARGUMENT with the reason, and the server goes on serving."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from raypaged.client import Client, RequestError
from raypaged.core.structured_output import StructuredOutput
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import cpu_server

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    with cpu_server(str(checkpoint_dir("llama")), num_gpu_blocks_override=64) as running:
        with Client(running.address) as c:
            yield c


def test_json_schema_output_parses_and_validates(client):
    for seed in range(2):
        out = client.generate([5, 17, 3, 9], max_tokens=200, temperature=1.0, seed=seed,
                              structured_output=StructuredOutput(json=SCHEMA)).outputs[0]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        # xgrammar lets raw control characters into JSON strings: strict=False reads them.
        jsonschema.validate(json.loads(out.text, strict=False), SCHEMA)


@pytest.mark.parametrize("spec, says", [
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"json": {"type": "no-such-type"}}, "schema"),
])
def test_a_spec_the_grammar_engine_rejects_is_invalid_argument(client, spec, says):
    with pytest.raises(RequestError) as error:
        client.generate([5, 17, 3], max_tokens=8, structured_output=spec)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in error.value.message.lower()
    # The server still serves.
    out = client.generate([5, 17, 3], max_tokens=8, structured_output={"choice": ["yes", "no"]}).outputs[0]
    assert out.text in ("yes", "no")
