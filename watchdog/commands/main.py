"""``mlx-watchdog``: the command line.

    mlx-watchdog demo                         # a tiny hybrid model leaking live, then fixed
    mlx-watchdog diagnose --model PATH        # leak report for a real model (exit 1 on a leak)
    mlx-watchdog diagnose --to-the-limit --limit 20000
    mlx-watchdog scan [FAMILY ...]            # every mlx-lm architecture, built tiny, leaks named
    mlx-watchdog serve --fix -- --model PATH  # mlx_lm.server, watched (see serve.py)
    mlx-watchdog run --fix -- python app.py   # any Python program, watched (see run.py)

Each subcommand is a module with ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)``,
registered in ``build_parser``; what they share (exit codes, argument types, consoles) is in
``common.py``, which they import instead of this module. ``decode.py`` (the watched decode),
``load.py`` (``--model``) and ``to_the_limit.py`` (``diagnose --to-the-limit``'s child process)
serve the commands.

Exit status: 0 fine, 1 a leak was found (diagnose) or the fix did not hold (demo), 2 usage or
load errors (a bad option, a model that cannot be loaded, a port in use). ``serve`` otherwise
exits with mlx_lm.server's own status (0 after Ctrl-C or SIGTERM).

``serve`` and ``run`` are imported only when chosen: ``demo`` and ``diagnose`` must work even
where serve.py (or mlx-lm's server) cannot be imported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from .common import EXIT_INTERRUPTED, EXIT_LEAK, EXIT_OK, EXIT_USAGE, PROG, UsageError, split_server_argv  # noqa: F401

SERVE_USAGE = f"{PROG} serve [watchdog options] -- [mlx_lm.server arguments]"
RUN_USAGE = f"{PROG} run [watchdog options] -- COMMAND [ARGS ...]"


def _register(commands, name: str, module, help: str, **kwargs) -> argparse.ArgumentParser:
    """One subcommand: ``module.add_arguments(parser)``; ``module.run(args)`` runs it."""
    parser = commands.add_parser(name, help=help, description=module.DESCRIPTION, **kwargs)
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)
    return parser


def build_parser(load_serve: bool = True, load_run: bool = False) -> argparse.ArgumentParser:
    """The parser. ``load_serve=False`` leaves ``serve``'s options out (no import of serve.py);
    ``load_run=True`` adds ``run``'s (an import of run.py)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Watch MLX decodes for the lazy-graph buffer leaks that end in "
        "`[metal::malloc] Resource limit (499000) exceeded`: see, name, forecast, fix.",
        epilog="`mlx-watchdog COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    from . import demo, diagnose, scan  # light: they import MLX only when they run

    _register(
        commands, "demo", demo, "watch a tiny random-weight hybrid model leak live, then fix it (no download)"
    )
    _register(commands, "diagnose", diagnose, "measure a model's leak, forecast the crash, check the fix")
    _register(
        commands, "scan", scan, "build every mlx-lm architecture tiny, decode it watched, name its leaks"
    )

    serve_parser = commands.add_parser(
        "serve",
        help="run mlx_lm.server with every model watched (server options after `--`)",
        usage=SERVE_USAGE,
        description="Run mlx_lm.server in this process with every model it loads watched. "
        "Everything after `--` goes to mlx_lm.server.",
    )
    if load_serve:
        serve_module, problem = _import_serve()
        if serve_module is not None:
            serve_module.add_arguments(serve_parser)
        serve_parser.set_defaults(serve_problem=problem)

    run_parser = commands.add_parser(
        "run",
        help="run any Python program with every model it loads watched (COMMAND after `--`)",
        usage=RUN_USAGE,
        description="Run a Python program with every model it loads through mlx-lm or mlx-vlm "
        "watched, its child processes too. COMMAND goes after `--`.",
    )
    if load_run:
        from . import run

        run.add_arguments(run_parser)
        run_parser.set_defaults(run=run.run)
    return parser


def _import_serve():
    """(module, None) or (None, why it cannot be imported)."""
    try:
        from . import serve
    except Exception as exc:  # a missing or broken serve.py must not break demo/diagnose
        return None, f"{type(exc).__name__}: {exc}"
    return serve, None


def _usage_error(command: str, message: str) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, server_argv = split_server_argv(argv)
    parser = build_parser(load_serve="serve" in ours, load_run="run" in ours)
    try:
        args, unknown = parser.parse_known_args(ours)
        if unknown and args.command == "serve":
            return _usage_error(
                "serve",
                f"unrecognized arguments: {' '.join(unknown)}; mlx_lm.server's "
                f"own arguments go after `--`: {PROG} serve [watchdog options] -- "
                f"{' '.join(unknown)}",
            )
        if unknown and args.command == "run":
            return _usage_error(
                "run",
                f"unrecognized arguments: {' '.join(unknown)}; the command goes after `--`: {RUN_USAGE}",
            )
        if unknown:
            parser.parse_args(ours)  # argparse's own message and usage (exits 2)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    if args.command == "run":
        args.command_argv = server_argv
    elif args.command != "serve" and server_argv:
        return _usage_error(
            args.command,
            f"arguments after `--` ({' '.join(server_argv)}) are "
            "passed to mlx_lm.server; only `serve` takes them",
        )
    try:
        if args.command == "serve":
            return _run_serve(args, server_argv)
        return args.run(args)
    except UsageError as exc:
        return _usage_error(args.command, str(exc))
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_serve(args: argparse.Namespace, server_argv: list[str]) -> int:
    problem = getattr(args, "serve_problem", None)
    if problem is not None:
        raise UsageError(f"`serve` is not available in this installation ({problem})")
    from . import serve

    try:
        return serve.run(args, server_argv)
    except ValueError as exc:  # serve's own validation of its options
        raise UsageError(str(exc)) from exc


if __name__ == "__main__":
    sys.exit(main())
