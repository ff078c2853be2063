"""Worst single ``observe()`` and decode tokens/s: a base revision of the package (``old``) against
the working tree (``new``), interleaved, in one run.

Each variant runs in a worker process of its own, started once and kept for the whole run:

* ``old``: ``mlx_watchdog`` is the ``watchdog/`` folder of ``--old-rev`` (default HEAD: a change
  against the commit it starts from), taken out with ``git archive`` into a temporary folder and
  put first on the worker's ``PYTHONPATH`` (``--old-src DIR`` takes a ``watchdog/`` folder instead);
* ``new`` and ``new-again``: the working tree's ``watchdog/`` (the same code twice: an A/A pair,
  so the noise of the machine can be judged against the old/new difference);
* ``unwatched``: the same decode without a watchdog (the reference for tokens/s).

Each worker checks that ``mlx_watchdog.__file__`` resolves into the folder it was given and says
where (the report lists it). Each round runs every workload once per variant, the variants of one
workload back to back, in an order rotated every round (old, new, new-again, unwatched; then new,
new-again, unwatched, old; ...), so that a slow moment of the machine hits them alike. Per variant
the report gives the median over rounds and the min..max; per pair of variants the ratio of the
two runs of the same round (paired), its median, min..max and a bootstrap 95% interval of the median.

Workloads:

* ``leakfree``: the tiny llama (4 layers) decoded by ``generate_step``, the model watched by
  ``watch_model(model, Watchdog(export=False))``: tokens/s over the timed steps (after the first
  token) and the wall time of every ``observe()`` call (``wd.observe`` wrapped by a timer);
* ``leaking``: the tiny qwen3_next (12 layers, full attention every 4th) decoding 2 equal-length
  prompts through ``BatchGenerator``, which leaks 8 buffers a step (``ArraysCache.left_padding``);
* ``stall``: the crash scale, synthetic: 47 objects each holding a lazy chain of ``--stall-depth``
  ``x = x - 1`` steps over an evaluated int scalar (470k pending nodes by default), observed for
  ``--stall-steps`` steps, each extending every chain by one more ``- 1``; default options. The
  worst single ``observe()`` is the stall. The forecast's ``resident_buffers`` is checked against
  the exact count, ``chains x (depth + steps)`` stranded scalars plus the ``chains`` evaluated
  scalars at the chains' roots, and against ``mlx_watchdog.core.graph.account`` of the chains (run once
  at the end, untimed). A run stops early once its steps took ``--stall-cap-s`` seconds.

    python benchmarks/observe_stall.py                                  # defaults: ~3-5 min on 2 cores
    python benchmarks/observe_stall.py --out benchmarks/results/observe_stall.md
    python benchmarks/observe_stall.py --rounds 12 --leakfree-steps 2000 --leaking-steps 1000
    python benchmarks/observe_stall.py --workloads stall --stall-depth 20000 --stall-cap-s 120
    python benchmarks/observe_stall.py --smoke                          # seconds; what the tests run

The parent process needs neither mlx nor mlx_watchdog; the workers need mlx, mlx-lm and both engines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import queue
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NEW_SRC = os.path.join(REPO, "watchdog")
OLD_REV = "HEAD"
PROTOCOL = "@@observe_stall "
VARIANTS = {  # name: (engine, watched)
    "old": ("old", True),
    "new": ("new", True),
    "new-again": ("new", True),
    "unwatched": ("new", False),
}
WORKLOADS = ("leakfree", "leaking", "stall", "stallfix")
PAIRS = (  # (numerator, denominator, what it says)
    ("new", "old", "new / old"),
    ("new-again", "old", "new-again / old"),
    ("new-again", "new", "new-again / new (A/A: noise)"),
    ("old", "unwatched", "old / unwatched"),
    ("new", "unwatched", "new / unwatched"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 6; 1 with --smoke)")
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma list of {', '.join(WORKLOADS)} (default all; with --smoke, all but stallfix)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--leakfree-steps", type=int, default=None, help="timed generate_step steps (default 400)")
    p.add_argument("--leaking-steps", type=int, default=None, help="BatchGenerator steps (default 300)")
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--stall-chains", type=int, default=47)
    p.add_argument(
        "--stall-depth", type=int, default=None, help="nodes per chain before the first step (default 10000)"
    )
    p.add_argument("--stall-steps", type=int, default=None, help="observed steps (default 64)")
    p.add_argument(
        "--stall-step-ms", type=float, default=10.0, help="device time of a step, slept (default %(default)s)"
    )
    p.add_argument(
        "--stall-join-at", type=int, default=None, help="the step a request joins at (default 40; 0: none)"
    )
    p.add_argument(
        "--stall-join-depth", type=int, default=100, help="pending nodes of the joining request's chain"
    )
    p.add_argument(
        "--stall-short-step-ms",
        type=float,
        default=None,
        help="device time of a step of the short generation (default 500: its budget holds every walk)",
    )
    p.add_argument(
        "--stall-cap-s",
        type=float,
        default=None,
        help="stop a stall run once its steps took this long (default 30 s)",
    )
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old engine (default %(default)s)")
    p.add_argument("--old-src", default=None, help="an old watchdog/ folder to use instead of --old-rev")
    p.add_argument("--timeout-s", type=float, default=600, help="longest wait for one run of a worker")
    p.add_argument("--out", default=None, help="also write the markdown report here (overwrites)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, one round (seconds); without the old engine if it cannot be had",
    )
    # worker side (internal)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--expect", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    smoke = {
        "rounds": 1,
        "leakfree_steps": 16,
        "leaking_steps": 12,
        "stall_depth": 300,
        "stall_steps": 5,
        "stall_cap_s": 10.0,
        "stall_join_at": 3,
        "stall_short_step_ms": 10.0,
    }
    full = {
        "rounds": 6,
        "leakfree_steps": 400,
        "leaking_steps": 300,
        "stall_depth": 10_000,
        "stall_steps": 64,
        "stall_cap_s": 30.0,
        "stall_join_at": 40,
        "stall_short_step_ms": 500.0,
    }
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workloads is None:
        args.workloads = ",".join(w for w in WORKLOADS if not (args.smoke and w == "stallfix"))
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


# =====================================================================================  worker


def worker(args) -> int:
    # The protocol goes through a copy of stdout; anything else written to fd 1 (C or Python) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(PROTOCOL + json.dumps(obj) + "\n")
        proto.flush()

    import mlx_watchdog

    where = os.path.realpath(mlx_watchdog.__file__)
    expect = os.path.realpath(args.expect)
    print(f"[{args.worker}] mlx_watchdog.__file__ = {mlx_watchdog.__file__} -> {where}", file=sys.stderr)
    if not where.startswith(expect + os.sep):
        send({"error": f"mlx_watchdog imported from {where}, not from {expect}"})
        return 2
    engine, watched = VARIANTS[args.worker]
    try:
        # Everything a run uses is imported now, so that the code measured is the code hashed here
        # (the new engine's files may change while the benchmark runs).
        import mlx_lm.generate  # noqa: F401

        import mlx_watchdog.attach.model  # noqa: F401
        import mlx_watchdog.core.graph  # noqa: F401
        import mlx_watchdog.tiny  # noqa: F401

        imported = tree_hash(os.path.dirname(where))
        state = _WorkerState(watched)
    except Exception:
        send({"error": traceback.format_exc()})
        return 2
    send(
        {
            "hello": args.worker,
            "file": mlx_watchdog.__file__,
            "realpath": where,
            "pid": os.getpid(),
            "hash": imported,
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        try:
            result = state.run(cmd)
        except Exception:
            result = {"error": traceback.format_exc()}
        send(result)
    return 0


class _WorkerState:
    def __init__(self, watched: bool):
        import logging

        import mlx.core as mx

        from mlx_watchdog.tiny import build_model

        self.mx = mx
        self.watched = watched
        self.models = {}
        self.build_model = build_model

        class Grab(logging.Handler):
            def __init__(self):
                super().__init__(logging.WARNING)
                self.records: list[str] = []
                self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

            def emit(self, record):
                if len(self.records) < 5:
                    self.records.append(self.format(record))

        self.grab = Grab()
        logging.getLogger("mlx_watchdog").addHandler(self.grab)

    def model(self, kind: str):
        if kind not in self.models:
            if kind == "llama":
                self.models[kind] = self.build_model("llama", layers=4)
            else:
                self.models[kind] = self.build_model("qwen3_next", layers=12, full_attention_interval=4)
        return self.models[kind]

    def run(self, cmd: dict) -> dict:
        import gc

        self.grab.records = []
        workload = cmd["workload"]
        result = getattr(self, f"_{workload}")(cmd)
        result["log"] = list(self.grab.records)
        gc.collect()
        return result

    # -------------------------------------------------------------------- helpers

    def _watchdog(self):
        from mlx_watchdog import Watchdog

        wd = Watchdog(export=False)
        times: list[float] = []
        inner = wd.observe
        perf = time.perf_counter

        def observe(*a, **k):
            t = perf()
            try:
                return inner(*a, **k)
            finally:
                times.append(perf() - t)

        wd.observe = observe  # attach.py calls watchdog.observe(...): the instance attribute is found
        return wd, times

    @staticmethod
    def _observe_stats(times: list[float]) -> dict:
        if not times:
            return {"calls": 0}
        ordered = sorted(times)
        n = len(ordered)
        return {
            "calls": n,
            "worst_s": ordered[-1],
            "worst_call": times.index(ordered[-1]) + 1,
            "p99_s": ordered[max(0, math.ceil(0.99 * n) - 1)],  # nearest rank: the worst for n < 100
            "median_s": ordered[n // 2],
            "total_s": sum(times),
            "first_s": times[0],
            "worst_after_first_s": max(times[1:]) if n > 1 else None,
        }

    def _watch_report(self, wd, times) -> dict:
        f = wd.forecast()
        return {
            "observe": self._observe_stats(times),
            "walks": wd.walks,
            "internal_errors": wd.internal_errors,
            "overhead_s": wd.overhead_seconds,
            "steps": wd.steps,
            "rate": f.buffers_per_step,
            "resident": f.resident_buffers,
            "measured_step": f.measured_step,
            "retained": f.retained_buffers,
            "pending_nodes": f.pending_graph_nodes,
            "sampled": getattr(f, "sampled", None),
            "rate_known": getattr(f, "rate_known", None),
            "leak_sites": [leak.site for leak in f.leaks[:3]],
        }

    # -------------------------------------------------------------------- workloads

    def _leakfree(self, cmd: dict) -> dict:
        from mlx_lm.generate import generate_step

        from mlx_watchdog.attach.model import unwatch_model, watch_model
        from mlx_watchdog.tiny import tiny_prompts

        mx, model, steps = self.mx, self.model("llama"), cmd["steps"]
        wd = times = None
        if self.watched:
            wd, times = self._watchdog()
            watch_model(model, wd)
        try:
            prompt = mx.array(tiny_prompts(1, cmd["prompt_len"])[0])
            decode = generate_step(prompt, model, max_tokens=steps + 1)
            tokens = [int(next(decode)[0])]  # prefill and the first token: untimed
            t0 = time.perf_counter()
            for _ in range(steps):
                tokens.append(int(next(decode)[0]))
            seconds = time.perf_counter() - t0
            decode.close()
        finally:
            if self.watched:
                unwatch_model(model)
        result = {
            "tokens_per_s": steps / seconds,
            "seconds": seconds,
            "timed_tokens": steps,
            "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12],
        }
        if wd is not None:
            result.update(self._watch_report(wd, times))
        return result

    def _leaking(self, cmd: dict) -> dict:
        from mlx_lm.generate import BatchGenerator

        from mlx_watchdog.attach.model import unwatch_model, watch_model
        from mlx_watchdog.tiny import tiny_prompts

        model, steps = self.model("qwen3_next"), cmd["steps"]
        wd = times = None
        if self.watched:
            wd, times = self._watchdog()
            watch_model(model, wd)
        try:
            gen = BatchGenerator(model, max_tokens=steps)
            gen.insert(tiny_prompts(2, cmd["prompt_len"], 512))
            tokens, timed, t0 = [], 0, None
            while responses := gen.next_generated():
                tokens.append([int(r.token) for r in responses])
                if t0 is None:  # prefill and the first tokens: untimed
                    t0 = time.perf_counter()
                else:
                    timed += len(responses)
            seconds = time.perf_counter() - t0
            gen.close()
        finally:
            if self.watched:
                unwatch_model(model)
        result = {
            "tokens_per_s": timed / seconds,
            "seconds": seconds,
            "timed_tokens": timed,
            "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12],
        }
        if wd is not None:
            result.update(self._watch_report(wd, times))
        return result

    def _stall(self, cmd: dict) -> dict:
        import mlx_watchdog.core.sampling as sampling
        from mlx_watchdog import Watchdog
        from mlx_watchdog.core.graph import account, cpu_clock

        mx = self.mx
        if not self.watched:
            return {"skipped": "nothing to time unwatched"}
        chains, depth, steps, cap = cmd["chains"], cmd["depth"], cmd["steps"], cmd["cap_s"]
        device_s, join_at, join_depth = cmd["step_s"], cmd["join_at"], cmd["join_depth"]

        class ChainCache:  # one attribute, one lazy chain: 47 of them are one site
            def __init__(self, state):
                self.state = state

        def chain(n):
            x = mx.array(0)
            mx.eval(x)
            for _ in range(n):
                x = x - 1
            return x

        t0 = time.perf_counter()
        cache = [ChainCache(chain(depth)) for _ in range(chains)]
        build_s = time.perf_counter() - t0

        walks: list[tuple[int, float]] = []  # (pending nodes, CPU s) of each export of a reading
        real_account = sampling.account

        def recording_account(arrays, **options):
            c = cpu_clock()
            reading = real_account(arrays, **options)
            walks.append((reading.pending_nodes, cpu_clock() - c))
            return reading

        sampling.account = recording_account  # the sampler's exports; restored below
        calls: list[dict] = []

        def timed(wd, kind_of, call):
            n, before, c, t = len(walks), wd.walks, cpu_clock(), time.perf_counter()
            fixed = wd.materialized_arrays
            call()
            wall, cpu = time.perf_counter() - t, cpu_clock() - c
            walked = wd.walks > before
            kind = kind_of(walked) if walked else "no walk"
            if wd.materialized_arrays > fixed:
                kind += " + fix"
            calls.append(
                {
                    "kind": kind,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "nodes": sum(w[0] for w in walks[n:]),
                    "exports": len(walks) - n,
                    "step": wd.steps,
                }
            )
            return wall

        try:
            # The decode: default options (or fix=True), a step of device time (a sleep) between
            # observes, a request joining at ``join_at`` (its own short chain: a continuing epoch).
            wd = Watchdog(export=False, fix=cmd["fix"])
            times = []
            started = time.perf_counter()
            done, last_walk = 0, -10
            for step in range(1, steps + 1):
                for c in cache:
                    c.state = c.state - 1
                if step == join_at:
                    cache.append(ChainCache(chain(join_depth)))
                time.sleep(device_s)

                def kind_of(walked, step=step, last_walk=last_walk):
                    offset = step - 1
                    if step == join_at:
                        return "continuing epoch"
                    if offset == 0:
                        return "first (owed, probe)"
                    if cmd["fix"] and step - last_walk <= 3 and offset not in (16, 32):
                        return "fix probe"
                    if offset in (16, 32):
                        return "owed"
                    if offset in (1, 2, 4, 8, 64):
                        return "dense"
                    return "interval"

                walks_before = wd.walks
                times.append(timed(wd, kind_of, lambda wd=wd, cache=cache: wd.observe(cache)))
                if wd.walks > walks_before:
                    last_walk = step
                done += 1
                if time.perf_counter() - started > cap:
                    break
            loop_s = time.perf_counter() - started
            timed(wd, lambda walked: "generation_ended", wd.generation_ended)
            result = self._watch_report(wd, times)
            t0 = time.perf_counter()
            reading = account([c.state for c in cache])  # untimed check, once
            account_s = time.perf_counter() - t0
            joined = 1 if join_at and join_at <= done else 0
            exact = chains * (depth + done) + chains
            if joined:
                exact += join_depth + (done - join_at) + 1
            if cmd["fix"]:  # the fix evaluated the chains: the walk of everything is the count
                exact = reading.retained_buffers + reading.evaluated_arrays
            result.update(
                {
                    "steps_run": done,
                    "capped": done < steps,
                    "build_s": build_s,
                    "loop_s": loop_s,
                    "exact": exact,
                    "account_resident": reading.retained_buffers + reading.evaluated_arrays,
                    "account_nodes": reading.pending_nodes,
                    "account_s": account_s,
                    "true_rate": chains + joined,
                }
            )
            del reading
            # Every kind once more, each walk taken: a short generation on the same chains, with a
            # fresh watchdog whose budget holds every walk (overhead_budget=1.0, 0.5 s of device
            # time a step): its first step, dense ones, a request joining once the growth is
            # measured (before that a join starts the decode afresh), its end.
            ended = Watchdog(export=False, overhead_budget=1.0)
            kinds = ("first (owed, probe)", "dense", "dense", "dense", "continuing epoch", "dense")
            for kind in kinds:
                for c in cache:
                    c.state = c.state - 1
                if kind == "continuing epoch":
                    cache.append(ChainCache(chain(join_depth)))
                time.sleep(cmd["short_step_s"])
                timed(ended, lambda walked, kind=kind: kind, lambda cache=cache: ended.observe(cache))
            timed(ended, lambda walked: "generation_ended", ended.generation_ended)
            f = ended.forecast()
            after = account([c.state for c in cache])
            result["ended"] = {
                "resident": f.resident_buffers,
                "account": after.retained_buffers + after.evaluated_arrays,
                "walks": ended.walks,
            }
            del after
        finally:
            sampling.account = real_account
        result["calls"] = calls
        cache.clear()
        return result


# =====================================================================================  parent


class Worker:
    def __init__(self, name: str, pythonpath: str, expect: str, timeout_s: float):
        self.name = name
        self.timeout_s = timeout_s
        self.stderr = tempfile.NamedTemporaryFile(
            "w+", prefix=f"observe_stall_{name}_", suffix=".log", delete=False
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONHASHSEED", "0")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", name, "--expect", expect],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
            env=env,
            cwd=REPO,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = None
        self.dead: str | None = None

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                self.lines.put(line[len(PROTOCOL) :])
        self.lines.put(None)

    def receive(self) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.kill()
            self.dead = f"no answer within {self.timeout_s:.0f} s (killed)\n" + self.stderr_tail()
            return {"error": self.dead}
        if line is None:
            self.proc.wait()
            self.dead = f"worker exited with status {self.proc.returncode}\n" + self.stderr_tail()
            return {"error": self.dead}
        return json.loads(line)

    def ask(self, cmd: dict) -> dict:
        if self.dead:
            return {"error": "worker dead: " + self.dead.splitlines()[0]}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def stderr_tail(self, chars: int = 4000) -> str:
        self.stderr.flush()
        with open(self.stderr.name) as f:
            return f.read()[-chars:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()  # this worker only, by its own handle
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:
                self.kill()
        self.stderr.close()
        os.unlink(self.stderr.name)


def _git(*cmd: str) -> str:
    return subprocess.run(
        ["git", "-C", REPO, *cmd], check=True, capture_output=True, text=True
    ).stdout.strip()


def package_dir(name: str, src: str) -> str:
    """A folder in which ``mlx_watchdog`` is the folder ``src`` (a symlink), for PYTHONPATH."""
    base = tempfile.mkdtemp(prefix=f"observe_stall_{name}_path_")
    os.symlink(os.path.realpath(src), os.path.join(base, "mlx_watchdog"))
    return base


def old_engine(args) -> tuple[str, str]:
    """(the old watchdog/ folder, what it is). Taken out of git once per revision, kept in the temp folder."""
    if args.old_src:
        src = os.path.realpath(args.old_src)
        if not os.path.isfile(os.path.join(src, "__init__.py")):
            raise RuntimeError(f"--old-src {src} holds no __init__.py: not a watchdog/ folder")
        return src, f"folder {src}"
    sha = _git("rev-parse", "--verify", f"{args.old_rev}^{{commit}}")
    home = os.path.join(tempfile.gettempdir(), f"mlx_watchdog_old_engine_{sha[:12]}")
    src = os.path.join(home, "watchdog")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        staging = tempfile.mkdtemp(prefix="mlx_watchdog_old_engine_", dir=tempfile.gettempdir())
        archive = subprocess.run(
            ["git", "-C", REPO, "archive", sha, "watchdog"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", staging], input=archive, check=True)
        shutil.rmtree(home, ignore_errors=True)
        os.replace(staging, home)
    subject = _git("log", "-1", "--format=%h %s", sha)
    return src, f"git {sha[:12]} ({subject[:90]}), extracted to {src}"


def tree_hash(folder: str) -> str:
    """A hash of every .py file under ``folder`` (the package's subpackages included)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    h.update(os.path.relpath(path, folder).encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:12]


def machine() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    busy = ""
    try:
        ps = subprocess.run(
            ["ps", "-eo", "pcpu,pid,args", "--sort=-pcpu"], capture_output=True, text=True, timeout=5
        )
        rows = [
            r.strip()[:110]
            for r in ps.stdout.splitlines()[1:]
            if r.strip() and str(os.getpid()) not in r.split()[1:2]
        ]
        busy = "; ".join(rows[:3])
    except Exception:
        pass
    return {"nproc": affinity, "load": os.getloadavg(), "busy": busy}


def run(args) -> int:
    t_start = time.perf_counter()
    before = machine()
    notes: list[str] = []
    variants = list(args.variants)
    engines = {"new": (NEW_SRC, "working tree " + NEW_SRC)}
    if "old" in variants:
        try:
            engines["old"] = old_engine(args)
        except Exception as exc:
            if not args.smoke:
                raise
            variants.remove("old")
            notes.append(f"old engine not available ({exc!r}): smoke run without it")
    new_hash_before = tree_hash(NEW_SRC)
    try:
        head = _git("log", "-1", "--format=%h %s")[:90]
        new_diff = _git("diff", "--shortstat", args.old_rev, "--", "watchdog")
        new_untracked = _git("ls-files", "--others", "--exclude-standard", "--", "watchdog").split()
    except Exception:
        head, new_diff, new_untracked = "?", "?", []

    paths = {engine: package_dir(engine, src) for engine, (src, _) in engines.items()}
    # The stall runs in worker processes of its own: a walk of a 470k-node graph leaves the process
    # slower at its next small walks.
    group_of = {w: ("stall" if w.startswith("stall") else "decode") for w in args.workloads}
    workers: dict[tuple[str, str], Worker] = {}
    errors: list[str] = []
    results: dict[str, dict[str, list]] = {w: {v: [] for v in variants} for w in args.workloads}
    orders: list[list[str]] = []
    try:
        for group in dict.fromkeys(group_of.values()):
            for v in variants:
                if group == "stall" and not VARIANTS[v][1]:
                    continue
                engine = VARIANTS[v][0]
                workers[v, group] = Worker(v, paths[engine], engines[engine][0], args.timeout_s)
        for (v, group), w in workers.items():
            w.hello = w.receive()
            if "error" in w.hello:
                errors.append(f"worker {v} ({group}) did not start:\n{w.hello['error']}")
                w.dead = w.dead or "did not start"
        cmds = {
            "leakfree": {"workload": "leakfree", "steps": args.leakfree_steps, "prompt_len": args.prompt_len},
            "leaking": {"workload": "leaking", "steps": args.leaking_steps, "prompt_len": args.prompt_len},
            "stall": {
                "workload": "stall",
                "chains": args.stall_chains,
                "depth": args.stall_depth,
                "steps": args.stall_steps,
                "cap_s": args.stall_cap_s,
                "step_s": args.stall_step_ms / 1e3,
                "join_at": args.stall_join_at,
                "join_depth": args.stall_join_depth,
                "short_step_s": args.stall_short_step_ms / 1e3,
                "fix": False,
            },
        }
        cmds["stallfix"] = dict(cmds["stall"], fix=True)
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            orders.append(order)
            for workload in args.workloads:
                for v in order:
                    if workload.startswith("stall") and not VARIANTS[v][1]:
                        continue
                    res = workers[v, group_of[workload]].ask(cmds[workload])
                    res["round"] = r
                    if "error" in res:
                        errors.append(f"round {r + 1}, {workload}, {v}:\n{res['error']}")
                    elif res.get("internal_errors"):  # an error path measured under its name: fails
                        errors.append(
                            f"round {r + 1}, {workload}, {v}: {res['internal_errors']} internal errors "
                            "of the watchdog\n" + "\n".join(res.get("log") or [])
                        )
                    elif res.get("log"):
                        errors.append(
                            f"round {r + 1}, {workload}, {v}: the watchdog logged\n" + "\n".join(res["log"])
                        )
                    results[workload][v].append(res)
                    print(
                        f"# round {r + 1}/{args.rounds} {workload:8s} {v:10s} " + _brief(res),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for w in workers.values():
            w.close()
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)
    after = machine()
    imported = {
        f"{v} ({g})": (w.hello or {}).get("hash") for (v, g), w in workers.items() if VARIANTS[v][0] == "new"
    }
    now = tree_hash(NEW_SRC)
    if set(imported.values()) - {now, None} or new_hash_before != now:
        notes.append(
            "the new engine's files changed during the run: the tree hashed "
            f"{new_hash_before} at the start and {now} at the end; the new workers imported "
            + ", ".join(f"{v} {h}" for v, h in imported.items())
            + " (each runs what it imported at its start)"
        )
    text = report(
        args,
        variants,
        engines,
        workers,
        results,
        orders,
        errors,
        notes,
        before,
        after,
        time.perf_counter() - t_start,
        new_hash_before,
        head,
        new_diff,
        new_untracked,
    )
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    hard = [e for e in errors if "the watchdog logged" not in e]
    return 1 if hard else 0


def _brief(res: dict) -> str:
    if "error" in res:
        return "ERROR " + res["error"].strip().splitlines()[-1][:120]
    if "skipped" in res:
        return "skipped"
    out = []
    if "tokens_per_s" in res:
        out.append(f"{res['tokens_per_s']:.0f} tok/s")
    if "observe" in res:
        out.append(f"worst observe {res['observe']['worst_s'] * 1e3:.2f} ms, walks {res['walks']}")
    if "exact" in res:
        out.append(f"resident {res['resident']} vs exact {res['exact']}")
    return ", ".join(out)


# =====================================================================================  report


def _ok(runs: list) -> list:
    return [r for r in runs if "error" not in r and "skipped" not in r]


def _spread(values: list, fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} [{format(min(values), fmt)}..{format(max(values), fmt)}]"


def _boot_median(values: list, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (math.nan, math.nan)
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def _paired(results: dict, a: str, b: str, key) -> list:
    by_round = {r["round"]: r for r in _ok(results.get(b, []))}
    out = []
    for r in _ok(results.get(a, [])):
        other = by_round.get(r["round"])
        if other is not None:
            x, y = key(r), key(other)
            if x is not None and y:
                out.append(x / y)
    return out


def _worst(r):
    return r["observe"]["worst_s"] if "observe" in r else None


KIND_ORDER = (
    "first (owed, probe)",
    "dense",
    "owed",
    "continuing epoch",
    "interval",
    "fix probe",
    "generation_ended",
    "no walk",
)


def _kinds_table(variants, res) -> list:
    """Per kind of observe(): the worst wall time of each run (median over rounds [min..max]), its
    CPU time, the calls, and the most pending nodes one of them walked."""
    lines = [
        "| variant | kind of observe() | calls a run | worst wall ms | worst CPU ms | most nodes walked |",
        "|---|---|---|---|---|---|",
    ]
    for v in variants:
        if not VARIANTS[v][1]:
            continue
        ok = [r for r in _ok(res.get(v, [])) if "calls" in r]
        kinds = {c["kind"] for r in ok for c in r["calls"]}
        for kind in [k for k in KIND_ORDER if k in kinds] + sorted(kinds - set(KIND_ORDER)):
            per_run = [[c for c in r["calls"] if c["kind"] == kind] for r in ok]
            per_run = [calls for calls in per_run if calls]
            lines.append(
                f"| {v} | {kind} | {_spread([len(c) for c in per_run], '.0f')} | "
                f"{_spread([max(x['wall_s'] for x in c) * 1e3 for c in per_run], '.1f')} | "
                f"{_spread([max(x['cpu_s'] for x in c) * 1e3 for c in per_run], '.1f')} | "
                f"{max((x['nodes'] for c in per_run for x in c), default=0)} |"
            )
    ended = [
        f"{v}: {_spread([r['ended']['resident'] for r in _ok(res.get(v, [])) if 'ended' in r], '.0f')} "
        f"read against {_spread([r['ended']['account'] for r in _ok(res.get(v, [])) if 'ended' in r], '.0f')}"
        for v in variants
        if VARIANTS[v][1]
    ]
    lines += [
        "",
        "Kinds: which walk an observe() took, told from its step in the decode (its epoch starts at step 1; "
        "offsets 16 and 32 are owed walks, 1, 2, 4, 8 dense ones; `+ fix`: the fix ran in that call). "
        "Each run then decodes a short generation on the same chains with a fresh watchdog whose budget "
        "holds every walk (`overhead_budget=1.0`, `--stall-short-step-ms` of device time a step: 500 ms by default), so that every kind is "
        "timed whatever the decode's budget allowed: its first step, dense ones, a request joining at "
        "its step 5 (a continuing epoch), a dense one, `generation_ended` (which reads every live cache). What that "
        "watchdog reads after the end, against a walk of everything: " + "; ".join(ended) + ".",
        "",
    ]
    return lines


def report(
    args,
    variants,
    engines,
    workers,
    results,
    orders,
    errors,
    notes,
    before,
    after,
    wall_s,
    new_hash,
    head,
    new_diff,
    new_untracked,
) -> str:
    argv = args.argv if hasattr(args, "argv") else []
    lines = ["# observe() stall and decode tokens/s: old engine vs new, interleaved", ""]
    lines += ["Command:", "", "    " + shlex.join([sys.executable, "benchmarks/observe_stall.py", *argv]), ""]
    lines += [
        f"Machine: {platform.machine()} {platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"nproc {before['nproc']}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in before['load'])}, after {', '.join(f'{x:.2f}' for x in after['load'])}; "
        f"run took {wall_s:.0f} s.",
        "",
        f"Busiest processes at start: {before['busy'] or '?'}",
        "",
        f"Busiest processes at end: {after['busy'] or '?'}",
        "",
    ]
    try:
        import importlib.metadata as md

        lines += [f"mlx {md.version('mlx')}, mlx-lm {md.version('mlx-lm')}.", ""]
    except Exception:
        pass
    lines += ["Engines:", ""]
    for engine, (_, what) in engines.items():
        extra = ""
        if engine == "new":
            extra = (
                f" (HEAD {head}; watchdog/ hash {new_hash}; vs {args.old_rev}: {new_diff or 'no change'}"
                + (f"; untracked {', '.join(new_untracked)}" if new_untracked else "")
                + ")"
            )
        lines.append(f"* {engine}: {what}{extra}")
    for (v, group), w in workers.items():
        hello = w.hello or {}
        if "file" in hello:
            lines.append(
                f"  * worker `{v}` ({group}, pid {hello['pid']}): mlx_watchdog.__file__ = `{hello['file']}` -> "
                f"`{hello['realpath']}`, imported files hash {hello.get('hash')}"
            )
    lines.append("")
    lines.append(
        f"Rounds: {args.rounds}; orders: "
        + "; ".join(", ".join(o) for o in orders[:4])
        + (" ..." if len(orders) > 4 else "")
        + ". Cells: median over rounds [min..max]; ratios: "
        "per round (paired), median [min..max], and a bootstrap 95% interval of the median."
    )
    lines.append("")
    for note in notes:
        lines += [f"**Note:** {note}", ""]

    for workload in args.workloads:
        res = results[workload]
        if workload in ("leakfree", "leaking"):
            steps = args.leakfree_steps if workload == "leakfree" else args.leaking_steps
            title = (
                "leak-free: tiny llama, 4 layers, generate_step"
                if workload == "leakfree"
                else "leaking: tiny qwen3_next, 12 layers (full attention every 4th), BatchGenerator, 2 prompts"
            )
            lines += [f"## {title}, {steps} steps", ""]
            ref = next((r["tokens_sha"] for r in _ok(res.get("unwatched", []))), None)
            lines.append(
                "| variant | tokens/s | worst observe() ms | at call # | p99 observe() us | median observe() us | "
                "all observe() ms | walks | buffers/step read | rate measured | internal errors | "
                "same tokens as unwatched |"
            )
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for v in variants:
                ok = _ok(res.get(v, []))
                watched = VARIANTS[v][1]
                same = "-" if ref is None else ("yes" if all(r["tokens_sha"] == ref for r in ok) else "NO")
                failed = len(res.get(v, [])) - len(ok)
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            v + (f" ({failed} failed)" if failed else ""),
                            _spread([r["tokens_per_s"] for r in ok], ".0f"),
                            _spread([r["observe"]["worst_s"] * 1e3 for r in ok], ".2f") if watched else "",
                            _spread([r["observe"]["worst_call"] for r in ok], ".0f") if watched else "",
                            _spread([r["observe"]["p99_s"] * 1e6 for r in ok], ".0f") if watched else "",
                            _spread([r["observe"]["median_s"] * 1e6 for r in ok], ".1f") if watched else "",
                            _spread([r["observe"]["total_s"] * 1e3 for r in ok], ".1f") if watched else "",
                            _spread([r["walks"] for r in ok], ".0f") if watched else "",
                            _spread([r["rate"] for r in ok], ".2f") if watched else "",
                            (
                                f"{sum(1 for r in ok if r.get('rate_known'))} of {len(ok)}"
                                if any(r.get("rate_known") is not None for r in ok)
                                else "n/a"
                            )
                            if watched
                            else "",
                            str(sum(r["internal_errors"] for r in ok)) if watched else "",
                            same,
                        ]
                    )
                    + " |"
                )
            lines += [
                "",
                "| paired ratio | tokens/s ratio | 95% interval | worst observe() ratio | tokens/s ratio per round |",
                "|---|---|---|---|---|",
            ]
            for a, b, what in PAIRS:
                if a not in variants or b not in variants:
                    continue
                tps = _paired(res, a, b, lambda r: r["tokens_per_s"])
                worst = _paired(res, a, b, _worst) if VARIANTS[a][1] and VARIANTS[b][1] else []
                lo, hi = _boot_median(tps) if tps else (math.nan, math.nan)
                lines.append(
                    f"| {what} | {_spread(tps, '.3f')} | {lo:.3f}..{hi:.3f} | {_spread(worst, '.2f')} | "
                    + " ".join(f"{x:.2f}" for x in tps)
                    + " |"
                )
            lines.append("")
            lines.append(
                "tokens/s: timed steps after the first token. `at call #`: which observe() call was the "
                "worst (1 = the first, prefill calls included). `buffers/step read`: the forecast's "
                "buffers_per_step at the end; `rate measured`: runs whose forecast says rate_known "
                "(n/a: a Forecast without that field). p99 by nearest rank."
            )
            lines.append("")
            lines.append(
                "Per round, tokens/s / worst observe() ms: "
                + "; ".join(
                    f"round {r + 1}: "
                    + ", ".join(
                        f"{v} {x['tokens_per_s']:.0f}"
                        + (f"/{x['observe']['worst_s'] * 1e3:.1f}" if "observe" in x else "")
                        for v in orders[r]
                        for x in _ok(res.get(v, []))
                        if x["round"] == r
                    )
                    for r in range(len(orders))
                )
                + "."
            )
            lines.append("")
        else:
            lines += [
                f"## crash scale ({workload}): {args.stall_chains} chains x {args.stall_depth} pending `- 1` "
                f"nodes, {args.stall_steps} steps of {args.stall_step_ms:g} ms device time (cap "
                f"{args.stall_cap_s:.0f} s a run), a request joining at step {args.stall_join_at} "
                f"({args.stall_join_depth} nodes), "
                + ("fix=True" if workload == "stallfix" else "default options"),
                "",
            ]
            lines += _kinds_table(variants, res)
            lines.append(
                "| variant | steps run | worst observe() s | first observe() s | worst after the first ms | "
                "walks | forecast resident (walked at step) | exact | account() | forecast - exact | "
                "sampled | account() s, untimed | internal errors |"
            )
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for v in variants:
                if not VARIANTS[v][1]:
                    continue
                ok = _ok(res.get(v, []))
                failed = len(res.get(v, [])) - len(ok)
                if not ok:
                    lines.append(f"| {v} ({failed} failed) |" + " - |" * 12)
                    continue
                last = ok[-1]
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            v + (f" ({failed} failed)" if failed else ""),
                            _spread([r["steps_run"] for r in ok], ".0f")
                            + (" (capped)" if any(r["capped"] for r in ok) else ""),
                            _spread([r["observe"]["worst_s"] for r in ok], ".3f"),
                            _spread([r["observe"]["first_s"] for r in ok], ".3f"),
                            _spread(
                                [
                                    r["observe"]["worst_after_first_s"] * 1e3
                                    if r["observe"]["worst_after_first_s"] is not None
                                    else None
                                    for r in ok
                                ],
                                ".2f",
                            ),
                            _spread([r["walks"] for r in ok], ".0f"),
                            _spread([r["resident"] for r in ok], ".0f")
                            + f" ({_spread([r['measured_step'] for r in ok], '.0f')})",
                            _spread([r["exact"] for r in ok], ".0f"),
                            _spread([r["account_resident"] for r in ok], ".0f")
                            + (
                                " (= exact)"
                                if all(r["account_resident"] == r["exact"] for r in ok)
                                else " (NOT exact)"
                            ),
                            _spread([100.0 * (r["resident"] - r["exact"]) / r["exact"] for r in ok], "+.2f")
                            + "%",
                            str(last.get("sampled")),
                            _spread([r["account_s"] for r in ok], ".2f"),
                            str(sum(r["internal_errors"] for r in ok)),
                        ]
                    )
                    + " |"
                )
            lines += [
                "",
                "| paired ratio | worst observe() ratio | 95% interval | per round |",
                "|---|---|---|---|",
            ]
            for a, b, what in PAIRS:
                if a in variants and b in variants and VARIANTS[a][1] and VARIANTS[b][1]:
                    worst = _paired(res, a, b, _worst)
                    lo, hi = _boot_median(worst) if worst else (math.nan, math.nan)
                    lines.append(
                        f"| {what} | {_spread(worst, '.3f')} | {lo:.3f}..{hi:.3f} | "
                        + " ".join(f"{x:.3f}" for x in worst)
                        + " |"
                    )
            lines.append("")
            lines.append(
                "p99 is by nearest rank: with fewer than 100 calls it is the worst call. "
                "`forecast resident` is the forecast's resident_buffers after the last step (the step of its "
                "last walk in brackets); "
                "`exact` = chains x (depth + steps run) stranded scalars + chains evaluated roots; "
                "`account()` = mlx_watchdog.core.graph.account of the chains after the last step "
                "(retained + evaluated), each engine's own."
            )
            lines.append("")
    if errors:
        lines += ["## Errors and watchdog log messages", ""]
        for e in errors:
            lines += ["```", e.rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
