"""Paired speed ratios with bootstrap intervals, from per-chunk records (``paired_speed.py``).

A *round* runs every variant of a repetition once, for one chunk of steps, in a random order, so
two chunks of the same round are seconds apart and see the same machine. The ratio of variant A to
variant B is the ratio of their tokens/s summed over the rounds both ran (the speed over the whole
decode, not a mean of per-chunk ratios). Its interval comes from a bootstrap at two levels:
each resample draws repetitions (with replacement), then rounds within each drawn repetition. A
repetition builds its own decodes, and on the H200 two identical decodes read up to 1% apart for
a whole repetition (an A/A control: -1.02% in one, -0.26% in the next): an effect of the
instance, which rounds drawn only within repetitions would take for a difference between
variants, and call narrow. With one repetition it is the bootstrap over its rounds.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterable

import numpy as np

BOOTSTRAP_RESAMPLES = 4000


@dataclasses.dataclass
class Ratio:
    a: str
    b: str
    ratio: float  # tokens/s of a over tokens/s of b, over the rounds both ran
    low: float  # 95% bootstrap interval
    high: float
    rounds: int
    spread: float  # interquartile range of the per-round ratios (what one chunk says alone)

    def percent(self, value: float | None = None) -> str:
        return f"{100 * ((self.ratio if value is None else value) - 1):+.2f}%"

    def interval(self) -> str:
        return f"{self.percent(self.low)} .. {self.percent(self.high)}"

    def excludes_loss(self, loss: float = 0.01) -> bool:
        """Does the interval exclude a loss of more than ``loss`` (a slowdown of a vs b)?"""
        return self.low > 1 - loss

    def within(self, band: float = 0.01) -> bool:
        """Is the whole interval inside +/- ``band``?"""
        return 1 - band < self.low and self.high < 1 + band


def read_records(paths: Iterable[str]) -> list[dict]:
    """Every JSON line of every file (a run cut by its time box leaves a valid prefix; a torn
    last line is skipped)."""
    records = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return records


def rounds_by_variant(records: list[dict]) -> dict[str, dict[tuple, tuple[float, float]]]:
    """variant -> {(run, rep, round): (tokens, seconds)} from the chunk records."""
    table: dict[str, dict[tuple, tuple[float, float]]] = collections.defaultdict(dict)
    for r in records:
        if r.get("type") == "chunk":
            table[r["variant"]][(r["run"], r["rep"], r["round"])] = (r["tokens"], r["seconds"])
    return table


STALL_FACTOR = 1.5


def stalls(table: dict, factor: float = STALL_FACTOR) -> dict[tuple, str]:
    """Rounds in which one variant took more than ``factor`` times the round's median seconds per
    token, and which one. In one process, a one-off cost such as the first compile of a kernel
    for a new shape is paid by whichever variant reaches that shape first: such rounds say
    nothing about the variants (unless one variant has most of them: the report lists them)."""
    by_round: dict[tuple, dict[str, float]] = collections.defaultdict(dict)
    for variant, rounds in table.items():
        for key, (tokens, seconds) in rounds.items():
            by_round[key][variant] = seconds / max(tokens, 1)
    found = {}
    for key, per_variant in by_round.items():
        if len(per_variant) < 3:
            continue
        median = float(np.median(list(per_variant.values())))
        slowest = max(per_variant, key=per_variant.get)
        if per_variant[slowest] > factor * median:
            found[key] = slowest
    return found


def paired_ratio(
    table: dict, a: str, b: str, seed: int = 0, skip: Iterable = (), levels: int = 2
) -> Ratio | None:
    """Tokens/s of ``a`` over ``b`` on the rounds both ran (less ``skip``), with a bootstrap
    interval: ``levels=2`` draws repetitions, then rounds within them; ``levels=1`` keeps every
    repetition and draws only its rounds (blind to what differs between repetitions)."""
    keys = sorted((set(table.get(a, {})) & set(table.get(b, {}))) - set(skip))
    if not keys:
        return None
    ta = np.array([table[a][k][0] for k in keys], dtype=float)
    sa = np.array([table[a][k][1] for k in keys], dtype=float)
    tb = np.array([table[b][k][0] for k in keys], dtype=float)
    sb = np.array([table[b][k][1] for k in keys], dtype=float)

    rng = np.random.default_rng(seed)
    strata = collections.defaultdict(list)
    for i, k in enumerate(keys):
        strata[k[:2]].append(i)
    # Per repetition and resample, the sums of its drawn rounds: (tokens a, seconds a, tokens b, seconds b).
    columns = np.stack([ta, sa, tb, sb])
    sums = np.stack(
        [
            columns[:, rng.choice(np.array(members), size=(BOOTSTRAP_RESAMPLES, len(members)))].sum(-1).T
            for members in strata.values()
        ]
    )  # (repetitions, resamples, 4)
    reps = len(sums)
    picked = (
        rng.integers(0, reps, size=(BOOTSTRAP_RESAMPLES, reps))
        if levels == 2
        else np.tile(np.arange(reps), (BOOTSTRAP_RESAMPLES, 1))
    )
    totals = sums[picked, np.arange(BOOTSTRAP_RESAMPLES)[:, None]].sum(1)  # (resamples, 4)
    samples = (totals[:, 0] / totals[:, 1]) / (totals[:, 2] / totals[:, 3])
    per_round = (ta / sa) / (tb / sb)
    q1, q3 = np.percentile(per_round, [25, 75])
    low, high = np.percentile(samples, [2.5, 97.5])
    point = (ta.sum() / sa.sum()) / (tb.sum() / sb.sum())
    return Ratio(a, b, float(point), float(low), float(high), len(keys), float(q3 - q1))


def emit(text: str, out: str | None) -> None:
    """Print a report and append it to ``out`` (a results file), when given."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
