"""``python -m mlx_watchdog``: the ``mlx-watchdog`` command."""

import sys

from .commands.main import main

sys.exit(main())
