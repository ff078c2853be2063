"""The ``mlx-watchdog`` command line: ``main.py`` parses and dispatches; each command is a module
with ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)`` (demo.py, diagnose.py, scan.py,
serve.py); ``common.py`` holds what they share, ``decode.py`` the watched decode through mlx-lm,
``load.py`` the model ``--model`` names, ``to_the_limit.py`` ``diagnose --to-the-limit``'s parent
and child processes, ``plot.py`` the ``--plot`` figure."""
