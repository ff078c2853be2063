#!/usr/bin/env bash
# The decode-speed benchmark (paired_speed.py) on a GPU machine (MLX's CUDA backend), each part
# sized for one 10-minute call. Run from the repository root with mlx (CUDA), mlx-lm, numpy and
# this project importable, e.g.:
#
#   OUT=/some/folder bash benchmarks/gpu_speed.sh steady
#
# Parts (every chunk is appended to $OUT/<part>.jsonl the moment it ends, so a call cut by its
# limit keeps what it measured; the markdown report goes to $OUT/<part>.md):
#   long     the leaking hybrid (48 layers, 36 linear-attention, hidden 2048, 32 experts, bf16)
#            through BatchGenerator, batch 8, over 10,000 tokens (1,250 steps): unwatched, the A/A
#            control, the fix, the every-256 hand fix, the synchronous hand fix and the fix's work by
#            hand, taking one-step turns (~8 minutes)
#   steady   the leak-free llama (48 layers, hidden 2048, bf16) through generate_step, repetitions
#            of 1,000 steps until the time box ends them (each repetition builds its own decodes:
#            the instances' own +/-1% averages out over many): unwatched, A/A, watched, fix,
#            taking one-step turns
#   wrapper  steady's model and design with the watchdog taken apart: watch_model with an
#            observe() that does nothing (wrapped), observe() with its walks switched off (nowalk),
#            watched, fix; nowalk against wrapped is the per-step path, watched against nowalk the
#            walks (~8 minutes)
#   versions steady's design with another version of the package beside this one, in the same
#            process (BASE: a folder holding its watchdog/, e.g. git archive REV watchdog | tar -x -C
#            DIR): unwatched, A/A, watched, fix, watched@base, fix@base, taking one-step turns
#   long-versions  long's model with the base version's fix beside this one's and its work by hand:
#            unwatched, A/A, fix, async16, fix@base (~6 minutes)
# A part fails (exit 1) as soon as any variant's watchdog had an internal error: that variant
# measured an error path, not itself.
# TIME_BOX (seconds, default 540) ends a part cleanly; EXTRA adds arguments to every run.
# Merge calls: python benchmarks/paired_speed.py --report $OUT/steady.jsonl other/steady.jsonl
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
PY=${PYTHON:-python3}
PART=${1:?part: long, steady, wrapper, versions or long-versions}
BOX=${TIME_BOX:-540}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

QWEN=(--model qwen3_next --layers 48 --hidden 2048 --vocab 32000 --experts 32 --dtype bfloat16 --batch 8 --prompt-len 64)
LLAMA=(--model llama --layers 48 --hidden 2048 --vocab 32000 --dtype bfloat16 --prompt-len 128)
bench() { "$PY" benchmarks/paired_speed.py "$@" --jsonl "$OUT/$PART.jsonl" --time-box "$BOX" --out "$OUT/$PART.md" ${EXTRA:-}; }

case "$PART" in
  long) bench "${QWEN[@]}" --steps 1250 --chunk 16 --interleave-steps \
          --variants unwatched,aa,fix,every256,handfix,async16 --compare fix:every256,fix:handfix,fix:async16 ;;
  steady) bench "${LLAMA[@]}" --steps 1000 --reps 40 --chunk 25 --interleave-steps --variants unwatched,aa,watched,fix ;;
  wrapper) bench "${LLAMA[@]}" --steps 2500 --reps 2 --chunk 25 --interleave-steps \
             --variants unwatched,aa,wrapped,nowalk,watched,fix --compare nowalk:wrapped,watched:nowalk,watched:wrapped ;;
  versions) bench "${LLAMA[@]}" --steps 1000 --reps 40 --chunk 25 --interleave-steps --base "${BASE:?set BASE}" \
             --variants unwatched,aa,watched,fix,watched@base,fix@base \
             --compare watched:watched@base,fix:fix@base ;;
  long-versions) bench "${QWEN[@]}" --steps 1250 --chunk 16 --interleave-steps --base "${BASE:?set BASE}" \
             --variants unwatched,aa,fix,async16,fix@base --compare fix:async16,fix@base:async16,fix:fix@base ;;
  *) echo "unknown part $PART (long|steady|wrapper|versions|long-versions)" >&2; exit 2 ;;
esac
