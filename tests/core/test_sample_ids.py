"""core/sample_ids.py: the grammar of sample ids ("group#i"), which the core, the engine client,
the frontend and the offline LLM all build and parse through it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypaged.core.sample_ids import (
    SEPARATOR,
    parse_sample_id,
    sample_id,
    sample_request_id,
)


def test_sample_ids_name_one_sample_and_request_ids_keep_the_group_for_sample_0():
    assert sample_id("g", 0) == "g#0" and sample_id("g", 3) == "g#3"
    assert sample_request_id("g", 0) == "g"  # the parent keeps the group id
    assert sample_request_id("g", 2) == "g#2"


@pytest.mark.parametrize("request_id, parsed", [
    ("g#0", ("g", 0)),
    ("g#12", ("g", 12)),
    ("a#b#3", ("a#b", 3)),  # the index is after the last separator
    ("g@7#1", ("g@7", 1)),  # an engine id (engine/client.py) as the group
    ("g", ("g", None)),  # a group id, or a plain request's
    ("g#", ("g#", None)),
    ("#1", ("#1", None)),  # no group
    ("g#x", ("g#x", None)),
    ("g#-1", ("g#-1", None)),
    ("g#01", ("g#01", None)),  # not canonical: would not round-trip
    ("g#\u0663", ("g#\u0663", None)),  # a non-ASCII digit
])
def test_parse_sample_id(request_id, parsed):
    assert parse_sample_id(request_id) == parsed


@given(st.text(min_size=1).filter(lambda g: SEPARATOR not in g), st.integers(0, 10**6))
def test_building_then_parsing_round_trips(group, index):
    assert parse_sample_id(sample_id(group, index)) == (group, index)
    assert parse_sample_id(group) == (group, None)
    request_id = sample_request_id(group, index)
    assert parse_sample_id(request_id) == ((group, index) if index else (group, None))
