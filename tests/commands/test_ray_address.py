"""`raypaged launch` / `serve` without --ray-address start a Ray of their own: they never join a
cluster that happens to run on the host (found by Ray through the `ray start` address file), which
would take the server down with it (found by the chaos soak: a server joined another test's
`ray.cluster_utils.Cluster` and died when that one was torn down)."""

from __future__ import annotations

from ray._private.services import canonicalize_bootstrap_address

from raypaged.commands.launch import ray_init_address


def test_unset_starts_a_local_ray_even_when_a_ray_start_cluster_is_on_the_host(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:6390")  # as `ray start` leaves it
    # What Ray does with a bare None: joins that cluster.
    assert canonicalize_bootstrap_address(None, temp_dir=str(tmp_path)).endswith(":6390")
    # What the server asks for: its own (None from the resolver means "start a local instance").
    assert canonicalize_bootstrap_address(ray_init_address(None), temp_dir=str(tmp_path)) is None


def test_a_named_cluster_or_ray_address_is_still_joined(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_address("auto") == "auto" and ray_init_address("10.0.0.5:6379") == "10.0.0.5:6379"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6391")  # a KubeRay pod sets it
    assert canonicalize_bootstrap_address(ray_init_address(None), temp_dir=str(tmp_path)).endswith(":6391")
