set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
DECODE=fast GAMMA=3 PROBLEMS=8 STEPS=16 timeout 200 bash benchmarks/gpu_bench.sh runtime $OUT/fast 2>&1 | grep -v "Warning\|warn(" | grep -v "^  \[" | tail -25
timeout 170 python3 benchmarks/bench_adaptive_gamma.py --device cuda --dtype bfloat16 --target random:qwen2-7b --draft random:qwen2-1.5b --problems 4 --steps 8 --step-tokens 32 --gammas 1,2,3,4,5,6 --scenarios b --methods lr_sync --out $OUT/adaptive_gamma bench.source.kind=jsonl bench.source.path=.gpu/questions.jsonl 2>&1 | grep -v "Warning\|warn(" | tee $OUT/adaptive.txt | tail -25
