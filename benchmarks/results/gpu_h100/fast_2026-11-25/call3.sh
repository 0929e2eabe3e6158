set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
DECODE=fast GAMMA=3 PROBLEMS=6 STEPS=12 timeout 410 bash benchmarks/gpu_bench.sh runtime32 $OUT/fast 2>&1 | grep -v "Warning\|warn(" | grep -v "^  \[" | tail -60
timeout 110 python3 benchmarks/bench_engine.py --device cuda --dtype bfloat16 --model random:qwen2-1.5b --tokens 48 --repeats 3 --batches 1 --greedy --decode fast --graph compile --no-unshared 2>&1 | grep -v "Warning\|warn(" | tee $OUT/engine_qwen2-1.5b_compile.txt | tail -15
