"""`--data-parallel-size` settings that cannot work are refused before anything starts."""

from __future__ import annotations

import pytest

from raypaged.cli import main


@pytest.mark.parametrize("command", ["launch", "serve"])
def test_builtin_hash_and_a_bad_size_are_refused(command, capsys):
    assert main([command, "--data-parallel-size", "2", "--prefix-caching-hash-algo", "builtin"]) == 2
    assert "--prefix-caching-hash-algo sha256" in capsys.readouterr().err
    assert main([command, "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err


def test_routing_policy_choices():
    with pytest.raises(SystemExit):
        main(["launch", "--routing-policy", "random"])
