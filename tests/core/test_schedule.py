"""The schedule's wake-up marks (``wake_step``, ``wake_decode``) never hide a walk that is due.

``observe()`` calls ``Schedule.due`` only once a step or the decode time reaches them, so a mark
set too late would leave the watchdog blind until it is reached. Checked on random decodes driven
as ``observe()`` drives the schedule (``due`` asked once the marks are reached, a walk whenever one
is due), with new epochs, batch changes, spent budgets, fixes, refunds and budget changes thrown
in: at every step, a copy of the schedule is asked whatever the marks say (``due`` may move the
marks: the copy's are not the ones observe() would have), and must never say a walk is due while
the marks are not reached."""

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.core.schedule import BEAT_RATIO, FIRST_BEAT, Schedule

events = st.lists(
    st.tuples(
        st.sampled_from(["step"] * 12 + ["epoch", "join", "unmeasured", "spend", "fix", "refund", "budget"]),
        st.floats(min_value=0.0, max_value=0.2),  # a step's seconds, or the budget spent
        st.floats(min_value=1e-6, max_value=0.01),  # the cost of a walk made at this step
        st.floats(min_value=0.0, max_value=1.0),  # its CPU share
    ),
    min_size=1,
    max_size=400,
)


@settings(max_examples=300, deadline=None)
@given(
    events=events,
    budget=st.sampled_from([0.0, 0.001, 0.01, 1.0]),
    interval=st.sampled_from([None, 0.0, 0.05, 2.0]),
)
def test_the_marks_never_hide_a_due_walk(events, budget, interval):
    schedule = Schedule(budget, interval, beats=budget != 1.0)
    step = 0
    measured = True  # the growth is known (it changes at a walk or a new epoch)
    for kind, seconds, cost, cpu_share in events:
        if kind == "step":
            step += 1
            schedule.decode_seconds += seconds
            schedule.spent += seconds * cpu_share / 100  # the step's own observe()
        elif kind in (
            "epoch",
            "join",
            "unmeasured",
        ):  # a new decode; a busy batch changed, growth known or not
            measured = kind != "unmeasured"
            schedule.new_epoch(step, continuing=kind != "epoch", measured=measured)
        elif kind == "fix":  # charged with the step, and as the fix's
            schedule.spent += seconds / 10
            schedule.charge_fix(seconds / 10)
        elif kind == "refund":  # the program's deferred frees, paid inside observe()
            schedule.refund(min(schedule.spent, seconds / 10))
        elif kind == "budget":
            schedule.overhead_budget = cpu_share / 10
        else:
            schedule.spent += seconds
        woken = step >= schedule.wake_step or schedule.decode_seconds >= schedule.wake_decode
        due = copy.copy(schedule).due(step, measured)  # (due() assigns fields: a shallow copy will do)
        assert woken or not due, (
            kind,
            step,
            schedule.wake_step,
            schedule.decode_seconds,
            schedule.wake_decode,
        )
        if woken:
            assert schedule.due(step, measured) == due  # as observe() asks (the marks may move)
        if due:
            schedule.walked(step, cost, cost * cpu_share)
            schedule.spent += cost
            measured = cpu_share > 0.3


def test_the_marks_due_sets_never_hide_a_due_walk():
    """A walk the budget holds back does not have every step ask: ``due`` moves the marks to
    where the decode has paid for it. Long random decodes in which that happens (a budget spent by
    the steps, the fix and the walks, refunds and budget changes), seeded: ``due`` is asked of a copy
    at every step, whatever the marks say, and is never True while they are not reached; a step
    asks in vain far less often than once."""
    hidden = asked = steps = held = 0
    for trial in range(150):
        rng = random.Random(trial)
        schedule = Schedule(rng.choice([0.001, 0.01, 0.1]), rng.choice([None, 0.0, 0.05]), rng.random() < 0.5)
        step = 0
        for _ in range(400):
            kind = rng.choice(["step"] * 12 + ["epoch", "join", "spend", "fix", "refund", "budget"])
            seconds, cost, share = rng.uniform(0, 0.2), rng.uniform(1e-6, 0.01), rng.random()
            if kind == "step":
                step += 1
                steps += 1
                schedule.decode_seconds += seconds
                schedule.spent += seconds * share / 100
            elif kind in ("epoch", "join"):
                schedule.new_epoch(step, continuing=kind == "join", measured=share < 0.5)
            elif kind == "fix":
                schedule.spent += seconds / 10
                schedule.charge_fix(seconds / 10)
            elif kind == "refund":
                schedule.refund(min(schedule.spent, seconds / 10))
            elif kind == "budget":
                schedule.overhead_budget = share / 10
            else:
                schedule.spent += seconds
            woken = step >= schedule.wake_step or schedule.decode_seconds >= schedule.wake_decode
            due = copy.copy(schedule).due(step)
            hidden += due and not woken
            if woken:
                asked += 1
                held += not due
                assert schedule.due(step) == due
            if due:
                schedule.walked(step, cost, cost * share)
                schedule.spent += cost
    assert hidden == 0
    # Walks were held back, yet the steps rarely asked in vain: 1.09 asks a step without the marks
    # due() sets, 0.38 with them.
    assert held < 0.5 * steps, (held, asked, steps)


def test_the_marks_skip_the_steps_between_walks():
    """After the dense walks and before the interval has passed, the marks are not reached: the
    per-step path makes no call. At the interval, the walk is due."""
    schedule = Schedule(0.01, None)
    schedule.new_epoch(1)
    schedule.walked(1, 0.001, 0.001)
    assert schedule.wake_step == 2  # the next dense offset (1 step in)
    for offset in (1, 2, 4, 8, 16, 32, 64):
        schedule.walked(1 + offset, 0.0001, 0.0001)
    # The dense walks are done: the next by steps is the first beat, 96 steps into the decode.
    assert schedule.wake_step == 1 + FIRST_BEAT
    schedule.decode_seconds = schedule.wake_decode - 0.01
    assert not schedule.due(90)
    schedule.decode_seconds = schedule.wake_decode
    assert schedule.due(90)


def test_walks_owed_at_steps_counted_from_the_decode_s_start():
    """Whatever the decode time: 96, 144, 216, ... steps into the decode, each BEAT_RATIO times
    the last; a busy batch's changes (a continuing epoch) do not restart them."""
    schedule = Schedule(0.01, 1e9)  # no walk by decode time
    schedule.new_epoch(1)
    walked = []
    for step in range(1, 3000):
        if step == 500:
            schedule.new_epoch(step, continuing=True)
        if step >= schedule.wake_step and schedule.due(step):
            walked.append(step)
            schedule.walked(step, 1e-4, 1e-4)
            schedule.spent += 1e-4
    beats = [step - 1 for step in walked if step - 1 >= FIRST_BEAT and step != 501]  # 501: the change
    assert beats[:8] == [96, 144, 216, 324, 486, 729, 1094, 1641]
    assert all(b / a == pytest.approx(BEAT_RATIO, abs=0.01) for a, b in zip(beats, beats[1:]))
