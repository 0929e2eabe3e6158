#!/usr/bin/env bash
# The transformers engine and the decoding runtime on one CUDA GPU, with random-weight models of real shapes
# (a GPU box may reach no model hub; the numbers measure the system, not the models' quality).
#
#   SPECPROBE_RANDOM_TOKENIZER=<folder with tokenizer.json> bash benchmarks/gpu_bench.sh engine|runtime|runtime32 OUTDIR
#
# engine:    bench_engine.py on random:qwen2-1.5b, random:qwen2-7b and random:qwen2-32b (bf16), the fast and the eager
#            decode path on the same weights (DECODE overrides: fast,eager): greedy tokens/s at batch 1/8/20, with and
#            without the shared prefix encoded once, b(k) for k = 1,2,4,8 (median of 5) of whole steps (the rows'
#            join included) and of the decode forward alone, host syncs per decode iteration (1, 4, 8 rows), and
#            one teacher-forced scoring pass.
# runtime:   bench_runtime.py, target random:qwen2-7b, draft random:qwen2-1.5b, Bernoulli(0.6) verifier, γ=3.
# runtime32: the same with target random:qwen2-32b (the Lookahead Reasoning paper's 1.5B -> 32B pair).
# adaptive:  bench_adaptive_gamma.py (issue 24): gamma=adaptive against fixed γ 1..6 for lr_sync and semanticspec,
#            scenarios a/b/c, target random:qwen2-7b (TARGET=random:qwen2-32b for the 32B pair), draft
#            random:qwen2-1.5b (PROBLEMS, STEPS as above; SCENARIOS, ADAPTIVE_METHODS and GAMMAS narrow it;
#            SKIP=1 adds gamma=adaptive:forecast_skip=true to the same runs).
# open:      what issues 20 and 24 still need from a GPU, most needed first, each part under its own time limit so that
#            a device session (15 minutes, its start included) covers them in two calls:
#            1 check:      check_decode_graph.py on CHECK_MODEL (default random:qwen2-0.5b; the captured decode step
#                          and join chunks against the eager paths, in GRAPH's mode: cuda_graph unless compile); if
#                          it fails, the later parts run with the joins eager (models.capture_joins=false), said in
#                          check.txt;
#            2 adaptive32: issue 24 on the 1.5B -> 32B pair (the adaptive phase with TARGET=random:qwen2-32b,
#                          ADAPTIVE_METHODS=lr_sync, SCENARIOS=b, 5 problems x 8 steps, the draft compiled unless
#                          DRAFT_GRAPH says otherwise);
#            3 engine32:   (engine32.txt) the 32B's batch-1 rate (issue 20's 35 tok/s), q/k/v and gate/up merged off and on;
#            4 engine7:    (engine7.txt) the 7B's batch-1 rate and b(k) (k = 1,2,4,8), merged off/on x captured joins off/on;
#            5 runtime7:   the 1.5B -> 7B pair (8 problems x 16 steps, target,lr_sync,semanticspec,draft, the draft
#                          compiled) until its limit, summarised from its log (runtime_summary.md) finished or not.
#            LIMITS="check adaptive32 engine32 engine7 runtime7" (whole seconds; default "60 480 0 0 0", one call of
#            under 10 minutes with an outer `timeout 585`: the check and issue 24's run, whose loads, compilation,
#            calibration and warm-up took ~180 s and each problem ~55 s last time; the next call takes
#            LIMITS="0 0 80 120 0" or what the session has left). A part that
#            hits its limit is noted in its file and the next one runs; 0 skips a part. A check that fails (not one
#            cut by its limit, which is noted as unchecked) turns the captured joins off; a later call without the
#            check is told so by CAPTURE_JOINS=off. PROBLEMS and STEPS, when set, apply to both runs (adaptive32
#            and runtime7).
# lookahead: bench_lookahead.py (issue 23): Lookahead Decoding in the engine's batches (n = 8 rows) against plain
#            decoding, random:qwen2-1.5b and random:qwen2-7b, W=5 N=4 and W=15 N=5 (random weights repeat tokens:
#            read the iteration cost, not the acceptance; DECODE=eager for the eager path's batches).
# MODELS overrides the engine and lookahead phases' models (space-separated); PROBLEMS / STEPS override the runtime phases' problem count and steps per problem; GAMMA (default 3) the
# drafted steps per cycle; RUNTIME_S (whole seconds above 0; unset: no limit) stops the runtime phases' run after
# that many seconds (noted in its log, which is then summarised into runtime_7b_summary.md / runtime_32b_summary.md,
# finished or not; a run that fails otherwise is summarised too, and fails the phase); METHODS (default target,lr_sync,lr_async,semanticspec,draft) the methods;
# DECODE (default auto = the fast path on CUDA) the transformers decode path (fast | eager), so the same
# command measures the eager path for the 'today' column; GRAPH (default auto = cuda_graph on CUDA) how the fast
# path runs its decode step (cuda_graph | compile | none); DRAFT_GRAPH the draft's alone in the runtime,
# adaptive and open phases' runtime runs (compile: fused kernels, a cheaper draft step).
# TARGET_PRIORITY (normal | high; default normal) the target engine's CUDA stream priority in the runtime, adaptive
# and open phases' runtime runs (models.target_stream_priority: with high, the target's kernels start before
# lr_async's draft's; whether async then gains on one GPU is what a run with and without it shows).
# FUSED_NORM (auto | off | on | off,on; default auto = the engine's default, fused on CUDA) runs the models' RMSNorm
# layers as one fused kernel each or not (models.fused_norm): off,on makes each engine part measure its decode path
# both ways, one after the other on the same weights (the A/B of one process; in the open phase that doubles its
# engine parts' work under the same LIMITS); the runtime, adaptive and open phases' runtime runs fuse unless it is off.
# MERGED_LINEAR (same words; default auto = merged on CUDA) runs the q/k/v and gate/up projections as one product each
# or not (models.merged_linear); off,on in the engine parts as FUSED_NORM's (both off,on: all four combinations).
# CAPTURE_JOINS (on | off | off,on; default on) captures the forwards of rows joining a batch with a captured decode
# step or runs them eagerly (models.capture_joins); off,on in the engine parts as above, off for the runtime runs too.
# SEED (default 0) the runtime and adaptive runs' seed (runtime.seed): sampling and the Bernoulli verifier's draws
# are keyed by it and the prefix text, so on a few problems one seed is one draw of the acceptances (on the CPU, 16
# problems gave lr_sync an acceptance of 0.68 at seed 0 and 0.58, 0.60 at seeds 1, 2, for a Bernoulli 0.6).
# Problems: a jsonl file of questions (QUESTIONS, default .gpu/questions.jsonl); their text only sets the prompt.
# Each runtime and adaptive run's folder is also packed into <folder>.tgz beside it: the GPU device returns only a
# few files per folder (results.json and the traces stayed behind once), and one archive comes back whole.
# SMOKE=1 runs every phase's commands on the CPU with tiny random models and tiny sizes (tests/test_gpu_bench.py),
# so a GPU session never finds a broken command.
set -euo pipefail
phase=$1
out=${2:-benchmarks/results/gpu}
questions=${QUESTIONS:-.gpu/questions.jsonl}
device=cuda dtype=bfloat16 draft=random:qwen2-1.5b target=random:qwen2-7b target32=random:qwen2-32b
engine_models=${MODELS:-random:qwen2-1.5b random:qwen2-7b random:qwen2-32b}
lookahead_models=${MODELS:-random:qwen2-1.5b random:qwen2-7b}
tokens=48 repeats=3 batches=1,8,20 ks=1,2,4,8 step_tokens=32 windows="5,4 15,5" rows=8 problems=${PROBLEMS:-} steps=${STEPS:-}
gammas=1,2,3,4,5,6 scenarios=a,b,c
if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu dtype=float32 draft=random:llama-tiny target=random:llama-tiny target32=random:llama-tiny
  engine_models=random:llama-tiny lookahead_models=random:llama-tiny
  tokens=6 repeats=1 batches=1,2 ks=1,2 step_tokens=6 windows="3,3" rows=2 problems=${PROBLEMS:-2} steps=${STEPS:-2}
  gammas=1,2 scenarios=b
