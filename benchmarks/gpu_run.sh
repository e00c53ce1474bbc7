#!/usr/bin/env bash
# The GPU checks and the end-to-end timings, stage by stage, each stage one command under ten
# minutes on an H200; results (text and JSON) under $OUT (default ./gpu-out).
#
#   bash benchmarks/gpu_run.sh tests       # every -m gpu test (caches, decode kernels)
#   bash benchmarks/gpu_run.sh first-use   # benchmarks/first_use.py: first processes with NVRTC
#     in worker processes and in threads (VELOX_COMPILE_PROCESSES), alternated, then a second one
#     (RUNS, space-separated name:setting pairs [procs1:1 threads1:0 procs2:1 threads2:0])
#   bash benchmarks/gpu_run.sh e2e-32k     # fp16 and the velox specs of issue 26 at 4k and 32k
#   bash benchmarks/gpu_run.sh e2e-128k    # the same at 128k
#   bash benchmarks/gpu_run.sh batch       # batch 8 at 32k, and batch_serve.py's two runs
#   bash benchmarks/gpu_run.sh steps       # decode_steps.py at 32k: the slow steps per cache
#   bash benchmarks/gpu_run.sh fill-check  # capacity.py --fill-check: the direct fill's peaks
#   bash benchmarks/gpu_run.sh mla         # DeepSeek-V3's attention at 32k: fp16 against the
#     4-bit latent decoded from its codes (VELOX_LATENT_CODES=1: off on CUDA by default)
#   bash benchmarks/gpu_run.sh mla-host    # the host's share of a latent layer's decode step:
#     latent_host.py's pieces, then host_profile.py's profile of generate_step at 32k
#   bash benchmarks/gpu_run.sh capacity    # capacity.py --fill direct, one run per cache
#     (CACHES, space-separated specs [fp16 uniform:bits=4]; BUDGETS [16,24,36,64]; SHAPE
#     [llama3-8b]; WEIGHTS [4bit]; LIMIT seconds for the stage [540]: a run is started only with 60 s left,
#     and one stopped at the limit keeps its rows in $out/capacity-<cache>.json.partial)
#
# The first stage on a fresh machine also builds MLX's own kernels (about a minute).
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
specs=fp16,uniform:bits=4,kivi:bits=2,turboquant:bits=4
case "${1:-}" in
  tests)
    python3 -m pytest -q -m gpu tests/test_gpu_caches.py tests/test_gpu_attention.py \
      -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.txt" | tail -25
    ;;
  first-use)
    # first processes, each with an empty kernel cache (and no driver JIT cache), NVRTC in
    # worker processes (VELOX_COMPILE_PROCESSES=1) and in this process's threads (0)
    # alternated, the compiles ahead on; then a second process on the last one's cache
    for run in ${RUNS:-procs1:1 threads1:0 procs2:1 threads2:0}; do
      dir=$(mktemp -d)
      MLX_PTX_CACHE_DIR=$dir CUDA_CACHE_DISABLE=1 VELOX_COMPILE_PROCESSES=${run#*:} \
        python3 benchmarks/first_use.py --cache uniform:bits=4 | tee "$out/first-use-${run%:*}.jsonl"
      [ "${run#*:}" = 1 ] && last=$dir
    done
    MLX_PTX_CACHE_DIR=$last python3 benchmarks/first_use.py --cache uniform:bits=4 \
      | tee "$out/first-use-second.jsonl"
    ;;
  e2e-32k)
    python3 benchmarks/e2e.py --shape llama3-8b --weights 4bit --contexts 4096,32768 \
      --caches "$specs" --steps 256 --repeats 2 --json "$out/e2e-32k.json" | tail -12
    ;;
  e2e-128k)
    python3 benchmarks/e2e.py --shape llama3-8b --weights 4bit --contexts 131072 \
      --caches "$specs" --steps 128 --json "$out/e2e-128k.json" | tail -8
    ;;
  batch)
    python3 benchmarks/e2e.py --shape llama3-8b --weights 4bit --contexts 32768 --batch 8 \
      --caches fp16,uniform:bits=4 --steps 24 --json "$out/e2e-b8.json" | tail -5
    ;;
  steps)
    python3 benchmarks/decode_steps.py --shape llama3-8b --weights 4bit --context 32768 \
      --caches "$specs" --steps 256 --sync --json "$out/decode-steps-32k.json" | tail -20
    ;;
  mla)
    # the decoded latent (CUDA's default), then the latent's codes (VELOX_LATENT_CODES=1),
    # each against fp16 in its own process, rows in rotation
    for codes in default on; do
      [[ $codes == on ]] && export VELOX_LATENT_CODES=1
      python3 benchmarks/e2e.py --shape deepseek-v3-8l --weights 4bit --contexts 32768 \
        --caches fp16,uniform:bits=4 --chunk 512 --steps "${MLA_STEPS:-128}" --repeats 2 \
        --json "$out/e2e-mla-32k-codes-$codes.json" 2>&1 | tail -8
    done
    unset VELOX_LATENT_CODES
    ;;
  mla-host)
    python3 benchmarks/latent_host.py --json "$out/latent-host.json"
    python3 benchmarks/host_profile.py --shape deepseek-v3-8l --weights 4bit --context 32768 \
      --chunk 512 --cache uniform:bits=4 --generate --steps 128 --top 40 \
      > "$out/host-profile-mla.txt" 2>&1
    grep -E "generate_step token|^== " "$out/host-profile-mla.txt"
    ;;
  fill-check)
    python3 benchmarks/capacity.py --shapes "${SHAPE:-llama3-8b}" --caches fp16,uniform:bits=4 \
      --fill-check 16384,65536 --json "$out/fill-check.json" 2>&1 | tail -8
    ;;
  capacity)
    start=$(date +%s)
    for c in ${CACHES:-fp16 uniform:bits=4}; do
      left=$(( ${LIMIT:-540} - ($(date +%s) - start) ))
      (( left < 60 )) && { echo "capacity: $c not started, ${left} s left"; continue; }
      timeout $(( left - 5 )) python3 benchmarks/capacity.py --shapes "${SHAPE:-llama3-8b}" \
        --budgets "${BUDGETS:-16,24,36,64}" --weights "${WEIGHTS:-4bit}" --caches "$c" \
        --fill direct --tolerance 1/16 \
        --json "$out/capacity-${c//[:=.,%+]/-}.json" 2>&1 | tee -a "$out/capacity.log" | grep -v "^  " | tail -12
    done
    ;;
  *)
    echo "usage: bash benchmarks/gpu_run.sh tests|first-use|e2e-32k|e2e-128k|batch|steps|mla|fill-check|capacity" >&2
    exit 2
    ;;
esac
