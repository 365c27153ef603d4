"""One pair of engines (sync and async scheduling) on the llama test checkpoint for the
structured-output tests that compare the two: built once for the package's modules."""

from __future__ import annotations

import pytest

from raypaged import LLM
from tests.support.checkpoints import checkpoint_dir


@pytest.fixture(scope="session")
def engines():
    made = {mode: LLM(str(checkpoint_dir("llama")), async_scheduling=mode == "async")
            for mode in ("sync", "async")}
    yield made
    for engine in made.values():
        engine.shutdown()