fi
if [ -n "${RUNTIME_S:-}" ] && ! [[ $RUNTIME_S =~ ^[1-9][0-9]*$ ]]; then
  echo "RUNTIME_S takes a whole number of seconds above 0 (unset it for no limit), got '$RUNTIME_S'" >&2; exit 2
fi
case ${FUSED_NORM:-auto} in
  auto) swaps=() ;; off) swaps=(models.fused_norm=false) ;; on|off,on) swaps=(models.fused_norm=true) ;;
  *) echo "FUSED_NORM takes auto, off, on or off,on, got '$FUSED_NORM'" >&2; exit 2 ;;
esac
case ${MERGED_LINEAR:-auto} in
  auto) ;; off) swaps+=(models.merged_linear=false) ;; on|off,on) swaps+=(models.merged_linear=true) ;;
  *) echo "MERGED_LINEAR takes auto, off, on or off,on, got '$MERGED_LINEAR'" >&2; exit 2 ;;
esac
case ${CAPTURE_JOINS:-on} in
  on|off,on) ;; off) swaps+=(models.capture_joins=false) ;;
  *) echo "CAPTURE_JOINS takes on, off or off,on, got '$CAPTURE_JOINS'" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
else
  echo "no nvidia-smi on this machine (device $device)" | tee "$out/gpu.txt"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
