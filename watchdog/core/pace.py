"""The step clock: when the observed steps came, their pace, and whether anything is stepping.

``observe`` writes it at every step (the time of the step, kept for the last ``SAMPLE_WINDOW``
steps, and the thread that ran it); the forecast reads the steps' rate and whether the decode is
idle: no step for ``IDLE_SECONDS`` (or for 8 typical steps, if longer), or the attachment said the
generation ended. After a pause, the pace before it stands in until two steps are seen."""

from __future__ import annotations

import collections
import math

from . import clock
from .growth import SAMPLE_WINDOW

IDLE_SECONDS = 3.0  # no step for this long (or 8 typical steps, if longer) is idle: nothing grows


class StepClock:
    def __init__(self) -> None:
        self.last = math.inf  # the time of the last step (the first step's gap is no decode time)
        self.times: collections.deque[tuple[int, float]] = collections.deque(maxlen=SAMPLE_WINDOW)
        self.pace_before_pause = 0.0  # seconds per step before the last pause
        self.ended = False  # the attachment said the generation ended
        self.thread: int | None = None  # the thread that ran the last step
        # A gap between two steps shorter than this is never idle: set by an attachment whose
        # steps are known to be slow (a training step of several seconds: a first gap longer
        # than IDLE_SECONDS would otherwise read as a pause, at every step).
        self.min_idle_seconds = 0.0

    def seconds_per_step(self) -> float:
        """Over the steps since the last pause; until two are seen, the pace before it."""
        times = self.times
        if len(times) >= 2:
            (s0, t0), (s1, t1) = times[0], times[-1]
            if t1 > t0:
                return (t1 - t0) / (s1 - s0)
        return self.pace_before_pause

    def idle_seconds(self) -> float:
        """A gap longer than this is a pause. A slow decode (a big model on a slow host) is not
        idle between its steps."""
        return max(IDLE_SECONDS, 8 * self.seconds_per_step(), self.min_idle_seconds)

    def step_rate(self) -> float:
        """Steps per second over the steps since the last pause (0 until two are seen)."""
        if len(self.times) < 2:
            return 0.0
        (s0, t0), (s1, t1) = self.times[0], self.times[-1]
        if t1 <= t0:
            return 0.0
        return (s1 - s0) / (t1 - t0)

    def stepping(self) -> bool:
        """Is anything stepping? False once ended, or after an idle gap."""
        if self.ended or self.last == math.inf:
            return False
        return clock.wall() - self.last <= self.idle_seconds()

    def end(self) -> bool:
        """The generation ended; False when it had already."""
        if self.ended:
            return False
        self.ended = True
        return True

    def resume(self) -> None:
        """The first step after a pause: the gap is no step time, the pace before it stands in."""
        self.ended = False
        self.pace_before_pause = self.seconds_per_step()
        self.times.clear()
