"""The ``elasticlab`` command line (also ``python -m elasticlab``).

Each subcommand is a module in :mod:`elasticlab.commands` exposing ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; they are discovered, not listed here.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from elasticlab import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticlab", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"elasticlab.commands.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
