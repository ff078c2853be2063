"""The ``mlx-watchdog`` command line: ``main.py`` parses and dispatches; each command is a module
with ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)``; ``common.py`` holds what they
share."""
