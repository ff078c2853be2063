"""One variant's decode, alone, for a profiler to sample (e.g. ``py-spy record -- python ...``).

Same models and variants as ``paired_speed.py``; no timing of its own beyond one line of
tokens/s. Used to see where a variant's host time goes on a host-bound decode:

    py-spy record -r 250 -f raw -o fix.txt -- python benchmarks/profile_decode.py --variant fix \\
        --model qwen3_next --layers 48 --hidden 2048 --vocab 32000 --experts 32 --dtype bfloat16 --batch 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
from decode_variants import VARIANTS, Decode, add_model_arguments, make_model, model_defaults, prompts_for  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--variant", default="fix", choices=VARIANTS)
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args(argv)
    model_defaults(args)
    if args.device != "default":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    model = make_model(args.model, args.layers, args.hidden, args.vocab, args.dtype, args.experts, args.seed)
    batch = args.batch if args.path == "batched" else 1
    decode = Decode(
        model, args.variant, args.path, prompts_for(batch, args.prompt_len, args.vocab), args.steps
    )
    started = time.perf_counter()
    decode.timed_chunk(args.steps)
    elapsed = time.perf_counter() - started
    run = decode.finish()
    print(
        f"{args.variant}: {run.tokens} tokens in {elapsed:.2f} s, {run.tokens / elapsed:.1f} tok/s, "
        f"retained at end {run.retained_at_end}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
