"""``jitserve``: one command for the server and the compiler.

    jitserve serve [--port 8000] [--data-dir DIR] [...]   run the server (every setting is a flag, or a
                                                          JITSERVE_* variable; --help lists them)
    jitserve inspect MODEL                                 the model's signature and symbolic axes
    jitserve compile MODEL --shape x=1,3,48,192 [...]      compile and verify buckets into the store
    jitserve bench MODEL --shape x=1,3,48,192 [...]        time every engine on each bucket
    jitserve explain MODEL --shape x=1,3,48,192 [...]      an explain bundle and report per bucket

``python -m server`` and ``python -m compiler`` do the same. Only ``serve`` loads the web stack.
"""

from __future__ import annotations

import sys

COMPILER_COMMANDS = ("inspect", "compile", "bench", "explain")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command == "serve":
        from .__main__ import serve

        return serve(argv[1:], prog="jitserve serve")
    if command in COMPILER_COMMANDS:
        from compiler.cli import main as compile_main

        return compile_main(argv, prog="jitserve")
    asked = command in ("-h", "--help")
    print(__doc__.strip() if asked else f"usage: jitserve {{serve,{','.join(COMPILER_COMMANDS)}}} ...\n"
          f"error: {'no command' if command is None else f'unknown command {command!r}'}; jitserve --help "
          "lists them", file=sys.stdout if asked else sys.stderr)  # fmt: skip
    return 0 if asked else 2
