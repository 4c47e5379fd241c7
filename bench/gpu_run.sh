#!/usr/bin/env bash
# The NVIDIA run of the benchmarks (issue 6), in stages, for a lent GPU machine
# that has Python 3.12 + the CUDA 13 runtime wheels (PyTorch's) but no MLX and
# no internet. MLX runs there through mlx-cuda-13, whose wheel (~86 MB) is larger
# than one transfer, so the wheels come in three carried folders:
#   .whl1  the first part of the mlx-cuda-13 wheel (split -b 62M, part00)
#   .whl2  the second part, mlx, mlx-lm, the engine's web stack, mlxd's own wheel
#   .whl3  LiteLLM and the rest of the gateway's dependencies
# (bench/README.md, "On an NVIDIA GPU", shows how they are downloaded.)
#
#   bash bench/gpu_run.sh stage     # call 1: keep .whl1 in /tmp/stage
#   bash bench/gpu_run.sh engine    # call 2: install, build the 8B model, bound + engine overhead
#   bash bench/gpu_run.sh gateway   # call 3: install LiteLLM, gateway overhead on the 8B model
#   bash bench/gpu_run.sh cache     # after `engine` (BUILD_ONLY=1 is enough): the prompt-cache benchmark
#   bash bench/gpu_run.sh profile   # likewise: bench/kv_reuse_profile.py (a diagnosis, mlx-lm alone)
#   bash bench/gpu_run.sh concurrency  # likewise: 1/2/4/8 clients, mlxd single/batched vs mlx_lm.server
#   bash bench/gpu_run.sh kv        # likewise: bench/kv_memory.py (kv_bits at 8k/32k, memory over a 4k generation)
#   bash bench/gpu_run.sh structured  # after `stage`: bench/structured_outputs.py (bound answers' cost) on the 8b model
#   BUILDS=old bash bench/gpu_run.sh squeeze  # after `stage`: a squeezed prompt cache, an earlier mlxd (.whl2/old/)
#   BUILDS=new bash bench/gpu_run.sh squeeze  #   against this tree's (issue 35), one call each
#   BUILDS=old bash bench/gpu_run.sh agents   # likewise: four agents at once (bench/agents_load.py), the last
#                                             #   build's run with mlx-lm's floors (FLOORS=none: without)
#   ARMS=faults bash bench/gpu_run.sh faults  # after `stage`, with .whl3: agents while the engine is killed (issue 36)
#   bash bench/gpu_run.sh recovery  # after `faults`' installs: SIGABRT -> serving, standby against afresh (issue 36)
#   bash bench/gpu_run.sh load      # after `engine`: the eager load against reading the files (issue 36)
#   bash bench/gpu_run.sh idle      # after `stage`: the memory an idle model gives back (issue 38)
#   bash bench/gpu_run.sh stall     # after `engine`: a turn's store's parts against the batch's steps (issue 51)
#   bash bench/gpu_run.sh mixed     # after `engine`: a joining prompt's chunk against the decoding rows' steps
#   bash bench/gpu_run.sh shapes    # after `engine`: what a new attention shape costs a step (cuDNN's graphs)
#   PART=1 bash bench/gpu_run.sh issue51  # after `engine`: issue 51's agents runs (PART=2: larger steps, the probe)
# Results go to $OUT (or bench/results/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT" /tmp/stage
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True
export PYTHONPATH=/tmp/site:/tmp/site2
MODEL=/tmp/models/demo-8b
PY=python3

pip_target() {  # pip_target DIR WHEELS...: one transaction, so wheels sharing a folder (mlx/) merge
  local dir=$1; shift
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" "$@"
}

