#!/usr/bin/env bash
# Every GPU measurement in one call (issue 35's rows): versions, correctness, the MFU sweep (gpt_1b,
# llama_1b and a Llama-3.1-8B-shape proxy, bf16 and FP8) with the planner's prediction and the
# GEMM counts of the compiled HLO for every point, `attention=auto` beside the named cuDNN row,
# and decode beside transformers' `generate`; then one Markdown table (printed at the end, and in
# OUT_DIR).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--wheels DIR] [--budget_s S] [--row_s S] [--extended]
#                             [--only LABEL,...]
#
# OUT_DIR (default runs/gpu_check) gets env.json, correct.json, points/*.json, decode.json,
# notes.txt, gpu_check.json and gpu_check.md. --wheels DIR: pip-installs every wheel in DIR (no
# index, no network) into a private folder first, for machines without ml-collections /
# gin-config / tensorboardX. --budget_s: no row starts once this many seconds have passed
# (default 400 on a GPU, so that one call stays under 8 minutes); --row_s: each row's own time
# limit (default 100 on a GPU; the FP8 rows, the correctness checks and the decode row get 1.5×), so one
# failing row cannot eat the window. The correctness checks run last. Rows not run are listed in the table. --extended: after issue 35's rows, the
# earlier exploration points (gpt_small, XLA attention, rolled scan, remat full, overlap flags).
# The FP8 rows run when this tree's config schema has `train.matmul_precision`; else one line says
# they were skipped. --only runs just the named rows ("decode" and "correct" name those two), in
# the sweep's order: a rerun of some rows in a short window. With no GPU it runs a tiny CPU dry run of every row, says so, and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=runs/gpu_check WHEELS="" BUDGET="" ROW_S="" EXTENDED=0 ONLY=""
USAGE="usage: bash scripts/gpu_check.sh [OUT_DIR] [--wheels DIR] [--budget_s S] [--row_s S] [--extended] [--only LABEL,...]"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --wheels=*) WHEELS="${1#*=}"; shift ;;
    --budget_s) BUDGET="$2"; shift 2 ;;
    --budget_s=*) BUDGET="${1#*=}"; shift ;;
    --row_s) ROW_S="$2"; shift 2 ;;
    --row_s=*) ROW_S="${1#*=}"; shift ;;
    --extended) EXTENDED=1; shift ;;
    --only) ONLY="$2"; shift 2 ;;
    --only=*) ONLY="${1#*=}"; shift ;;
    -*) echo "error: unknown option $1; $USAGE" >&2; exit 2 ;;
    *) OUT="$1"; shift ;;
  esac
done
for n in "${BUDGET:-0}" "${ROW_S:-0}"; do
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "error: --budget_s and --row_s take whole seconds, got '$n'; $USAGE" >&2; exit 2; }
done
PY=${PYTHON:-python3}
START=$SECONDS
rm -rf "$OUT/points" "$OUT/skipped.json" "$OUT/notes.txt" "$OUT/decode.json"
mkdir -p "$OUT/points"
note() { echo "$1"; echo "$1" >>"$OUT/notes.txt"; }

if [ -n "$WHEELS" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "error: --wheels $WHEELS holds no .whl files" >&2; exit 2; }
  SITE="${TMPDIR:-/tmp}/jaxdist-gpu-check-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || { echo "error: could not install the wheels in $WHEELS" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

