"""The ``sparkforge`` console script: dispatch a subcommand to the package that owns it.

Each subcommand lives in the package whose dependencies it needs, and is imported only when it
runs, so ``sparkforge validate`` works without torch and ``sparkforge train`` never imports vLLM.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Final

# subcommand -> (module with ``main(argv) -> int``, one-line help). A literal table, not a registry.
COMMANDS: Final[dict[str, tuple[str, str]]] = {
    "validate": ("sparkforge.manifests.cli", "check a cache and its manifest (or a train config)"),
    "inspect": ("sparkforge.manifests.cli", "summarise a cache"),
    "plan": ("sparkforge.manifests.cli", "estimate cache size before spending GPU hours"),
    "status": ("sparkforge.manifests.cli", "progress of a cache being produced (or finished)"),
    "produce": ("sparkforge.producer.cli", "capture target hidden states into a cache (vLLM)"),
    "regenerate": ("sparkforge.producer.cli", "sample on-policy responses with the target"),
    "parity": ("sparkforge.producer.cli", "compare vLLM capture with a transformers forward"),
    "finalize": ("sparkforge.producer.cli", "build the manifest once every unit is committed"),
    "train": ("sparkforge.trainer.cli", "train a DSpark draft from a cache (Lightning)"),
    "export": ("sparkforge.trainer.cli", "export a checkpoint as a vLLM/SGLang-servable draft"),
    "eval": ("sparkforge.trainer.cli", "measure acceptance with speculative decoding"),
    "demo": ("sparkforge.shared.demo", "run the whole pipeline on an embedded tiny target"),
}


def _usage() -> str:
    lines = ["usage: sparkforge <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sparkforge <command> ...``; returns the process exit code (2 on a usage error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"sparkforge: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    result: int = module.main([name, *rest])
    return result


if __name__ == "__main__":
    sys.exit(main())
