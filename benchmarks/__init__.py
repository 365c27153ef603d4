"""raypaged's benchmarks: each module is one command, run from the repository root as
`python -m benchmarks.<name>` (see benchmarks/README.md); shared helpers live in benchmarks.lib."""