backend=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -1)
# FP8 rows only where the config schema has the field.
FP8=0
"$PY" -c "import sys; from jaxdist.schema import base_config; sys.exit('matmul_precision' not in base_config().train)" 2>/dev/null && FP8=1
B=(scripts/bench_gpu.py --out_dir="$OUT")
# label | config | overrides. Issue 35's rows, the most informative first, so that a short budget
# keeps them; an "_fp8" row is its "_bf16" row with FP8 matmuls. The configs' own settings (layers
# unrolled, one-hot-matmul embedding gradient) unless a row overrides them; attention is named
# explicitly, and the "_auto" row checks what `auto` picks (the decode row runs after it).
if [ "$backend" = "gpu" ]; then
  BUDGET=${BUDGET:-400} ROW_S=${ROW_S:-100}
  echo "== GPU found: full check (budget ${BUDGET}s, ${ROW_S}s a row)"
  ROWS=(
    "gpt_1b_bf16|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --profile=2"
    "llama_1b_bf16|configs/llama_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --profile=2"
    "llama3_8b_proxy_bf16|configs/llama3_8b.py|--config.model.attention=cudnn --config.train.batch_size=1 --config.train.remat=dots_no_batch --fit_layers=8 --profile=2"
    "gpt_1b_bf16_auto|configs/gpt_1b.py|--config.model.attention=auto --config.train.batch_size=16 --config.train.remat=dots_no_batch"
  )
  EXTRA=(
    "gpt_small_b32_none_cudnn|configs/gpt_small.py|--config.model.attention=cudnn --config.train.batch_size=32 --config.train.remat=none --hand"
    "gpt_1b_b16_dnb_cudnn_hand|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --hand"
    "gpt_1b_b16_dnb_cudnn_flags|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --config.runtime.gpu_xla_flags=True"
    "gpt_1b_b16_dnb_cudnn_rolled_scatter|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=16 --config.train.remat=dots_no_batch --config.model.scan_unroll=1 --config.model.embed_grad=scatter"
    "gpt_1b_b32_full_cudnn|configs/gpt_1b.py|--config.model.attention=cudnn --config.train.batch_size=32 --config.train.remat=full"
    "gpt_1b_b8_dnb_xla|configs/gpt_1b.py|--config.model.attention=xla --config.train.batch_size=8 --config.train.remat=dots_no_batch"
    "gpt_small_b32_none_xla|configs/gpt_small.py|--config.model.attention=xla --config.train.batch_size=32 --config.train.remat=none"
  )
  COMMON="--config.runtime.gpu_memory_fraction=0.92 --steps=10 --warmup=2"
  FP8_MODE=fp8
  CORRECT=()
  DECODE=(--config=configs/llama_1b.py --batch_sizes=1,8,64 --new_tokens=128 --prompt_len=16 --dtype=bfloat16 --repeats=3)
else
  # a busy CPU is slow, not stuck: the dry run's limits only catch a hang
  BUDGET=${BUDGET:-3000} ROW_S=${ROW_S:-600}
  echo "== no GPU (JAX backend: ${backend:-none}): tiny CPU dry run of every row; no GPU figure is produced"
  export JAX_PLATFORMS=cpu
  TINY="--config.model.num_layers=2 --config.model.d_model=64 --config.model.num_heads=2 --config.model.seq_len=64 --config.model.vocab_size=256 --config.runtime.cpu_devices=1 --config.train.compute_dtype=bfloat16"
  TINY_LLAMA="--config.runtime.cpu_devices=1 --config.mesh.data=1 --config.mesh.fsdp=1 --config.model.d_model=64 --config.model.num_heads=4 --config.model.num_kv_heads=2 --config.model.head_dim=16 --config.model.mlp_dim=128 --config.model.vocab_size=256 --config.model.seq_len=64 --config.model.attention=xla"
  ROWS=(
    "tiny_gpt_bf16|configs/gpt_small.py|$TINY --config.train.batch_size=8 --config.train.remat=none --config.model.attention=xla --hand"
    "tiny_llama_bf16|configs/llama_1b.py|$TINY_LLAMA --config.model.num_layers=2 --config.model.scan_unroll=2 --config.train.batch_size=4"
    "tiny_8b_proxy_bf16|configs/llama3_8b.py|$TINY_LLAMA --config.train.batch_size=1 --fit_layers=2"
    "tiny_b8_full_auto|configs/gpt_small.py|$TINY --config.train.batch_size=8 --config.train.remat=full --config.model.attention=auto"
    "tiny_b8_cudnn|configs/gpt_small.py|$TINY --config.train.batch_size=8 --config.model.attention=cudnn"
  )
  EXTRA=()
  COMMON="--steps=3 --warmup=1"
  FP8_MODE=fp8_all  # the tiny widths are below `fp8`'s size filter: cast every block matmul
  CORRECT=(--tiny)
  DECODE=(--config=configs/llama_tiny.py --batch_sizes=1 --new_tokens=4 --prompt_len=8 --repeats=1)
fi
if [ $FP8 = 1 ]; then
  twins=()
  for r in "${ROWS[@]}"; do
    case "${r%%|*}" in
      *_bf16) twins+=("${r%%_bf16|*}_fp8|${r#*|} --config.train.matmul_precision=$FP8_MODE") ;;
    esac
  done
  # the study lowering (jaxdist.fp8.LOWERINGS) is an --extended row on a GPU (its FP8 is lost
  # in XLA there: docs/FP8.md), and runs in the dry run
  first="${twins[0]}"
  qdq="${first%%_fp8|*}_fp8_qdq|${first#*|} --fp8_lowering=qdq"
  if [ "$backend" = "gpu" ]; then EXTRA=("$qdq" "${EXTRA[@]}"); else twins+=("$qdq"); fi
  ROWS=("${ROWS[@]:0:3}" "${twins[@]}" "${ROWS[@]:3}")  # after the three bf16 rows
