"""The ids of an n > 1 request's samples: the one place that builds and parses `group#i`.

A request with n samples is one *group*; its id (the group id) is the id the client knows, and
may not contain SEPARATOR (the frontend refuses such ids). The core prefills the prompt once and
forks the samples (core/parallel_sampling.py):

- Sample 0 is the parent request, so its request id is the group id itself.
- Sample i > 0 is a request of its own with request id `sample_id(group, i)` = "group#i".
- "group#i" names sample i alone for every i, sample 0 included ("group#0"): that is how a caller
  aborts one sample while the others go on, since the bare group id names the whole group.

The index is a decimal integer without leading zeros, so `sample_id` and `parse_sample_id` are
inverse: parse_sample_id(sample_id(g, i)) == (g, i).
"""

from __future__ import annotations

SEPARATOR = "#"


def sample_id(group_id: str, index: int) -> str:
    """The id that names sample `index` of group `group_id` alone: "group#index"."""
    return f"{group_id}{SEPARATOR}{index}"


def sample_request_id(group_id: str, index: int) -> str:
    """The request id sample `index` runs under in the engine: the group id for sample 0 (the
    parent keeps it), "group#index" for the forked samples."""
    return group_id if index == 0 else sample_id(group_id, index)


def parse_sample_id(request_id: str) -> tuple[str, int | None]:
    """(group id, sample index) when `request_id` has the form "group#index" (non-empty group,
    canonical non-negative index); otherwise (request_id, None): a group id or a plain request's."""
    group, sep, index = request_id.rpartition(SEPARATOR)
    if sep and group and index.isascii() and index.isdigit() and (index == "0" or index[0] != "0"):
        return group, int(index)
    return request_id, None
