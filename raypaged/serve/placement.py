"""The placement-group bundles of one replica: the replica itself, then one bundle per TP worker.

Serve creates one placement group per replica from `placement_group_bundles` and starts the
replica actor in bundle 0. Everything the replica creates is captured into the same group: the
engine actor lands in any bundle with room (it asks for nothing unless it runs the model itself),
and the Ray executor, finding itself inside a group, puts rank r in bundle 1 + r (the group's
last tensor_parallel_size bundles). So a replica's GPUs are reserved once, by Serve, before it
starts, and the cluster autoscaler sees a replica's whole demand up front.
"""

from __future__ import annotations

from raypaged.config import EngineConfig

# What the engine actor asks for when it runs the model in process on a GPU (engine/client.py).
IN_PROCESS_GPU_ENGINE = {"CPU": 1.0, "GPU": 1.0}


def uses_gpu(config: EngineConfig, cluster_gpus: float) -> bool:
    """device "cuda" always means GPUs (say so on an autoscaling cluster that has none yet);
    "auto" means GPUs when the cluster has enough for one replica's workers."""
    if config.model_settings.device == "cpu":
        return False
    return config.model_settings.device == "cuda" or cluster_gpus >= config.parallel.tensor_parallel_size


def replica_bundles(config: EngineConfig, replica_num_cpus: float, use_gpu: bool) -> list[dict[str, float]]:
    bundles = [{"CPU": replica_num_cpus}]
    if config.parallel.uses_ray_workers:
        cpus = config.parallel.cpus_per_worker(use_gpu)
        worker = {"CPU": cpus, "GPU": 1.0} if use_gpu else {"CPU": cpus}
        bundles += [dict(worker) for _ in range(config.parallel.tensor_parallel_size)]
    elif use_gpu:
        bundles.append(dict(IN_PROCESS_GPU_ENGINE))
    # On CPU at tp 1 the engine actor asks for no resources: bundle 0 holds the replica alone.
    return bundles