else
  note "FP8 rows skipped: this tree's config schema has no train.matmul_precision"
fi
[ $EXTENDED = 1 ] && ROWS+=("${EXTRA[@]}")
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
if [ -n "$ONLY" ]; then
  known=",decode,correct,"
  for p in "${ROWS[@]}"; do known+="${p%%|*},"; done
  for l in ${ONLY//,/ }; do
    [[ "$known" == *",$l,"* ]] || { echo "error: --only names $l, which is not a row here; the rows: ${known:1:-1}" >&2; exit 2; }
  done
fi

left() { echo $((BUDGET - (SECONDS - START))); }
cap() { local l; l=$(left); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }
timeout --kill-after=10 "$(cap 60)" "$PY" "${B[@]}" --phase=env \
  || note "env phase failed or ran out of time (exit $?)"

skipped=()
order=0
run_row() {  # label config overrides
  local label=$1 config=$2 overrides=$3 rc
  if [ "$(left)" -le 30 ]; then skipped+=("\"$label\""); return; fi
  order=$((order + 1))
  echo "== row $label ($(left)s of budget left)"
  # shellcheck disable=SC2086  # overrides are whitespace-separated flags by design
  local limit=$ROW_S  # FP8 rows compile 3-4x longer: XLA autotunes every FP8 GEMM shape
  [[ "$label" == *_fp8* ]] && limit=$((ROW_S * 3 / 2))
  timeout --kill-after=10 "$(cap "$limit")" "$PY" "${B[@]}" --phase=point --label="$label" \
    --config="$config" $overrides $COMMON
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "{\"label\": \"$label\", \"ok\": false, \"error\": \"stopped at its time limit\", \"model\": \"-\", \"layers\": 0, \"d_model\": 0, \"seq_len\": 0, \"batch\": 0, \"remat\": \"-\", \"attention\": \"-\", \"gpu_xla_flags\": false}" \
      >"$OUT/points/$label.json"
  fi
  # keep the sweep's order in the table
  "$PY" - "$OUT/points/$label.json" "$order" <<'EOF' 2>/dev/null
import json, sys
path, order = sys.argv[1], int(sys.argv[2])
r = json.load(open(path)); r["order"] = order; json.dump(r, open(path, "w"), indent=2)
EOF
}
run_decode() {
  wanted decode || return
  if [ "$(left)" -le 30 ]; then skipped+=("\"decode\""); return; fi
  echo "== row decode: jaxdist vs transformers' generate ($(left)s of budget left)"
  # both frameworks share the GPU: JAX takes half of it, not its default 75%
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout --kill-after=10 "$(cap $((ROW_S * 3 / 2)))" \
    "$PY" scripts/bench_data.py --study=decode --vs_transformers "${DECODE[@]}" \
    --out="$OUT/decode.json" || note "decode row failed or ran out of time (exit $?)"
}
decode_done=0
for p in "${ROWS[@]}"; do
  IFS='|' read -r label config overrides <<<"$p"
  wanted "$label" || continue
  run_row "$label" "$config" "$overrides"
  if [ "${label%_auto}" != "$label" ]; then run_decode; decode_done=1; fi
done
[ $decode_done = 1 ] || run_decode
# the correctness checks last: issue 35's rows come first in a short window
if ! wanted correct; then
  :
elif [ "$(left)" -le 30 ]; then
  skipped+=("\"correct\"")
else
  echo "== correctness checks ($(left)s of budget left)"
  timeout --kill-after=10 "$(cap $((ROW_S * 3 / 2)))" "$PY" "${B[@]}" --phase=correct "${CORRECT[@]}" \
    || note "correctness phase failed or ran out of time (exit $?)"
fi
echo "[${skipped[*]:-}]" | sed 's/ /, /g' >"$OUT/skipped.json"

"$PY" "${B[@]}" --phase=report
[ "$backend" = "gpu" ] || echo "dry run only: no GPU here, so no figure above is a GPU measurement"
echo "total $((SECONDS - START))s; wrote $OUT/gpu_check.md and $OUT/gpu_check.json"
