#!/usr/bin/env bash
# The long-context suite's grid (velox eval) on the lent GPU machine, with the real models
# carried as their GGUF files in pieces: a device call carries at most 64 MiB, the working
# tree included, so the repo's shared/ (the reference model, 27 MB, not needed there) is
# moved aside for the calls (`aside`, and `back` after them) and each call's pieces fill what
# is left.
#
# Here, once (after ../shared/gpu/prepare, which readies MLX's CUDA wheels in .gpu/):
#   benchmarks/longctx_gpu.sh aside && benchmarks/longctx_gpu.sh pack
# writes .gpu/calls/<n>/ (MLX's CUDA backend in its two parts, the gguf wheel that reads
# K-quants, and the SmolLM2 and Gemma 3 GGUFs cut to fit) and prints the device calls to make,
# in order (the machine stays warm between calls only 30 s):
#   1:        carry [".gpu/calls/1"]                             bash benchmarks/longctx_gpu.sh take 1
#   2:        carry [".gpu/calls/2", ".gpu/part.ab", ".gpu/wheels"]  source .gpu/wheels/activate && ... take 2
#   3, 4...:  carry [".gpu/calls/N"]                             bash benchmarks/longctx_gpu.sh take N
# and any call after the pieces it needs can measure:
#   carry [".gpu/wheels", ...]  source .gpu/wheels/activate && bash benchmarks/longctx_gpu.sh suite M
# `suite M` calibrates model M (fp16 alone over a ladder of task difficulties, LADDER, at
# every length), keeps the tasks fp16 answers at 0.8 or more at every length (TASKS=auto,
# the default; the best one if none does), then runs the grid on them: every installed method
# at the POINTS, fp16 and mlx-lm's q8/q4. Results gather under /tmp/results on the machine
# and each call ends by packing all of them into $OUT/results.tgz; a run stopped by its time
# limit (SECONDS_<M>) keeps the prompts it finished, spread over every task, length and depth.
#
# Settings (environment variables, defaults in brackets):
#   LENGTHS_<M> [smollm2: 4096 8192; gemma3: 4096 8192 16384 32768]
#   TASKS_<M> (or TASKS) [auto]   HAYSTACK_<M> (or HAYSTACK) [smollm2: noise; gemma3: prose]
#   TEMPLATE_<M> (or TEMPLATE) [raw]   PROMPTS [16]  POINTS [4x 8x]  QUESTION [after]
#   METHODS [the points' default specs]  JOBS [12]  SECONDS_<M> [420]  CAL_PROMPTS [8]
#   MAX_TASKS [3]  ORDER (of the models' pieces in the calls) [smollm2 gemma3]
#   DEADLINE: the seconds the whole call may take (the device call's limit): each velox eval
#     stops 60 s before it (counted from the suite's start, the model's conversion included), so
#     that the results are packed into $OUT before the call ends (a call cut off returns nothing)
#   LADDER [passkey multikey:keys=2 multikey multivalue:values=2 multiquery:keys=2
#           vartrack:hops=1 vartrack cwe:common=2]
set -euo pipefail
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
SMOLLM2_SHA=b179c9523d0e6a0f
GEMMA3_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
LIMIT=$((64 * 1024 * 1024))
RESULTS=/tmp/results

ASIDE=${ASIDE:-../velox-shared-aside}

# the bytes of the working tree that travel with every call (as it is now: after `aside`)
tree_bytes() {
  git ls-files -co --exclude-standard | tr '\n' '\0' |
    xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}'
}

