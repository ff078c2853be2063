#!/usr/bin/env bash
# The speed targets on a GPU machine (MLX's CUDA backend), each part sized for one 10-minute call.
# Run from the repository root with mlx (CUDA), mlx-lm, numpy and this project importable
# (../shared/tools/gpu-prepare readies the wheels), e.g.:
#
#   OUT=/some/folder bash benchmarks/gpu_speed.sh long
#
# Parts (every chunk is appended to $OUT/<part>.jsonl the moment it ends, so a call cut by its
# limit keeps what it measured; the markdown report goes to $OUT/<part>.md):
#   long     the leaking hybrid (48 layers, 36 linear-attention, hidden 2048, 32 experts, bf16)
#            through BatchGenerator, batch 8, over 10,000 tokens (1,250 steps): unwatched, the A/A
#            control, the fix, the every-256 hand fix, the synchronous hand fix and the fix's work by
#            hand, taking one-step turns (~8 minutes)
#   diag     the same model for 1,200 steps with the diagnostic variants (the fix's work by hand,
#            watched without the fix) and the per-node cost of evaluating the chains
#   steady   the leak-free llama (48 layers, hidden 2048, bf16) through generate_step, repetitions
#            of 1,000 steps until the time box ends them (each repetition builds its own decodes:
#            the instances' own +/-1% averages out over many): unwatched, A/A, watched, fix,
#            taking one-step turns
#   wrapper  steady's model and design with the watchdog taken apart: watch_model with an
#            observe() that does nothing (wrapped), observe() without walks (nowalk), watched,
#            fix; nowalk against wrapped is the per-step path, watched against nowalk the walks
#            (~8 minutes)
#   profile  py-spy (PY_SPY: its binary) samples, alone, 600 steps of the leaking hybrid with
#            the fix and unwatched, and 2,500 steps of the llama watched and unwatched; collapsed
#            stacks go to $OUT/profile-<model>-<variant>.txt.gz, their summary (profile_report.py)
#            to .md (~6 minutes)
# Merge calls: python benchmarks/paired_speed.py --report $OUT/long.jsonl other/long.jsonl
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
PY=${PYTHON:-python3}
PART=${1:?part: long, diag or steady}
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
  diag)
    "$PY" benchmarks/eval_cost.py --out "$OUT/eval_cost.md" ${EXTRA_EVAL:-}
    bench "${QWEN[@]}" --steps 1200 --chunk 16 --variants unwatched,aa,fix,async16,watched \
      --compare fix:async16,fix:watched ;;
  steady) bench "${LLAMA[@]}" --steps 1000 --reps 40 --chunk 25 --interleave-steps --variants unwatched,aa,watched,fix ;;
  wrapper) bench "${LLAMA[@]}" --steps 2500 --reps 2 --chunk 25 --interleave-steps \
             --variants unwatched,aa,wrapped,nowalk,watched,fix --compare nowalk:wrapped,watched:nowalk,watched:wrapped ;;
  profile)
    : "${PY_SPY:?set PY_SPY to the py-spy binary}"
    prof() { local name=$1; shift
      "$PY_SPY" record -r 250 --nolineno -f raw -o "$OUT/profile-$name.txt" -- "$PY" benchmarks/profile_decode.py "$@" \
        > "$OUT/profile-$name.log" 2>&1 || echo "py-spy failed for $name (see $OUT/profile-$name.log)"
      "$PY" benchmarks/profile_report.py "$OUT/profile-$name.txt" > "$OUT/profile-$name.md"
      gzip -f "$OUT/profile-$name.txt"; grep -v "^py-spy" "$OUT/profile-$name.log" | tail -1; }
    for v in fix unwatched; do prof "qwen3_next-$v" "${QWEN[@]}" --steps 600 --variant "$v"; done
    for v in watched unwatched; do prof "llama-$v" "${LLAMA[@]}" --steps 2500 --variant "$v"; done ;;
  *) echo "unknown part $PART (long|diag|steady|wrapper|profile)" >&2; exit 2 ;;
esac
