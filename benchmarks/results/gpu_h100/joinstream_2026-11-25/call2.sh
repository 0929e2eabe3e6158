set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
DECODE=fast GAMMA=3 PROBLEMS=5 STEPS=12 timeout 400 bash benchmarks/gpu_bench.sh runtime32 $OUT/fast 2>&1 | grep -v "Warning\|warn(" | grep -v "^  \[" | tail -60
