set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
python3 -c "import specprobe.infer.engines.hf" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 110 python3 benchmarks/check_decode_graph.py 2>&1 | grep -v "Warning\|warn(" | tee $OUT/check.txt
for m in 7b 1.5b; do
  timeout 75 python3 benchmarks/bench_engine.py --device cuda --dtype bfloat16 --model random:qwen2-$m --tokens 48 --repeats 3 --batches 1 --greedy --decode fast --batch-cost 1,2,4,8 --syncs --no-unshared 2>&1 | grep -v "Warning\|warn(" | tee $OUT/engine_qwen2-$m.txt
done
