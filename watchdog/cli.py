"""``mlx-watchdog``: the command line.

    mlx-watchdog demo                      # a tiny hybrid model leaking live, then fixed
    mlx-watchdog diagnose --model PATH     # leak report for a real model (exit 1 on a leak)
    mlx-watchdog diagnose --to-the-limit --limit 20000
    mlx-watchdog scan [FAMILY ...]         # every mlx-lm architecture, built tiny, leaks named
    mlx-watchdog serve --fix -- --model PATH   # mlx_lm.server, watched (see serve.py)

Exit status: 0 fine, 1 a leak was found (diagnose) or the fix did not hold (demo), 2 usage or
load errors (a bad option, a model that cannot be loaded, demo's metrics port in use). ``serve``
exits 1 when its metrics endpoint cannot start (a port in use, a bad address or TLS file) and
otherwise with mlx_lm.server's own status (0 after Ctrl-C or SIGTERM).

``serve`` is imported only when chosen: ``demo`` and ``diagnose`` must work even where
serve.py (or mlx-lm's server) cannot be imported.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import __version__, options

EXIT_OK = 0
EXIT_LEAK = 1
EXIT_USAGE = 2

PROG = "mlx-watchdog"


class UsageError(Exception):
    """A mistake the user can fix (bad option, missing model, demo's port in use): exit status 2."""


# --------------------------------------------------------------------------- argument types

def checked(convert, is_valid, what: str, name: str):
    """An argparse type: ``convert`` the text, then check it; errors say what was expected."""

    def parse(text: str):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not is_valid(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = checked(int, options.POSITIVE_INT.holds, options.POSITIVE_INT.what, "positive_int")
port_number = checked(int, options.PORT.holds, options.PORT.what, "port_number")
step_count = checked(float, options.STEPS.holds, options.STEPS.what, "step_count")
fraction = checked(float, options.FRACTION.holds, options.FRACTION.what, "fraction")
seconds = checked(float, options.SECONDS.holds, options.SECONDS.what, "seconds")


# --------------------------------------------------------------------------- parser

def build_parser(load_serve: bool = True) -> argparse.ArgumentParser:
    """The parser. ``load_serve=False`` leaves ``serve``'s options out (no import of serve.py)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Watch MLX decodes for the lazy-graph buffer leaks that end in "
                    "`[metal::malloc] Resource limit (499000) exceeded`: see, name, forecast, fix.",
        epilog="`mlx-watchdog COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    from . import demo, diagnose  # light: they import MLX only when they run

    demo.add_arguments(commands.add_parser(
        "demo", help="watch a tiny random-weight hybrid model leak live, then fix it (no download)",
        description=demo.DESCRIPTION))
    diagnose.add_arguments(commands.add_parser(
        "diagnose", help="measure a model's leak, forecast the crash, check the fix",
        description=diagnose.DESCRIPTION))
    from . import scan  # `scan` (issue 18): every mlx-lm family, built tiny, decoded watched

    scan.add_arguments(commands.add_parser(
        "scan", help="build every mlx-lm architecture tiny, decode it watched, name its leaks",
        description=scan.DESCRIPTION))

    serve_parser = commands.add_parser(
        "serve", help="run mlx_lm.server with every model watched (server options after `--`)",
        usage=f"{PROG} serve [watchdog options] -- [mlx_lm.server arguments]",
        description="Run mlx_lm.server in this process with every model it loads watched. "
                    "Everything after `--` goes to mlx_lm.server.")
    if load_serve:
        serve_module, problem = _import_serve()
        if serve_module is not None:
            serve_module.add_arguments(serve_parser)
        serve_parser.set_defaults(serve_problem=problem)
    return parser


def _import_serve():
    """(module, None) or (None, why it cannot be imported)."""
    try:
        from . import serve
    except Exception as exc:  # a missing or broken serve.py must not break demo/diagnose
        return None, f"{type(exc).__name__}: {exc}"
    return serve, None


def split_server_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at the first literal ``--``: (our arguments, mlx_lm.server's arguments)."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


# --------------------------------------------------------------------------- main

def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, server_argv = split_server_argv(argv)
    parser = build_parser(load_serve="serve" in ours)
    try:
        args = parser.parse_args(ours)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    if args.command != "serve" and server_argv:
        print(f"{PROG} {args.command}: error: arguments after `--` ({' '.join(server_argv)}) are "
              f"passed to mlx_lm.server; only `serve` takes them", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "demo":
            from . import demo

            return demo.run(args)
        if args.command == "diagnose":
            from . import diagnose

            return diagnose.run(args)
        if args.command == "scan":
            from . import scan

            return scan.run(args)
        return _run_serve(args, server_argv)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


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
