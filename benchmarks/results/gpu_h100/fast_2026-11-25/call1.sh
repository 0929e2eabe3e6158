set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
python3 -c "import specprobe.infer.engines.hf" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
timeout 120 python3 benchmarks/check_decode_graph.py 2>&1 | tee $OUT/check.txt | grep -v Warning
MODELS="random:qwen2-1.5b random:qwen2-7b" timeout 420 bash benchmarks/gpu_bench.sh engine $OUT/engine 2>&1 | grep -v "Warning\|warn("
