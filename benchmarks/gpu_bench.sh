#!/usr/bin/env bash
# The transformers engine and the decoding runtime on one CUDA GPU, with random-weight models of real shapes
# (a GPU box may reach no model hub; the numbers measure the system, not the models' quality).
#
#   SPECPROBE_RANDOM_TOKENIZER=<folder with tokenizer.json> bash benchmarks/gpu_bench.sh engine|runtime|runtime32 OUTDIR
#
# engine:    bench_engine.py on random:qwen2-1.5b and random:qwen2-7b (bf16): step-sampling tokens/s at batch
#            1/8/20, with and without the shared prefix encoded once, and one teacher-forced scoring pass.
# runtime:   bench_runtime.py, target random:qwen2-7b, draft random:qwen2-1.5b, Bernoulli(0.6) verifier, γ=3.
# runtime32: the same with target random:qwen2-32b (the Lookahead Reasoning paper's 1.5B -> 32B pair).
# adaptive:  bench_adaptive_gamma.py (issue 24): gamma=adaptive against fixed γ 1..6 for lr_sync and semanticspec,
#            scenarios a/b/c, target random:qwen2-7b, draft random:qwen2-1.5b (PROBLEMS, STEPS as above).
# lookahead: bench_lookahead.py (issue 23): Lookahead Decoding in the engine's batches (n = 8 rows) against plain
#            decoding, random:qwen2-1.5b and random:qwen2-7b, W=5 N=4 and W=15 N=5 (random weights repeat tokens:
#            read the iteration cost, not the acceptance; DECODE=eager for the eager path's batches).
# PROBLEMS / STEPS override the runtime phases' problem count and steps per problem; GAMMA (default 3) the
# drafted steps per cycle; METHODS (default target,lr_sync,lr_async,semanticspec,draft) the methods;
# DECODE (default auto = the fast path on CUDA) the transformers decode path (fast | eager), so the same
# command measures the eager path for the 'today' column.
# Problems: a jsonl file of questions (QUESTIONS, default .gpu/questions.jsonl); their text only sets the prompt.
set -euo pipefail
phase=$1
out=${2:-benchmarks/results/gpu}
questions=${QUESTIONS:-.gpu/questions.jsonl}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
runtime() {  # target, problems, max steps, label
  python3 benchmarks/bench_runtime.py --device cuda --dtype bfloat16 --target "$1" --draft random:qwen2-1.5b \
    --alpha 0.6 --gamma "${GAMMA:-3}" --problems "$2" --max-steps "$3" --step-tokens 32 --decode "${DECODE:-auto}" \
    --methods "${METHODS:-target,lr_sync,lr_async,semanticspec,draft}" --out "$out/$4" \
    --set bench.source.kind=jsonl "bench.source.path=$questions" 2>&1 | tee "$out/$4.txt"
}
case $phase in
  engine)
    for m in random:qwen2-1.5b random:qwen2-7b random:qwen2-32b; do
      python3 benchmarks/bench_engine.py --device cuda --model "$m" --tokens 48 --repeats 3 --greedy \
        --decode "${DECODE:-auto}" 2>&1 | tee "$out/engine_${m#random:}.txt"
    done ;;
  runtime) runtime random:qwen2-7b "${PROBLEMS:-8}" "${STEPS:-16}" runtime_7b ;;
  runtime32) runtime random:qwen2-32b "${PROBLEMS:-6}" "${STEPS:-12}" runtime_32b ;;
  adaptive)
    python3 benchmarks/bench_adaptive_gamma.py --device cuda --dtype bfloat16 --target random:qwen2-7b \
      --draft random:qwen2-1.5b --problems "${PROBLEMS:-8}" --steps "${STEPS:-16}" --step-tokens 32 \
      --out "$out/adaptive_gamma" bench.source.kind=jsonl "bench.source.path=$questions" 2>&1 | tee "$out/adaptive.txt" ;;
  lookahead)
    for m in random:qwen2-1.5b random:qwen2-7b; do
      for wn in "5 4" "15 5"; do
        set -- $wn
        python3 benchmarks/bench_lookahead.py --device cuda --model "$m" --window "$1" --ngram "$2" \
          --decode "${DECODE:-auto}" 2>&1 | tee "$out/lookahead_${m#random:}_w$1_n$2_${DECODE:-auto}.txt"
      done
    done ;;
  *) echo "unknown phase $phase (engine | runtime | runtime32 | adaptive | lookahead)" >&2; exit 2 ;;
esac
