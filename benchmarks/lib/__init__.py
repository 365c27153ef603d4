"""Helpers the benchmarks share: `common` (shapes, environment record, copy bandwidth, JSON
output) and `decode` (an engine's steady decode window, its byte floor)."""
