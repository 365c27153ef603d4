"""`raypaged` command line: one sub-command per job; each registers its own arguments."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each module's add_parser() stays import-light; the heavy imports happen inside its run().
    from raypaged.commands import generate, launch, serve
    from raypaged.simulator import cli as simulate_cli

    generate.add_parser(sub)
    launch.add_parser(sub)
    serve.add_parser(sub)
    simulate_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
