"""Structured outputs (constrained decoding) with xgrammar: grammar compilation off the step
loop (compiler.py), a request's grammar state (matcher.py), the engine's bookkeeping of both
(manager.py) and the logits mask the worker applies (bitmask.py)."""
