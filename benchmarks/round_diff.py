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
import statistics

from paired_stats import read_records, rounds_by_variant


def differences(table: dict, variant: str, reference: str, run: str, rep: int) -> list[float]:
    """Per-round seconds of ``variant`` minus ``reference`` in one repetition of one run, in ms,
    on the rounds both ran (``table``: ``paired_stats.rounds_by_variant``)."""
    ours, theirs = table.get(variant, {}), table.get(reference, {})
    return sorted(
        1e3 * (seconds - theirs[key][1])
        for key, (_, seconds) in ours.items()
        if key[:2] == (run, rep) and key in theirs
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records")
    p.add_argument("pairs", nargs="+", help="variant:reference")
    args = p.parse_args()
    table = rounds_by_variant(read_records([args.records]))
    repetitions = sorted({key[:2] for rounds in table.values() for key in rounds})
    print("| variant | vs | rep | rounds | median, ms | mean, ms | 10% trimmed mean, ms | quartiles, ms |")
    print("|---|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        variant, sep, reference = pair.partition(":")
        if not sep:
            p.error(f"a pair is variant:reference, got {pair!r}")
        for run, rep in repetitions:
            d = differences(table, variant, reference, run, rep)
            if len(d) < 10:
                continue
            cut = len(d) // 10
            print(
                f"| {variant} | {reference} | {rep} | {len(d)} | {statistics.median(d):+.2f} | {statistics.fmean(d):+.2f}"
                f" | {statistics.fmean(d[cut:-cut]):+.2f} | {d[len(d) // 4]:+.2f} .. {d[3 * len(d) // 4]:+.2f} |"
            )


if __name__ == "__main__":
    main()
