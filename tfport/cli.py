"""The ``tfport`` command line.

Each area registers its own subcommands (``add_parsers(subparsers)`` in ``tfport.export.cli``,
``tfport.runtime.cli``, the tools' modules under ``tfport.tools``, ...); they are imported lazily,
by name, so that ``tfport generate`` runs on a host without torch, and a missing extra is reported
as such rather than as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module that defines it (each module has add_parsers(subparsers)).
_COMMANDS = {
    "export": "tfport.export.cli",
    "generate": "tfport.runtime.cli",
    "chat": "tfport.runtime.cli",
    "embed": "tfport.runtime.cli",
    "classify": "tfport.runtime.classify_cli",
    "parity": "tfport.tools.parity.cli",
    "bench": "tfport.tools.bench.cli",
    "bench-scale": "tfport.tools.bench.scale",
    "serve": "tfport.runtime.serve.cli",
    "bench-serve": "tfport.tools.serve_bench",
}
_EXTRA_HINT = {
    "tfport.export.cli": "pip install 'tfport[export]'",
    "tfport.tools.bench.scale": "pip install 'tfport[export,cpu]' (or 'tfport[export,gpu]')",
    "tfport.tools.parity.cli": "pip install 'tfport[export,cpu]' (or 'tfport[export,gpu]')",
    "tfport.runtime.cli": "pip install 'tfport[gpu]' (or 'tfport[cpu]')",
    "tfport.runtime.classify_cli": "pip install 'tfport[gpu,text]' (or 'tfport[cpu,text]')",
    "tfport.tools.bench.cli": "pip install 'tfport[gpu,export]'",
    "tfport.runtime.serve.cli": "pip install 'tfport[serve,cpu]' (or 'tfport[serve,gpu]')",
    "tfport.tools.serve_bench": "pip install 'tfport[serve,cpu]' (or 'tfport[serve,gpu]')",
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfport", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    modules = [_COMMANDS[command]] if command in _COMMANDS else sorted(set(_COMMANDS.values()))
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            if command in _COMMANDS:
                raise SystemExit(f"tfport {command}: needs a package that is not installed "
                                 f"({err}); install it with: {_EXTRA_HINT[module_name]}") from None
            continue  # listing commands: show what this install can run
        module.add_parsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    # ImportError: an extra that only some paths of a command need (ONNX Runtime to validate an export)
    # MemoryError: an export refused up front because its estimated peak does not fit
    except (ValueError, TypeError, OSError, RuntimeError, ImportError, MemoryError) as err:
        print(f"tfport {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
