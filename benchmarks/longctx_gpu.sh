#!/usr/bin/env bash
# The long-context suite's grid (velox eval) on the lent GPU machine, with the real models
# carried as their GGUF files in pieces (a device call carries at most 64 MiB).
#
# Here, once (after ../shared/gpu/prepare, which readies MLX's CUDA wheels in .gpu/):
#   benchmarks/longctx_gpu.sh pack
# writes .gpu/models/<piece> (the SmolLM2 and Gemma 3 GGUFs cut into 60 MB pieces, and the
# gguf wheel that reads K-quants) and prints the device calls to make:
#   one call per piece:  carry [".gpu/models/NAME"]  command: bash benchmarks/longctx_gpu.sh take NAME
#   then:                carry [".gpu/wheels", ...]  command: source .gpu/wheels/activate && \
#                            bash benchmarks/longctx_gpu.sh calibrate   (then ... run)
# `take` keeps a piece under /tmp/models (the machine stays warm between calls); `run`
# reassembles the files, checks their SHA-256, and runs the grid, one velox eval per model,
# length and question placement, each writing its JSON and chart under $OUT.
#
# `calibrate` runs fp16 alone over a ladder of task difficulties (LADDER) at every length, so
# that each model's tasks can be set where fp16 scores at least 0.8 (a task fp16 fails
# measures nothing); `run` then takes them per model (TASKS_<model>).
#
# What `calibrate` and `run` measure is set by environment variables (defaults in brackets):
#   MODELS [smollm2 gemma3]  LENGTHS_smollm2 [4096 8192]  LENGTHS_gemma3 [4096 8192 16384 32768]
#   TASKS_<model> (or TASKS) [smollm2: passkey multikey:keys=2 multivalue:values=2;
#                             gemma3: passkey multikey multivalue multiquery vartrack cwe]
#   HAYSTACK_<model> (or HAYSTACK) [smollm2: noise; gemma3: prose]
#   TEMPLATE_<model> (or TEMPLATE) [raw]
# (SmolLM2-135M's fp16 clears 0.8 on few tasks: docs/long-context.md has its calibration)
#   PROMPTS [16]  POINTS [4x 8x]  QUESTION [after]  METHODS [the points' default specs]
#   LADDER [passkey multikey:keys=2 multikey multivalue:values=2 multiquery:keys=2
#           vartrack:hops=1 vartrack cwe:common=2]  CAL_PROMPTS [8]
set -euo pipefail
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
SMOLLM2_SHA=b179c9523d0e6a0f
GEMMA3_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

pack() {
  mkdir -p .git/info .gpu/models
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  rm -f .gpu/models/*
  local smol gemma
  smol=$(python3 -c "from velox_cli.models import gguf_path; print(gguf_path('smollm2'))")
  gemma=$(python3 -c "from velox_cli.models import gguf_path; print(gguf_path('gemma3'))")
  split -b 60m -d "$smol" .gpu/models/smollm2.gguf.
  split -b 60m -d "$gemma" .gpu/models/gemma3.gguf.
  python3 -m pip download -q --no-deps -d .gpu/models gguf 2>&1 | grep -v "is ignored" || true
  echo "pieces to carry, one device call each (command: bash benchmarks/longctx_gpu.sh take NAME):"
  (cd .gpu/models && ls -1)
}

take() {
  mkdir -p /tmp/models
  cp ".gpu/models/$1" /tmp/models/
  ls -la /tmp/models
}

assemble() {
  local name=$1 want=$2
  if [[ ! -f /tmp/models/$name.gguf ]]; then
    cat /tmp/models/"$name".gguf.[0-9]* > /tmp/models/"$name".gguf
  fi
  local got
  got=$(sha256sum /tmp/models/"$name".gguf | cut -d' ' -f1)
  [[ $got == "$want"* ]] || { echo "$name.gguf: SHA-256 $got, expected $want..."; exit 1; }
}

# the per-model setting of $1 (e.g. TASKS_gemma3), else $1, else the default $3
per_model() {
  local var="${1}_$2"
  echo "${!var:-${!1:-$3}}"
}

prepare() {
  : "${OUT:?run this on the device machine, where OUT is set}"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/models/gguf-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export VELOX_CACHE_DIR=/tmp/velox-cache
}

# the converted model's folder for $1; Gemma 3 computes in bfloat16 (float16 overflows in its
# activations), SmolLM2 in float16
model_dir() {
  local m=$1 sha=$SMOLLM2_SHA dtype=float16
  if [[ $m == gemma3 ]]; then sha=$GEMMA3_SHA dtype=bfloat16; fi
  assemble "$m" "$sha" >&2
  python3 -c "from velox_cli.models import convert_gguf as c; print(c('/tmp/models/$m.gguf', dtype='$dtype'))"
}

lengths_of() {
  if [[ $1 == gemma3 ]]; then echo "${LENGTHS_gemma3:-4096 8192 16384 32768}"
  else echo "${LENGTHS_smollm2:-4096 8192}"; fi
}

calibrate() {
  prepare
  local ladder=${LADDER:-passkey multikey:keys=2 multikey multivalue:values=2 multiquery:keys=2 vartrack:hops=1 vartrack cwe:common=2}
  for m in ${MODELS:-smollm2 gemma3}; do
    local dir hay tpl
    dir=$(model_dir "$m")
    local hay0=prose
    [[ $m == smollm2 ]] && hay0=noise
    hay=$(per_model HAYSTACK "$m" $hay0) tpl=$(per_model TEMPLATE "$m" raw)
    for n in $(lengths_of "$m"); do
      # shellcheck disable=SC2086
      velox eval --model "$dir" --lengths "$n" --methods fp16 --tasks $ladder \
        --prompts "${CAL_PROMPTS:-8}" --haystack "$hay" --template "$tpl" \
        --json "$OUT/calibrate-$m-$n-$hay-$tpl.json" --chart ""
    done
  done
}

run() {
  prepare
  for m in ${MODELS:-smollm2 gemma3}; do
    local dir hay tpl tasks q=${QUESTION:-after}
    dir=$(model_dir "$m")
    local hay0=prose tasks0="passkey multikey multivalue multiquery vartrack cwe"
    if [[ $m == smollm2 ]]; then hay0=noise tasks0="passkey multikey:keys=2 multivalue:values=2"; fi
    hay=$(per_model HAYSTACK "$m" $hay0) tpl=$(per_model TEMPLATE "$m" raw)
    tasks=$(per_model TASKS "$m" "$tasks0")
    for n in $(lengths_of "$m"); do
      # shellcheck disable=SC2086
      velox eval --model "$dir" --lengths "$n" --question "$q" \
        --prompts "${PROMPTS:-16}" --points ${POINTS:-4x 8x} --tasks $tasks \
        --haystack "$hay" --template "$tpl" ${METHODS:+--methods $METHODS} \
        --json "$OUT/eval-$m-$n-$q.json" --chart "$OUT/eval-$m-$n-$q.png"
    done
  done
}

case "${1:-}" in
  pack) pack ;;
  take) take "$2" ;;
  calibrate) calibrate ;;
  run) run ;;
  *) echo "usage: $0 pack | take NAME | calibrate | run" >&2; exit 2 ;;
esac
