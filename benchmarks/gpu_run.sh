#!/usr/bin/env bash
# Decode tokens/s on a GPU (MLX's CUDA backend), for issue 3's benchmark. Run from the repository
# root on the GPU machine, with mlx (CUDA), mlx-lm, numpy and this project importable, e.g.:
#
#   pip install --no-deps --target /tmp/site . && export PYTHONPATH=/tmp/site
#   OUT=/some/folder bash benchmarks/gpu_run.sh [all|llama|qwen3_next|long|steady]
#
# Parts (each fits in a 10-minute command on an H200; "all" runs the first two):
#   llama       leak-free dense llama, realistic shape (48 layers, hidden 2048, random bf16 weights),
#               through generate_step: issue 3's variants, 800 steps x 4 interleaved repetitions in
#               chunks of 50 (64 paired chunks a variant; the H200 host's speed drifted 10-30% between
#               repetitions in session 2)
#   qwen3_next  the leaking hybrid through BatchGenerator (48 layers, 36 linear-attention layers,
#               hidden 2048, 32 experts, bf16), 4 equal-length prompts: every variant, 300 steps x 3
#   long        the leaking model over 10,000 tokens (2,500 steps x batch 4): unwatched, the A/A control
#               and watched+fix, one repetition (~320 s on an H200; the A/A control moved -6.8% in
#               session 3, so a run without it says little). Run it twice for two repetitions.
#   steady      leak-free llama in long repetitions (2,500 steps, ~20 s a variant): the start-up walks
#               and their 0.05 s credit weigh 0.25%, not 0.7% as in 800-step repetitions; with the
#               diagnostic variants that take the watched cost apart (wrapped: the model wrapper only;
#               nowalk: observe() without walks), 2 repetitions (~300 s)
# Progress goes to $OUT/decode_gpu.log as it happens: a run cut by its time limit still leaves it.
# Do not pipe the command through `tail`: it prints nothing until the end.
# Results (markdown) go to $OUT/decode_gpu.md, progress to $OUT/decode_gpu.log.
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
PY=${PYTHON:-python3}
PART=${1:-all}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
RESULT="$OUT/decode_gpu.md"
LOG="$OUT/decode_gpu.log"

"$PY" - <<'EOF' | tee -a "$RESULT"
import mlx.core as mx, platform
info = {}
try:
    info = mx.device_info()
except Exception:
    pass
name = info.get("device_name") or info.get("architecture") or "?"
print(f"\n## GPU run: MLX {mx.__version__}, default device {mx.default_device()}, {name}, "
      f"resource_limit {info.get('resource_limit', 'n/a')}, {platform.machine()}\n")
EOF

# EXTRA: arguments appended to every run (later ones win), e.g. a smoke test anywhere:
#   EXTRA="--layers 4 --hidden 64 --vocab 512 --dtype float32 --steps 20 --reps 1" OUT=/tmp/x bash benchmarks/gpu_run.sh
bench() { "$PY" benchmarks/decode_tokens_per_s.py "$@" ${EXTRA:-} --out "$RESULT" 2>>"$LOG"; }

LLAMA=(--model llama --layers 48 --hidden 2048 --vocab 32000 --dtype bfloat16 --prompt-len 128)
QWEN=(--model qwen3_next --layers 48 --hidden 2048 --vocab 32000 --experts 32 --dtype bfloat16 --batch 4 --prompt-len 64)

ALL=unwatched,aa,handfix,every256,watched,fix,fix4,fix16

case "$PART" in
  llama) bench "${LLAMA[@]}" --steps 800 --reps 4 --chunk 50 --variants unwatched,aa,handfix,every256,watched,fix ;;
  qwen3_next) bench "${QWEN[@]}" --steps 300 --reps 3 --chunk 100 --variants "$ALL" ;;
  steady) bench "${LLAMA[@]}" --steps 2500 --reps 2 --chunk 100 --variants unwatched,aa,handfix,wrapped,nowalk,watched,fix ;;
  long) bench "${QWEN[@]}" --steps 2500 --reps 1 --chunk 125 --variants unwatched,aa,fix ;;
  all)
    bench "${LLAMA[@]}" --steps 600 --reps 5 --chunk 100 --variants "$ALL"
    bench "${QWEN[@]}" --steps 300 --reps 3 --chunk 100 --variants "$ALL"
    ;;
  *) echo "unknown part $PART (all|llama|qwen3_next|long|steady)" >&2; exit 2 ;;
esac
echo "results in $RESULT"
