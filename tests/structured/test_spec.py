"""StructuredOutput validation (pure) and the bitmask applied to logits (torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raypaged import SamplingParams
from raypaged.core.errors import InvalidRequestError
from raypaged.core.structured_output import StructuredOutput
from raypaged.structured.bitmask import apply_grammar_bitmask, unpack_bitmask
from raypaged.structured.compiler import check_spec


@pytest.mark.parametrize("kwargs", [
    {}, {"regex": "a", "choice": ("a",)}, {"json": "{not json"}, {"json": "[1, 2]"},
    {"choice": ()}, {"choice": ("a", "")}, {"regex": ""}, {"grammar": ""},
])
def test_malformed_specs_are_refused_on_construction(kwargs):
    with pytest.raises(InvalidRequestError):
        StructuredOutput(**kwargs)


def test_a_dict_schema_is_canonical_and_sampling_params_take_vllm_dicts():
    a = StructuredOutput(json={"type": "object", "required": ["x"]})
    b = StructuredOutput(json={"required": ["x"], "type": "object"})
    assert a == b and a.key == b.key and hash(a) == hash(b)
    params = SamplingParams(structured_output={"regex": "[0-9]+"})
    assert params.structured_output == StructuredOutput(regex="[0-9]+")
    with pytest.raises(InvalidRequestError, match="unknown"):
        SamplingParams(structured_output={"jsn": "{}"})


@pytest.mark.parametrize("spec", [
    StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
    StructuredOutput(regex="(unclosed"),
    StructuredOutput(grammar='root ::= "a" | undefined_rule'),
])
def test_specs_xgrammar_rejects_are_invalid_requests(spec):
    with pytest.raises(InvalidRequestError, match="invalid structured output"):
        check_spec(spec)


def test_valid_specs_pass_the_check():
    for spec in (StructuredOutput(json='{"type": "integer"}'), StructuredOutput(json_object=True),
                 StructuredOutput(regex="[a-z]+"), StructuredOutput(choice=('say "hi"', "no")),
                 StructuredOutput(grammar='root ::= "a" "b"*')):
        check_spec(spec)


def test_bitmask_masks_only_the_named_rows():
    vocab = 70  # not a multiple of 32: the last word is partial
    allowed = {0: [1, 33, 69], 1: [31, 32]}
    bitmask = np.zeros((2, 3), dtype=np.int32)
    for row, tokens in allowed.items():
        for t in tokens:
            bitmask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    unpacked = unpack_bitmask(torch.from_numpy(bitmask), vocab)
    for row, tokens in allowed.items():
        assert unpacked[row].nonzero().flatten().tolist() == tokens
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammar_bitmask(logits, bitmask, logit_rows=[2, 0], mask_rows=[0, 1])
    assert torch.equal(logits[1], before[1])  # no grammar: untouched
    for row, mask_row in ((2, 0), (0, 1)):
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == allowed[mask_row]
        assert torch.equal(logits[row, finite], before[row, finite])