# bench_engine.py's flags every engine measurement shares: greedy rows of `tokens` tokens, `repeats` timings
engine_bench=(python3 benchmarks/bench_engine.py --device "$device" --dtype "$dtype" --tokens "$tokens"
              --repeats "$repeats" --greedy --fused-norm "${FUSED_NORM:-auto}" --merged-linear "${MERGED_LINEAR:-auto}"
              --capture-joins "${CAPTURE_JOINS:-on}")
stopped() {  # exit status, seconds, file: a part that did not finish says so in its file
  echo "## stopped: exit $1 (124 = its $2 s limit)" | tee -a "$3"
}
pack() {  # folder under $out: also as one archive beside it (the GPU device returns a few files per folder, and an
  # archive whole); a failure is said and does not stop the phase (the folder itself is still there)
  [ -d "$out/$1" ] || return 0
  tar czf "$out/$1.tgz" -C "$out" "$1" || echo "could not pack $out/$1 into $1.tgz" >&2
}
runtime() {  # target, problems, max steps, label, summary file: bench_runtime.py, stopped after RUNTIME_S seconds
  # when set (its log noted, and summarised into the summary file whether or not it finished)
  local rc=0
  ${RUNTIME_S:+timeout -k 15 "$RUNTIME_S"} python3 benchmarks/bench_runtime.py --device "$device" --dtype "$dtype" --target "$1" --draft "$draft" \
    --alpha 0.6 --gamma "${GAMMA:-3}" --problems "$2" --max-steps "$3" --step-tokens "$step_tokens" \
    --decode "${DECODE:-auto}" --methods "${METHODS:-target,lr_sync,lr_async,semanticspec,draft}" --out "$out/$4" \
    --set bench.source.kind=jsonl "bench.source.path=$questions" "models.decode_graph=${GRAPH:-auto}" \
    "runtime.seed=${SEED:-0}" ${DRAFT_GRAPH:+"models.draft_decode_graph=$DRAFT_GRAPH"} \
    ${TARGET_PRIORITY:+"models.target_stream_priority=$TARGET_PRIORITY"} ${swaps[@]+"${swaps[@]}"} 2>&1 \
    | tee "$out/$4.txt" || rc=$?  # pipefail: the benchmark's status
  pack "$4"
  [ -z "${RUNTIME_S:-}" ] && return "$rc"
  [ "$rc" = 0 ] || stopped "$rc" "$RUNTIME_S" "$out/$4.txt"
  python3 benchmarks/runtime_log_summary.py "$out/$4.txt" | tee "$out/$5"
  case $rc in 0|124|137) ;; *) return "$rc" ;; esac  # stopped at its limit: summarised; crashed: the phase fails
}
adaptive_cmd() {  # target, methods, scenarios, problems, steps: `cmd` := bench_adaptive_gamma.py into
  # $out/adaptive_gamma (an array, so that `timeout` can run it)
  local skip=()
  [ "${SKIP:-0}" = 1 ] && skip=(--forecast-skip)
  cmd=(python3 benchmarks/bench_adaptive_gamma.py --device "$device" --dtype "$dtype" --target "$1" --draft "$draft"
       --problems "$4" --steps "$5" --step-tokens "$step_tokens" --gammas "${GAMMAS:-$gammas}" --scenarios "$3"
       --methods "$2" ${skip[@]+"${skip[@]}"} --out "$out/adaptive_gamma" "models.decode_graph=${GRAPH:-auto}"
       ${DRAFT_GRAPH:+"models.draft_decode_graph=$DRAFT_GRAPH"}
       ${TARGET_PRIORITY:+"models.target_stream_priority=$TARGET_PRIORITY"} ${swaps[@]+"${swaps[@]}"}
       "runtime.seed=${SEED:-0}" bench.source.kind=jsonl "bench.source.path=$questions")
}
case $phase in
  engine)
    for m in $engine_models; do
      "${engine_bench[@]}" --model "$m" --batches "$batches" --decode "${DECODE:-fast,eager}" \
        --graph "${GRAPH:-auto}" --batch-cost "$ks" --syncs 2>&1 | tee "$out/engine_${m#random:}.txt"
    done ;;
  runtime) runtime "$target" "${problems:-8}" "${steps:-16}" runtime_7b runtime_7b_summary.md ;;
  runtime32) runtime "$target32" "${problems:-6}" "${steps:-12}" runtime_32b runtime_32b_summary.md ;;
  adaptive)
    rc=0
    adaptive_cmd "${TARGET:-$target}" "${ADAPTIVE_METHODS:-lr_sync,semanticspec}" "${SCENARIOS:-$scenarios}" \
      "${problems:-8}" "${steps:-16}"
    "${cmd[@]}" 2>&1 | tee "$out/adaptive.txt" || rc=$?
    pack adaptive_gamma
    exit "$rc" ;;
  open)
    limits=(${LIMITS:-60 480 0 0 0})
    [ ${#limits[@]} = 5 ] || { echo "LIMITS takes five whole numbers of seconds (check adaptive32 engine32 engine7 runtime7), got '${LIMITS:-}'" >&2; exit 2; }
    for s in "${limits[@]}"; do
      [[ $s =~ ^[0-9]+$ ]] || { echo "LIMITS: '$s' is not a whole number of seconds" >&2; exit 2; }
    done
    check_graph=${GRAPH:-cuda_graph}
    [ "$check_graph" = auto ] && check_graph=cuda_graph
    small=$target big=$target32 check_model=${CHECK_MODEL:-random:qwen2-0.5b} check=(--device cuda --graph "$check_graph")
    draft_compile=compile
    # the CPU captures nothing and compiles slowly
    [ "${SMOKE:-0}" = 1 ] && check_model=${CHECK_MODEL:-$draft} check=(--device cpu --graph none) draft_compile=none
    part_rc=0
    limited() {  # seconds (0: skip), output file, command...: a part that hits its limit is noted, the phase goes on
      local s=$1 file=$2
      shift 2
      part_rc=0
      [ "$s" -eq 0 ] && return 0
      timeout -k 15 "$s" "$@" 2>&1 | tee "$file" || part_rc=$?  # pipefail: the command's status
      [ "$part_rc" = 0 ] || stopped "$part_rc" "$s" "$file"
    }
    limited "${limits[0]}" "$out/check.txt" python3 benchmarks/check_decode_graph.py "${check[@]}" --model "$check_model"
    joins_ab=${CAPTURE_JOINS:-off,on}  # engine7's captured joins
    case $part_rc in
      0) ;;
      124|137) echo "## the check did not finish: the captured joins below are unchecked" | tee -a "$out/check.txt" ;;
      *) joins_ab=off swaps+=(models.capture_joins=false) engine_bench+=(--capture-joins off)
         echo "## the check did not pass: the parts below run the joins eagerly (models.capture_joins=false)" \
           | tee -a "$out/check.txt" ;;
    esac
    DRAFT_GRAPH=${DRAFT_GRAPH-$draft_compile} adaptive_cmd "$target32" lr_sync b "${problems:-5}" "${steps:-8}"
    limited "${limits[1]}" "$out/adaptive.txt" "${cmd[@]}"
    [ "${limits[1]}" -eq 0 ] || pack adaptive_gamma
    limited "${limits[2]}" "$out/engine32.txt" "${engine_bench[@]}" --model "$big" --batches 1 \
      --decode fast --graph "${GRAPH:-auto}" --merged-linear "${MERGED_LINEAR:-off,on}" --no-unshared
    limited "${limits[3]}" "$out/engine7.txt" "${engine_bench[@]}" --model "$small" --batches 1 \
      --decode fast --graph "${GRAPH:-auto}" --merged-linear "${MERGED_LINEAR:-off,on}" \
      --capture-joins "$joins_ab" --batch-cost "$ks" --no-unshared
    [ "${limits[4]}" -eq 0 ] || DRAFT_GRAPH=${DRAFT_GRAPH-$draft_compile} METHODS=${METHODS:-target,lr_sync,semanticspec,draft} \
      RUNTIME_S=${limits[4]} runtime "$target" "${problems:-8}" "${steps:-16}" runtime_7b runtime_summary.md ;;
  lookahead)
    for m in $lookahead_models; do
      for wn in $windows; do
        w=${wn%,*} n=${wn#*,}
        python3 benchmarks/bench_lookahead.py --device "$device" --dtype "$dtype" --model "$m" --window "$w" \
          --ngram "$n" --n "$rows" --tokens "$tokens" --decode "${DECODE:-auto}" --graph "${GRAPH:-auto}" 2>&1 \
          | tee "$out/lookahead_${m#random:}_w${w}_n${n}_${DECODE:-auto}.txt"
      done
    done ;;
  *) echo "unknown phase $phase (engine | runtime | runtime32 | adaptive | open | lookahead)" >&2; exit 2 ;;
esac
