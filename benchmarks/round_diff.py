"""Where a paired difference sits: in every round, or in a few (``paired_speed.py`` records).

A cost that comes with rare events (a walk every ~140 steps) moves the mean of the per-round
differences but not their median; one paid at every step moves both. This prints, for each
``variant:reference`` pair and repetition, the distribution of the per-round differences in
milliseconds (a round is one record, e.g. 25 one-step turns).

Example (``speed_h200.md``): when the walks read the caches' ``__dict__``, ``watched`` against
``nowalk`` had a median round of +1.3-1.7 ms on the leak-free H200 llama. Every round paid, not
only the ~12 rounds with a walk: the read was slowing every later forward
(``inline_attributes.py``).

Usage: python benchmarks/round_diff.py RECORDS.jsonl watched:nowalk [more pairs]
"""

from __future__ import annotations

import argparse
import json
import statistics


def round_seconds(path: str) -> dict[tuple[int, int, str], float]:
    """(repetition, round, variant) -> seconds of that record."""
    out = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "chunk":
                out[(record["rep"], record["round"], record["variant"])] = record["seconds"]
    return out


def differences(seconds: dict, variant: str, reference: str, rep: int) -> list[float]:
    """Per-round seconds of ``variant`` minus ``reference``, in ms, on the rounds both ran."""
    return sorted(1e3 * (s - seconds[(r, k, reference)]) for (r, k, v), s in seconds.items()
                  if r == rep and v == variant and (r, k, reference) in seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records")
    p.add_argument("pairs", nargs="+", help="variant:reference")
    args = p.parse_args()
    seconds = round_seconds(args.records)
    reps = sorted({rep for rep, _, _ in seconds})
    print("| variant | vs | rep | rounds | median, ms | mean, ms | 10% trimmed mean, ms | quartiles, ms |")
    print("|---|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        variant, sep, reference = pair.partition(":")
        if not sep:
            p.error(f"a pair is variant:reference, got {pair!r}")
        for rep in reps:
            d = differences(seconds, variant, reference, rep)
            if len(d) < 10:
                continue
            cut = len(d) // 10
            print(f"| {variant} | {reference} | {rep} | {len(d)} | {statistics.median(d):+.2f} | {statistics.fmean(d):+.2f}"
                  f" | {statistics.fmean(d[cut:-cut]):+.2f} | {d[len(d) // 4]:+.2f} .. {d[3 * len(d) // 4]:+.2f} |")


if __name__ == "__main__":
    main()