# move shared/ out of the tree for the device calls (the real models' fitted artifacts stay)
aside() {
  [[ -e $ASIDE ]] && { echo "$ASIDE exists: run '$0 back' first" >&2; exit 1; }
  mv shared "$ASIDE"
  mkdir -p shared/artifacts
  cp "$ASIDE"/artifacts/*-smollm2.* "$ASIDE"/artifacts/*-gemma3.* shared/artifacts/ 2>/dev/null || true
  echo "shared/ is in $ASIDE until '$0 back'; travelling: $(($(tree_bytes) >> 10)) KiB"
}

back() {
  [[ -d $ASIDE ]] || { echo "nothing aside in $ASIDE" >&2; exit 1; }
  rm -rf shared && mv "$ASIDE" shared
}

pack() {
  mkdir -p .git/info
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  [[ -f .gpu/part.aa && -f .gpu/part.ab ]] || { echo "run ../shared/gpu/prepare first" >&2; exit 1; }
  rm -rf .gpu/calls .gpu/whl && mkdir -p .gpu/calls .gpu/whl
  python3 -m pip download -q --no-deps -d .gpu/whl gguf 2>&1 | grep -v "is ignored" || true
  local smol gemma
  smol=$(python3 -c "from velox_cli.models import gguf_path; print(gguf_path('smollm2'))")
  gemma=$(python3 -c "from velox_cli.models import gguf_path; print(gguf_path('gemma3'))")
  python3 - "$(tree_bytes)" "$LIMIT" "$smol" "$gemma" <<'EOF'
import os, shutil, sys
from pathlib import Path

tree, limit, smol, gemma = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
size = lambda *ps: sum(os.path.getsize(p) for p in ps)
wheels = size(*[str(p) for p in Path(".gpu/wheels").iterdir()])
margin = wheels + (1 << 20)  # any call may carry .gpu/wheels too, to measure
calls = [["part.aa"], ["whl"]]  # what each call carries besides its pieces
room = [limit - tree - margin - size(".gpu/part.aa"),
        limit - tree - margin - size(".gpu/part.ab") - size(*Path(".gpu/whl").glob("*"))]
Path(".gpu/calls/1").mkdir()
os.link(".gpu/part.aa", ".gpu/calls/1/part.aa")
Path(".gpu/calls/2").mkdir()
for w in Path(".gpu/whl").glob("*"):
    os.link(w, f".gpu/calls/2/{w.name}")
n, free = 0, room[0]
paths = {"smollm2": smol, "gemma3": gemma}
for name in os.environ.get("ORDER", "smollm2 gemma3").split():
    path = paths[name]
    with open(path, "rb") as f:
        k = 0
        while True:
            if free <= 0:
                n += 1
                free = room[n] if n < len(room) else limit - tree - margin
                Path(f".gpu/calls/{n + 1}").mkdir(exist_ok=True)
            chunk = f.read(free)
            if not chunk:
                break
            Path(f".gpu/calls/{n + 1}/{name}.gguf.{k:02d}").write_bytes(chunk)
            free -= len(chunk)
            k += 1
for d in sorted(Path(".gpu/calls").iterdir(), key=lambda d: int(d.name)):
    print(f"call {d.name}: " + " ".join(sorted(p.name for p in d.iterdir()))
          + f"  ({size(*d.iterdir()) / 2**20:.1f} MiB)")
EOF
}

take() {
  mkdir -p /tmp/models /tmp/gpu
  local f
  for f in .gpu/calls/"$1"/*; do
    case $f in
      */part.aa) cp "$f" /tmp/gpu/ ;;
      *) cp "$f" /tmp/models/ ;;
    esac
  done
  ls -la /tmp/models
}

