set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
DECODE=fast GAMMA=3 PROBLEMS=8 STEPS=16 timeout 330 bash benchmarks/gpu_bench.sh runtime $OUT/fast 2>&1 | grep -v "Warning\|warn(" | tail -40
timeout 230 python3 benchmarks/bench_engine.py --device cuda --dtype bfloat16 --model random:qwen2-32b --tokens 48 --repeats 3 --batches 1,8,20 --greedy --decode fast,eager --batch-cost 1,2,4,8 --syncs --no-unshared 2>&1 | grep -v "Warning\|warn(" | tee $OUT/engine_qwen2-32b.txt
