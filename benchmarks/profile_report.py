"""Summarize py-spy's raw (collapsed) stacks of ``profile_decode.py``: where the decode's time goes.

Only samples taken inside the timed decode (``timed_chunk``) count. For each function, its
inclusive share of those samples (in any frame of the stack), grouped by file; the watchdog's
own frames first, with the share where it is the innermost Python frame (its own time, and the
native code it calls). Usage: ``python benchmarks/profile_report.py profile-*.txt [--top 25]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*?)(?::\d+)?\)$")


def frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for frame in stack.split(";"):
        m = _FRAME.match(frame.strip())
        out.append((m["func"], os.path.basename(m["file"])) if m else (frame.strip(), ""))
    return out


def summarize(path: str, top: int) -> str:
    inclusive: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()  # innermost Python frame: its own time
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit() or "timed_chunk" not in stack:
                continue
            n = int(count)
            total += n
            stack_frames = frames(stack)
            leaf[stack_frames[-1]] += n
            for key in set(stack_frames):
                inclusive[key] += n
    if not total:
        return f"## {os.path.basename(path)}\n\nno samples inside timed_chunk\n"
    lines = [
        f"## {os.path.basename(path)}",
        "",
        f"{total} samples inside the timed decode",
        "",
        "| function | file | share of samples (in the stack) | own (innermost frame) |",
        "|---|---|---|---|",
    ]
    ours = [(k, v) for k, v in inclusive.items() if k[1] in WATCHDOG_FILES]
    rest = [(k, v) for k, v in inclusive.most_common() if k[1] not in WATCHDOG_FILES]
    for (func, file), n in sorted(ours, key=lambda kv: -kv[1]) + rest[:top]:
        lines.append(
            f"| {func} | {file} | {100 * n / total:.2f}% | {100 * leaf[(func, file)] / total:.2f}% |"
        )
    return "\n".join(lines) + "\n"


_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "watchdog")
WATCHDOG_FILES = (
    {name for name in os.listdir(_PACKAGE) if name.endswith(".py")} if os.path.isdir(_PACKAGE) else set()
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=25, help="other functions shown, by share")
    args = p.parse_args(argv)
    print("\n".join(summarize(path, args.top) for path in args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