assemble() {
  local name=$1 want=$2
  if [[ ! -f /tmp/models/$name.gguf ]]; then
    cat /tmp/models/"$name".gguf.[0-9]* > /tmp/models/"$name".gguf.part
    mv /tmp/models/"$name".gguf.part /tmp/models/"$name".gguf
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
  if [[ ! -d /tmp/site/gguf ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/models/gguf-*.whl
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export VELOX_CACHE_DIR=/tmp/velox-cache
  mkdir -p "$RESULTS"
}

# the converted model's folder for $1; Gemma 3 computes in bfloat16 (float16 overflows in its
# activations), SmolLM2 in float16
model_dir() {
  local m=$1 sha=$SMOLLM2_SHA dtype=float16
  if [[ $m == gemma3 ]]; then sha=$GEMMA3_SHA dtype=bfloat16; fi
  assemble "$m" "$sha" >&2
  python3 -c "from velox_cli.models import convert_gguf as c; print(c('/tmp/models/$m.gguf', dtype='$dtype'))"
}

# the tasks of $1 (a calibration JSON) that fp16 answers at $2 or more at every length, the
# hardest of each family (the last in the ladder's order), at most $3 families; the best one
# (by its lowest length) if none passes
pick_tasks() {
  python3 - "$1" "$2" "$3" <<'EOF'
import json, sys

cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["spec"] == "fp16"]
worst = {}
for c in cells:
    worst[c["task"]] = min(worst.get(c["task"], 1.0), c["accuracy"])
family = {}
for t, a in worst.items():
    if a >= float(sys.argv[2]):
        family[t.split(":")[0]] = t
keep = list(family.values())[: int(sys.argv[3])]
print(" ".join(keep or [max(worst, key=worst.get)]))
EOF
}

# run $2... under a time limit of $1 seconds, then stop it as Ctrl-C would (velox eval keeps the
# prompts it finished)
limited() {
  local s=$1 spy
  shift
  # 20 s before the limit every eval worker prints its Python stack to the log (SIGUSR1,
  # faulthandler): where a share that finishes no prompt is stuck
  (sleep $((s > 40 ? s - 20 : s)) && pkill -USR1 -f "multiprocessing.spawn") 2>/dev/null &
  spy=$!
  timeout -s TERM -k 30 "$s" "$@" 2> >(tee -a "$RESULTS/stderr.log" >&2) ||
    echo "(stopped after $s s: the finished prompts are kept)"
  pkill -P "$spy" 2>/dev/null; kill "$spy" 2>/dev/null || true
}

finish() {
  [[ -d $RESULTS ]] && tar czf "$OUT/results.tgz" -C "$RESULTS" . && ls -la "$RESULTS"
}

# the seconds a velox eval may run: $1, or less where DEADLINE (counted from the call's
# start, $CALL_START) leaves less: 60 s kept for the eval's exit and the packing
capped() {
  local want=$1
  if [[ -n ${DEADLINE:-} ]]; then
    local room=$((DEADLINE - (SECONDS - CALL_START) - 60))
    ((room < want)) && want=$room
  fi
  echo $((want > 1 ? want : 1))
}

suite() {
  local m=$1
  CALL_START=$SECONDS
  prepare
  trap finish EXIT
  local dir hay tpl tasks q=${QUESTION:-after} lengths hay0=prose
  local ladder=${LADDER:-passkey multikey:keys=2 multikey multivalue:values=2 multiquery:keys=2 vartrack:hops=1 vartrack cwe:common=2}
  [[ $m == smollm2 ]] && hay0=noise
  dir=$(model_dir "$m")
  hay=$(per_model HAYSTACK "$m" $hay0) tpl=$(per_model TEMPLATE "$m" raw)
  lengths=$(per_model LENGTHS "$m" "$([[ $m == gemma3 ]] && echo 4096 8192 16384 32768 || echo 4096 8192)")
  local start=$SECONDS budget
  budget=$(per_model SECONDS "$m" 420)
  tasks=$(per_model TASKS "$m" auto)
  local cal="$RESULTS/calibrate-$m-$hay-$tpl.json"
  if [[ $tasks == auto ]]; then
    if [[ ! -f $cal ]]; then
      # shellcheck disable=SC2086
      limited "$(capped "$budget")" velox eval --model "$dir" --lengths $lengths --methods fp16 \
        --tasks $ladder --prompts "${CAL_PROMPTS:-8}" --haystack "$hay" --template "$tpl" \
        --jobs "${JOBS:-12}" --json "$cal" --chart ""
    fi
    tasks=$(pick_tasks "$cal" 0.8 "${MAX_TASKS:-3}")
  fi
  echo "$m: tasks $tasks at $lengths"
  local left=$((budget - (SECONDS - start)))
  # shellcheck disable=SC2086
  limited "$(capped "$left")" velox eval --model "$dir" --lengths $lengths --question "$q" \
    --prompts "${PROMPTS:-16}" --points ${POINTS:-4x 8x} --tasks $tasks \
    --haystack "$hay" --template "$tpl" ${METHODS:+--methods $METHODS} --jobs "${JOBS:-12}" \
    --json "$RESULTS/eval-$m-$q-$hay-$tpl.json" --markdown "$RESULTS/eval-$m-$q-$hay-$tpl.md" \
    --chart "$RESULTS/eval-$m-$q-$hay-$tpl.png"
}

case "${1:-}" in
  aside) aside ;;
  back) back ;;
  pack) pack ;;
  take) take "$2" ;;
  suite) suite "$2" ;;
  *) echo "usage: $0 aside | pack | take N | suite MODEL | back" >&2; exit 2 ;;
esac
