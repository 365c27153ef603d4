"""The Executor interface (executor/base.py): both executors implement it, and collective_rpc is
how a caller reaches the workers. The Ray executor's side runs in tests/executor/test_ray_tp.py."""

from __future__ import annotations

import pytest

from raypaged.config import EngineConfig
from raypaged.engine.core import default_executor_class
from raypaged.executor.base import Executor
from raypaged.executor.ray_executor import RayExecutor
from raypaged.executor.uniproc import UniprocExecutor
from tests.support.checkpoints import checkpoint_dir


def test_both_executors_implement_the_interface():
    assert issubclass(UniprocExecutor, Executor) and issubclass(RayExecutor, Executor)
    assert not UniprocExecutor.__abstractmethods__ and not RayExecutor.__abstractmethods__

    class Partial(Executor):
        def __init__(self, config, model_dir):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial(EngineConfig(), "")


def test_the_default_executor_follows_the_parallel_settings():
    assert default_executor_class(EngineConfig()) is UniprocExecutor
    assert default_executor_class(EngineConfig(tensor_parallel_size=2)) is RayExecutor
    assert default_executor_class(EngineConfig(distributed_executor_backend="ray")) is RayExecutor


def test_collective_rpc_runs_a_worker_method_or_a_function():
    config = EngineConfig(model=str(checkpoint_dir("llama")), device="cpu", num_gpu_blocks_override=8)
    executor = UniprocExecutor(config, str(checkpoint_dir("llama")))
    try:
        assert executor.collective_rpc("determine_num_blocks", (64, 64)) == [8]
        assert executor.collective_rpc(lambda worker, extra: worker.rank + extra, (5,)) == [5]
        assert executor.worker_pids() == []  # the worker is this process
    finally:
        executor.shutdown()
