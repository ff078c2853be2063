"""One rank of tests/attach/test_distributed.py, started by ``mlx.launch --backend ring -n 2``.

Every rank decodes the same tiny model with mlx-lm's ``generate_step`` through the ``@watch``
decorator, exactly as a user would write it (``instrument()`` first, then the decorator and its
metrics port, before ``mx.distributed.init()``); only ``--leak-rank`` leaks, through a lazy chain on a cache
attribute. Each rank writes ``rank<r>.json`` with what it saw, keeps serving metrics until the
test creates ``--release`` (or ``--hold`` seconds pass), then meets the other ranks in a final
barrier: the ring backend tears every rank down when one exits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import mlx.core as mx

from mlx_watchdog import ResourceLimitForecast, Watchdog, watch
from mlx_watchdog.attach import distributed
from mlx_watchdog.exporters.prometheus import default_metrics_port


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("--metrics-base", type=int, required=True)
    parser.add_argument("--leak-rank", type=int, default=1)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--stop-within", type=float, default=100)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--release", required=True, help="file whose creation ends the hold")
    parser.add_argument("--hold", type=float, default=60.0, help="longest wait for --release, seconds")
    return parser.parse_args()


def number(x: float):
    return x if math.isfinite(x) else str(x)  # JSON has no infinity


def agreement_record(a) -> dict:
    return {
        "step": a.step,
        "steps_to_limit": number(a.steps_to_limit),
        "worst_rank": a.worst_rank,
        "stop_step": a.stop_step,
        "in_lockstep": a.in_lockstep,
        "readings": [number(r.steps_to_limit) for r in a.readings],
    }


def main() -> int:
    args = parse_args()
    distributed.instrument()  # before anything initializes the group
    launched_rank = int(os.environ.get("MLX_RANK", "0"))
    port = default_metrics_port(args.metrics_base)

    # As a user writes it: the decorator (and its watchdog) exist before the group does.
    # overhead_budget=1: walk every step, so the tiny leak is measured from the first steps.
    @watch(
        name="tiny",
        limit=args.limit,
        stop_within=args.stop_within,
        overhead_budget=1.0,
        walk_interval=0,
        metrics_port=port,
    )
    def decode(model, prompt, prompt_cache=None, max_tokens=16, on_token=None):
        from mlx_lm.generate import generate_step

        for token, _ in generate_step(prompt, model, prompt_cache=prompt_cache, max_tokens=max_tokens):
            on_token()
            yield int(token)

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    wd = decode.watchdog
    later = Watchdog(name="later", export=False)  # created once the group exists
    result = {
        "rank": rank,
        "world_size": size,
        "launched_rank": launched_rank,
        "metrics_port": port,
        "wd_rank": wd.rank,
        "wd_world_size": wd.world_size,
        "coordinated": isinstance(wd.coordinator, distributed.Coordinator),
        "later": {
            "rank": later.rank,
            "world_size": later.world_size,
            "coordinated": isinstance(later.coordinator, distributed.Coordinator),
        },
    }

    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog import tiny

    model = tiny.build_model("llama", layers=2, seed=0)
    cache = make_prompt_cache(model)
    cache[0].extra = mx.array(0)
    mx.eval(cache[0].extra)

    def on_token():
        if rank == args.leak_rank:  # one stranded buffer and one pending node per step
            cache[0].extra = cache[0].extra - 1

    # Record what this rank fed to each agreement and what the group agreed.
    local: dict[int, float] = {}
    agreements: list[dict] = []
    coordinator = wd.coordinator
    if coordinator is not None:
        agreed_worst = coordinator.worst

        def recorded_worst(step, steps_to_limit):
            local[step] = steps_to_limit
            try:
                return agreed_worst(step, steps_to_limit)
            finally:
                a = coordinator.agreement
                if a is not None and (not agreements or agreements[-1]["step"] != a.step):
                    agreements.append(agreement_record(a))

        coordinator.worst = recorded_worst
        real_gather = coordinator._all_gather
        result["collectives"] = 0

        def counted_gather(*args, **kwargs):  # the collective, counted: its cost is how often it runs
            result["collectives"] += 1
            return real_gather(*args, **kwargs)

        coordinator._all_gather = counted_gather

    tokens, stop = 0, None
    start = time.perf_counter()
    try:
        for _ in decode(
            model,
            mx.array([1, 2, 3, 4, 5]),
            prompt_cache=cache,
            max_tokens=args.max_tokens,
            on_token=on_token,
        ):
            tokens += 1
    except ResourceLimitForecast as exc:
        f = exc.forecast
        a = getattr(exc, "agreement", None)
        if a is not None and (not agreements or agreements[-1]["step"] != a.step):
            agreements.append(agreement_record(a))
        stop = {
            "step": wd.steps,
            "reason": exc.reason,
            "rank": f.rank,
            "steps_to_limit": number(f.steps_to_limit),
            "resident_buffers": f.resident_buffers,
            "limit": f.limit,
            "buffers_per_step": f.buffers_per_step,
            "agreement": agreement_record(a) if a is not None else None,
            "local_steps_to_limit": number(wd.forecast().steps_to_limit),
            "local_resident_buffers": wd.forecast().resident_buffers,
        }
    decode_seconds = time.perf_counter() - start
    every = coordinator.every if coordinator is not None else None
    result.update(
        {
            "tokens": tokens,
            "steps": wd.steps,
            "stop": stop,
            "stops": dict(wd.stops),
            "decode_seconds": decode_seconds,
            "overhead_seconds": wd.overhead_seconds,
            "every": every,
            "agreements": agreements,
            # The local forecast this rank fed to each round (rounds start at multiples of `every`).
            "local_at_rounds": {str(s): number(v) for s, v in local.items() if every and s % every == 0},
            "rounds": coordinator.rounds if coordinator is not None else 0,
            "coordinator_seconds": coordinator.seconds if coordinator is not None else 0.0,
            "internal_errors": wd.internal_errors,
        }
    )
    write_json(os.path.join(args.out, f"rank{rank}.json"), result)

    # Keep serving metrics until the test has seen them, then leave together.
    deadline = time.monotonic() + args.hold
    while not os.path.exists(args.release) and time.monotonic() < deadline:
        time.sleep(0.1)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return 0


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