install_engine() {  # once per machine: MLX (CUDA), mlx-lm, the engine's web stack, mlxd; then the 8b model
  if [ ! -d /tmp/site/mlx ]; then
    find .whl2 -maxdepth 1 -type f -exec cp {} /tmp/stage/ \;  # (.whl2/old/: an earlier mlxd, for `squeeze`)
    cat /tmp/stage/mlxcuda.part* > /tmp/stage/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    rm /tmp/stage/mlxcuda.part*
    pip_target /tmp/site /tmp/stage/*.whl
  fi
  # mlx-cuda-13 finds the CUDA libraries through $ORIGIN/../../nvidia/*/lib: point
  # that at the CUDA 13 wheels already installed (PyTorch's).
  nv=$($PY -c 'import nvidia, sys; print([p for p in nvidia.__path__ if "/tmp/site" not in p][0])')
  ln -sfn "$nv" /tmp/site/nvidia
  $PY -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), mx.cuda.is_available())'
  $PY -c "
from pathlib import Path
from mlxd.engine.model.demo_model import build_demo_model
build_demo_model(Path('$MODEL'), '8b', progress=print)"
  du -sh "$MODEL"
}

install_gateway() {  # after `stage3` (.whl3 kept in /tmp/stage3), with .whl4 carried: LiteLLM and the rest
  if [ ! -d /tmp/site2/litellm ]; then
    mkdir -p /tmp/site2
    pip_target /tmp/site2 /tmp/stage3/*.whl $(find .whl4 -maxdepth 1 -name '*.whl' 2>/dev/null)
  fi
  $PY -c 'import litellm.proxy.proxy_server, mlxd.gateway.main, supervisor.supervisord' >/dev/null
}

case "${1:-}" in
idle)
  # Issue 38: the memory an idle model gives back, from outside (RSS and nvidia-smi), on the 8b demo model.
  install_engine
  $PY bench/idle_unload.py --model "$MODEL" --keep-alive "${KEEP_ALIVE:-10s}" --out "$OUT/idle_unload_8b.json" \
    | tee "$OUT/idle_unload_8b.md"
  ;;
stage-model)
  # The real default model's GGUF (~98 MB: more than one transfer), in parts split -b 48M, one carried a call.
  mkdir -p /tmp/stage-model && cp .whl5/smollm2.part* /tmp/stage-model/ && ls -la /tmp/stage-model
  ;;
speculative)
  # Issue 37: what verifying k tokens costs against one decode step (the 8b demo, the default model), then
  # prompt lookup against off over HTTP (bench/speculative.py) on the real default model (edit, tool call, chat;
  # one client and 4 at once) and on the 8b demo (random weights: nothing to accept, so its cost). PARTS picks.
  install_engine
  export MLXD_MODEL_CACHE=/tmp/model-cache
  if ls /tmp/stage-model/smollm2.part* >/dev/null 2>&1; then
    mkdir -p "$MLXD_MODEL_CACHE"
    cat /tmp/stage-model/smollm2.part* > "$MLXD_MODEL_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
    rm /tmp/stage-model/smollm2.part*
  fi
  sha256sum "$MLXD_MODEL_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
  IFS=, read -ra parts <<< "${PARTS:-verify8b,verifydefault,default,default4,8b}"
  for part in "${parts[@]}"; do
    case $part in
    verify8b) $PY bench/speculative.py --verify-cost --model "$MODEL" --context "${CONTEXTS:-512,4096,16384}" \
                  --out "$OUT/speculative_verify_8b.json" | tee "$OUT/speculative_verify_8b.md" ;;
    verifydefault) $PY bench/speculative.py --verify-cost --context "${CONTEXTS:-512,4096,16384}" \
                  --out "$OUT/speculative_verify_default.json" | tee "$OUT/speculative_verify_default.md" ;;
    default) $PY bench/speculative.py --rounds "${ROUNDS:-3}" --max-tokens 400 --workloads edit,tool_args,chat,json \
                  --out "$OUT/speculative_default.json" | tee "$OUT/speculative_default.md" ;;
    default4) $PY bench/speculative.py --rounds "${ROUNDS:-3}" --max-tokens 400 --clients 4 \
                  --out "$OUT/speculative_default_4clients.json" | tee "$OUT/speculative_default_4clients.md" ;;
    8b) $PY bench/speculative.py --model "$MODEL" --rounds "${ROUNDS:-3}" --max-tokens 256 --workloads chat,edit,json \
                  --out "$OUT/speculative_8b.json" | tee "$OUT/speculative_8b.md" ;;
    esac
  done
  ;;
recovery)
  # Issue 36, item 4: SIGABRT -> serving on the 8b model, the standby engine against a fresh start
  # (bench/recovery.py, both arms one run), after `faults`' installs.
  install_engine
  install_gateway
  $PY bench/recovery.py --model "$MODEL" --crashes "${CRASHES:-3}" --arms "${ARMS:-standby,afresh}" \
      --out "$OUT/recovery_8b.json" | tee "$OUT/recovery_8b.md"
  ;;
load)
  # Issue 36, item 4: the 8b model's eager load against reading its files (bench/weights_load.py), CACHE modes.
  install_engine
  $PY bench/weights_load.py --model-dir "$MODEL" --arms eager --rounds "${ROUNDS:-2}" --cache "${CACHE:-warm,cold}" \
      --warmup "${WARMUP:-1}" --max-tokens 4 --json-out "$OUT/weights_load_8b_speed.json" | tee "$OUT/weights_load_8b_speed.md"
  ;;
issue51)
  # Issue 51's GPU figures in two calls of <= 600 s (after `stage` and `BUILD_ONLY=1 engine`, with .whl2 and
  # .whl2/old), the engine's debug step log with each. PART=1: four agents shared and distinct, old and new, with
  # mlx-lm's plain floor. PART=2: distinct at prefill_step_size 2048 (old, new) and 8192 (new: a joining turn's
  # whole prompt, the four agents' together, in one step, as the floor prefills), then the store's stall probe.
  export PROMPT_CACHE_GIB=default ENGINE_LOG_LEVEL=debug
  if [ "${PART:-1}" = 1 ]; then
    SHARED=1 BUILDS="old new" FLOORS=plain bash "$0" agents
    BUILDS="old new" FLOORS=plain bash "$0" agents
  else
    mkdir -p "$OUT/step2048" "$OUT/step8192"
    OUT="$OUT/step2048" PREFILL_STEP=2048 BUILDS="old new" FLOORS=none bash "$0" agents
    OUT="$OUT/step8192" PREFILL_STEP=8192 BUILDS="new" FLOORS=none bash "$0" agents
    bash "$0" stall
  fi
  ;;
mixed)
  # What a joining prompt costs the decoding rows, each part to the device's end (bench/mixed_step_probe.py), 8b.
  install_engine
  $PY bench/mixed_step_probe.py "$MODEL" --context "${CONTEXT:-15600}" | tee "$OUT/mixed_step_probe_8b.md"
  ;;
shapes)
  # What a new shape costs a step on MLX's CUDA backend (bench/cuda_shapes_probe.py: cuDNN's graph a shape), 8b.
  install_engine
  $PY bench/cuda_shapes_probe.py "$MODEL" | tee "$OUT/cuda_shapes_probe_8b.md"
  ;;
stall)
  # Where a finishing turn's store stalls the batch (bench/store_stall_probe.py: a diagnosis), on the 8b model.
  install_engine
  $PY bench/store_stall_probe.py "$MODEL" --context "${CONTEXT:-16384}" | tee "$OUT/store_stall_probe_8b.md"
  ;;
grammar-probe)
  # Where a bound answer's decode step goes (bench/grammar_step_probe.py: a diagnosis), on the 8b model.
  install_engine
  $PY bench/grammar_step_probe.py "$MODEL" --rounds "${ROUNDS:-3}" | tee "$OUT/grammar_step_probe_8b.md"
  ;;
structured)
  # Bound answers (issue 34): decode with a JSON schema against free text, the grammar's time per token,
  # what a bound row costs a batch of 4, on the 8b demo model (random weights: no validity figures).
  install_engine
  $PY bench/structured_outputs.py --model "$MODEL" --skip-validity --rounds "${ROUNDS:-3}" --max-tokens 256 \
      --out "$OUT/structured_outputs_8b.json" | tee "$OUT/structured_outputs_8b.md"
  ;;
stage3)  # the gateway's first wheels (.whl3), kept for `faults`
  mkdir -p /tmp/stage3 && cp .whl3/*.whl /tmp/stage3/ && ls /tmp/stage3 | wc -l
  ;;
stage)
  cp .whl1/* /tmp/stage/
  ls -la /tmp/stage
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  ;;
engine)
  install_engine
  [ -n "${BUILD_ONLY:-}" ] && exit 0
  $PY bench/roofline.py "$MODEL" --gib 2 | tee "$OUT/roofline.json"
  $PY bench/engine_overhead.py --model "$MODEL" --rounds "${ROUNDS:-5}" --max-tokens 256 \
      --startup-timeout 300 --out "$OUT/engine_overhead_8b.json" | tee "$OUT/engine_overhead_8b.md"
  ;;
gateway)
  cp .whl3/* /tmp/stage/
  mkdir -p /tmp/site2
  pip_target /tmp/site2 .whl3/*.whl
  # Fail fast on a missing dependency instead of waiting out `mlxd up --timeout`.
  $PY -c 'import litellm.proxy.proxy_server, mlxd.gateway.main, supervisor.supervisord' >/dev/null
  $PY bench/gateway_overhead.py --model "$MODEL" --rounds "${ROUNDS:-7}" --max-tokens 256 --ready-runs 1 \
      --timeout 180 --no-short --out "$OUT/gateway_overhead_8b.json" | tee "$OUT/gateway_overhead_8b.md"
  ;;
cache)
  # The prompt cache (issue 13): a 10-turn agent conversation with a system prompt of
  # SYSTEM_TOKENS (~8k) tokens, with/without the cache, mlx_lm.server, across a SIGABRT.
  install_engine
  [ -n "${BUILD_ONLY:-}" ] && exit 0
  $PY bench/prompt_cache.py --model "$MODEL" --system-tokens "${SYSTEM_TOKENS:-8000}" --max-tokens 32 \
      --turns 10 --rounds "${ROUNDS:-1}" --interleaved-turns 3 --startup-timeout 300 \
      --out "$OUT/prompt_cache_8b.json" | tee "$OUT/prompt_cache_8b.md"
  ;;
concurrency)
  # Concurrent clients: 1, 2, 4, 8 streams of distinct ~1k-token prompts, 256 tokens each,
  # for mlxd single, mlxd batched and mlx_lm.server (bench/concurrency.py); ARMS picks a subset.
  install_engine
  [ -n "${BUILD_ONLY:-}" ] && exit 0
  $PY bench/concurrency.py --model "$MODEL" --arms "${ARMS:-single,batched,mlx_lm}" --clients "${CLIENTS:-1,2,4,8}" \
      --rounds "${ROUNDS:-3}" --max-tokens 256 --prompt-tokens "${PROMPT_TOKENS:-1000}" --startup-timeout 300 \
      --engine-log-level "${ENGINE_LOG_LEVEL:-info}" --keep-logs "$OUT/logs" \
      ${PREFILL_STEP:+--prefill-step-size "$PREFILL_STEP"} \
      --out "$OUT/concurrency_8b${PREFILL_STEP:+_step$PREFILL_STEP}.json" | tee "$OUT/concurrency_8b${PREFILL_STEP:+_step$PREFILL_STEP}.md"
  ;;
squeeze)
  # Issue 35: a prompt cache squeezed as beside a big model on a Mac (PROMPT_CACHE_GIB, 2), long prompts
  # (PROMPT_TOKENS, 4000), mlxd single and batched, for BUILDS: "old" (the mlxd wheel in .whl2/old/, an
  # earlier commit's) and "new" (this tree's): the stream's end after its last token, the gap between
  # queued requests, the device memory of the engine process (nvidia-smi) against its budget.
  install_engine
  [ -d /tmp/site-old/mlxd ] || pip_target /tmp/site-old .whl2/old/*.whl
  for build in ${BUILDS:-old new}; do
    path=$PYTHONPATH; [ "$build" = old ] && path=/tmp/site-old:$PYTHONPATH
    PYTHONPATH=$path $PY -c 'import mlxd.engine as e; print("mlxd", e.__file__)'
    PYTHONPATH=$path $PY bench/concurrency.py --model "$MODEL" --arms "${ARMS:-single,batched}" \
        --clients "${CLIENTS:-1,4,8}" --rounds "${ROUNDS:-2}" --warmup 1 --max-tokens "${MAX_TOKENS:-128}" \
        --prompt-tokens "${PROMPT_TOKENS:-4000}" --prompt-cache-gib "${PROMPT_CACHE_GIB:-2}" --startup-timeout 300 \
        --engine-log-level "${ENGINE_LOG_LEVEL:-info}" --keep-logs "$OUT/logs-$build" \
        --out "$OUT/squeeze_$build.json" | tee "$OUT/squeeze_$build.md"
  done
  ;;
agents)
  # Issue 35: four coding agents at once (bench/agents_load.py): 12k-token system prompts, +1.7k tokens a turn,
  # 6 turns, 128-token answers, max_concurrency 4, memory_gib 2, for BUILDS as in `squeeze`; SHARED=1: one
  # system prompt for all four (Claude-Code-shaped agents of one user). After the last build's engine run, the
  # same run does the floors (issue 51): mlx-lm alone in process on the same conversations, equal rows in a plain
  # batch, unequal rows through BatchKVCache, one row at a time (FLOORS picks, FLOORS=none skips).
  install_engine
  [ -d /tmp/site-old/mlxd ] || pip_target /tmp/site-old .whl2/old/*.whl
  cache_arg="--prompt-cache-gib ${PROMPT_CACHE_GIB:-2}"; [ "${PROMPT_CACHE_GIB:-}" = default ] && cache_arg=""
  builds=(${BUILDS:-old new}); floors=${FLOORS:-plain,batch,serial}; [ "$floors" = none ] && floors=""
  for build in "${builds[@]}"; do
    path=$PYTHONPATH; [ "$build" = old ] && path=/tmp/site-old:$PYTHONPATH
    floor_arg=""; [ "$build" = "${builds[-1]}" ] && [ -n "$floors" ] && floor_arg="--floors $floors"
    PYTHONPATH=$path $PY bench/agents_load.py --model "$MODEL" --agents "${AGENTS:-4}" \
        --system-tokens "${SYSTEM_TOKENS:-12000}" --turn-tokens "${TURN_TOKENS:-1700}" --turns "${TURNS:-6}" \
        --max-tokens 128 $cache_arg ${SHARED:+--shared-system} ${PREFILL_STEP:+--prefill-step-size "$PREFILL_STEP"} --engine-log-level "${ENGINE_LOG_LEVEL:-info}" $floor_arg \
        --keep-logs "$OUT/logs-agents-$build${SHARED:+-shared}" --out "$OUT/agents_$build${SHARED:+_shared}.json" \
        2> >(tee "$OUT/agents_$build${SHARED:+_shared}.progress" >&2) | tee "$OUT/agents_$build${SHARED:+_shared}.md"
    for log in "$OUT/logs-agents-$build${SHARED:+-shared}"/*.log; do  # where the engine's time went (a debug log's)
      [ -f "$log" ] && $PY bench/step_log.py "$log" | tee -a "$OUT/agents_$build${SHARED:+_shared}.md"
    done
  done
  ;;
faults)
  # Issue 36: agents through the whole stack (supervisord, listener, engine, gateway), a SIGABRT to the engine
  # every FAULT_EVERY_S s, against no fault (bench/fault_replay.py). ARMS=nofaults / ARMS=faults split the two
  # over calls. The gateway's wheels come in .whl3 (and .whl4 where they do not fit one folder).
  # Calls: `stage` (.whl1), `stage3` (.whl3), `BUILD_ONLY=1 engine` (.whl2), then this with .whl4.
  install_engine
  install_gateway
  arms=${ARMS:-nofaults,faults}
  $PY bench/fault_replay.py --model "$MODEL" --agents "${AGENTS:-4}" --system-tokens "${SYSTEM_TOKENS:-12000}" \
      --turn-tokens "${TURN_TOKENS:-1700}" --turns "${TURNS:-6}" --max-tokens "${MAX_TOKENS:-128}" \
      --fault-every-s "${FAULT_EVERY_S:-120}" --arms "$arms" ${DISK_GIB:+--disk-gib "$DISK_GIB"} --keep-logs "$OUT/logs-faults" --out "$OUT/fault_replay_${arms/,/_}.json" \
      2> >(tee "$OUT/fault_replay_${arms/,/_}.progress" >&2) | tee "$OUT/fault_replay_${arms/,/_}.md"
  ;;
prefill)
  # Issue 35, item 5 (a diagnosis): long prompts prefilled alone and batched, mlx-lm's BatchGenerator and
  # the engine's caches (bench/long_prefill_probe.py): a burst of 12k-token prompts, then turns over cached KV.
  install_engine
  for spec in ${PREFILL_SPECS:-12000:0:512 12000:0:2048 1700:14000:512 1700:14000:2048}; do
    IFS=: read -r new cached step <<< "$spec"
    $PY bench/long_prefill_probe.py "$MODEL" --rows "${ROWS:-4}" --prompt-tokens "$new" --cached "$cached" \
        --step "$step" --repeats "${REPEATS:-2}" 2>&1 | tee -a "$OUT/long_prefill_probe_8b.md"
  done
  ;;
admission)
  # Memory admission against an unbounded batch: 8 clients with long prompts
  # (LONG_TOKENS, ~60k), mlxd batched with its budget from the card's 80 GB,
  # and mlx_lm.server, whose batch takes every request at once.
  install_engine
  [ -n "${BUILD_ONLY:-}" ] && exit 0
  $PY bench/concurrency.py --model "$MODEL" --arms "${ARMS:-batched,mlx_lm}" --clients 8 --rounds 1 --warmup 0 \
      --max-tokens 32 --prompt-tokens "${LONG_TOKENS:-60000}" --max-prompt-tokens 131072 --memory-total-gib 80 \
      --startup-timeout 300 --request-timeout "${REQUEST_TIMEOUT:-300}" --keep-logs "$OUT/logs" --out "$OUT/admission_8b.json" | tee "$OUT/admission_8b.md"
  ;;
kv)
  # KV memory (issue 25): kv_bits 16/8/4 at 8k and 32k context, and a 4k-token generation's
  # memory into mlx-lm's growing cache and into one allocated at admission (bench/kv_memory.py).
  install_engine
  [ -n "${BUILD_ONLY:-}" ] && exit 0
  $PY bench/kv_memory.py --model-dir "$MODEL" --contexts "${CONTEXTS:-8192,32768}" --bits "${BITS:-16,8,4}" \
      --group-size "${GROUP_SIZE:-64}" --prefill-step "${PREFILL_STEP:-2048}" --generation "${GENERATION:-4096}" \
      --plot "$OUT/kv_memory_8b.svg" --json-out "$OUT/kv_memory_8b.json" | tee "$OUT/kv_memory_8b.md"
  ;;
profile)
  # Diagnosis, by hand: where a reused KV cache's time goes in mlx-lm alone
  # (bench/kv_reuse_profile.py), on the 8B model.
  install_engine
  $PY bench/kv_reuse_profile.py "$MODEL" --prompt-tokens "${SYSTEM_TOKENS:-12288}" --turns "${TURNS:-6}" \
      | tee "$OUT/kv_reuse_profile_8b.txt"
  ;;
*)
  echo "usage: $0 stage|engine|issue51|stall|gateway|cache|concurrency|squeeze|agents|prefill|admission|kv|profile|structured|grammar-probe|stage3|faults|recovery|load|stage-model|speculative" >&2
  exit 64
  ;;
esac
