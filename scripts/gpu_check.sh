#!/usr/bin/env bash
# Every GPU measurement in one call: versions, correctness, a throughput/MFU sweep with the planner's
# prediction for every point, then one Markdown table (printed at the end, and in OUT_DIR).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--wheels DIR] [--budget_s S]
#
# OUT_DIR (default runs/gpu_check) gets env.json, correct.json, points/*.json, gpu_check.json and
# gpu_check.md. --wheels DIR: pip-installs every wheel in DIR (no index, no network) into a private
# folder first, for machines without ml-collections / gin-config / tensorboardX. --budget_s: the
# sweep stops starting points once this many seconds have passed (default 510, so that one call
# stays under 9 minutes); the points not run are listed in the table.
# With no GPU it runs a tiny CPU dry run of the same steps, says so, and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=runs/gpu_check WHEELS="" BUDGET=510
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --wheels=*) WHEELS="${1#*=}"; shift ;;
    --budget_s) BUDGET="$2"; shift 2 ;;
    --budget_s=*) BUDGET="${1#*=}"; shift ;;
    -*) echo "error: unknown option $1; usage: bash scripts/gpu_check.sh [OUT_DIR] [--wheels DIR] [--budget_s S]" >&2; exit 2 ;;
    *) OUT="$1"; shift ;;
  esac
done
PY=${PYTHON:-python3}
START=$SECONDS
rm -rf "$OUT/points" "$OUT/skipped.json"
mkdir -p "$OUT/points"

if [ -n "$WHEELS" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "error: --wheels $WHEELS holds no .whl files" >&2; exit 2; }
  SITE="${TMPDIR:-/tmp}/jaxdist-gpu-check-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || { echo "error: could not install the wheels in $WHEELS" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

backend=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -1)
B=(scripts/bench_gpu.py --out_dir="$OUT")
if [ "$backend" = "gpu" ]; then
  echo "== GPU found: full check (budget ${BUDGET}s for the sweep)"
  # label | config | overrides: the most informative points first, so a short budget keeps them.
  # The configs' own settings (layers unrolled, one-hot-matmul embedding gradient) unless a point
  # overrides them; attention named explicitly, plus one point that checks what `auto` picks.
  POINTS=(
    "gpt_1b_b16_dnb_cudnn|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --hand --profile=2"
    "gpt_small_b32_none_cudnn|configs/gpt_small.py|--config.model.attention=cudnn --config.train.batch_size=32 --config.train.remat=none --hand --profile=2"
    "gpt_1b_b16_dnb_auto|configs/gpt_1b.py|--config.model.attention=auto --config.train.batch_size=16 --config.train.remat=dots_no_batch"
    "gpt_1b_b16_dnb_cudnn_flags|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --config.runtime.gpu_xla_flags=True"
    "gpt_1b_b16_dnb_cudnn_rolled_scatter|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --config.model.scan_unroll=1 --config.model.embed_grad=scatter"
    "gpt_1b_b32_full_cudnn|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=32 --config.train.remat=full"
    "gpt_1b_b8_dnb_xla|configs/gpt_1b.py|--config.model.attention=xla --config.train.batch_size=8 --config.train.remat=dots_no_batch"
    "gpt_small_b32_none_xla|configs/gpt_small.py|--config.model.attention=xla --config.train.batch_size=32 --config.train.remat=none"
  )
  LLAMA="llama_1b_b16_dnb_cudnn|configs/llama_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --hand"
  [ -f configs/llama_1b.py ] && POINTS=("${POINTS[@]:0:2}" "$LLAMA" "${POINTS[@]:2}")
  COMMON="--config.runtime.gpu_memory_fraction=0.92 --steps=20 --warmup=3"
  CORRECT=()
else
  echo "== no GPU (JAX backend: ${backend:-none}): tiny CPU dry run of every step; no GPU figure is produced"
  export JAX_PLATFORMS=cpu
  TINY="--config.model.num_layers=2 --config.model.d_model=64 --config.model.num_heads=2 --config.model.seq_len=64 --config.model.vocab_size=256 --config.runtime.cpu_devices=1 --config.train.compute_dtype=bfloat16"
  POINTS=(
    "tiny_b8_none_xla|configs/gpt_small.py|$TINY --config.train.batch_size=8 --config.train.remat=none --config.model.attention=xla --hand"
    "tiny_b8_full_auto|configs/gpt_small.py|$TINY --config.train.batch_size=8 --config.train.remat=full --config.model.attention=auto"
    "tiny_b8_cudnn|configs/gpt_small.py|$TINY --config.train.batch_size=8 --config.model.attention=cudnn"
  )
  COMMON="--steps=3 --warmup=1"
  CORRECT=(--tiny)
fi

"$PY" "${B[@]}" --phase=env || echo "env phase failed (exit $?)"
"$PY" "${B[@]}" --phase=correct "${CORRECT[@]}" || echo "correctness phase failed (exit $?)"

skipped=()
order=0
for p in "${POINTS[@]}"; do
  IFS='|' read -r label config overrides <<<"$p"
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -le 30 ]; then skipped+=("\"$label\""); continue; fi
  order=$((order + 1))
  echo "== point $label (${left}s of budget left)"
  # shellcheck disable=SC2086  # overrides are whitespace-separated flags by design
  timeout --kill-after=10 "$left" "$PY" "${B[@]}" --phase=point --label="$label" \
    --config="$config" $overrides $COMMON
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "{\"label\": \"$label\", \"ok\": false, \"error\": \"stopped at the time budget\", \"model\": \"-\", \"layers\": 0, \"d_model\": 0, \"seq_len\": 0, \"batch\": 0, \"remat\": \"-\", \"attention\": \"-\", \"gpu_xla_flags\": false}" \
      >"$OUT/points/$label.json"
  fi
  # keep the sweep's order in the table
  "$PY" - "$OUT/points/$label.json" "$order" <<'EOF' 2>/dev/null
import json, sys
path, order = sys.argv[1], int(sys.argv[2])
r = json.load(open(path)); r["order"] = order; json.dump(r, open(path, "w"), indent=2)
EOF
done
echo "[${skipped[*]:-}]" | sed 's/ /, /g' >"$OUT/skipped.json"

"$PY" "${B[@]}" --phase=report
[ "$backend" = "gpu" ] || echo "dry run only: no GPU here, so no figure above is a GPU measurement"
echo "total ${SECONDS}s; wrote $OUT/gpu_check.md and $OUT/gpu_check.json"
