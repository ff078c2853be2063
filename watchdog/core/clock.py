"""Every clock the watchdog reads, in one place.

``wall``: seconds of a monotonic clock. The watchdog's own time and its budget, the decode's
time and pace, idle gaps, a walk's and a fix's cost, the warnings' interval.
``now``: the time of day (Unix seconds), for timestamps shown to people (a stop's time), never
for a decision.
``cpu``: CPU seconds of the calling thread. What a walk's work costs (``graph.cpu_clock``),
which spaces walks out and sizes the sampler's readings.

Everything reads them here, at call time (``clock.wall()``, not a name bound at import), so that
replacing these two names decides all the time the watchdog sees: a test runs it on a clock it
moves itself, and its decisions do not depend on the speed of the machine.
"""

from __future__ import annotations

import time

wall = time.perf_counter
cpu = time.thread_time
now = time.time
