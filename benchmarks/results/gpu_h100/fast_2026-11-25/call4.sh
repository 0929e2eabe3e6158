set -o pipefail
export PYTHONUNBUFFERED=1 SPECPROBE_RANDOM_TOKENIZER=.gpu/tok
mkdir -p /tmp/pkg/specprobe && for d in inputs probes data_gen train infer; do ln -sfn $PWD/$d /tmp/pkg/specprobe/$d; done
export PYTHONPATH=/tmp/pkg
timeout 75 python3 benchmarks/profile_decode.py --model random:qwen2-7b 2>&1 | grep -v "Warning\|warn(\|USDT" | tee $OUT/profile_qwen2-7b.txt
timeout 60 python3 benchmarks/profile_decode.py --model random:qwen2-1.5b 2>&1 | grep -v "Warning\|warn(\|USDT" | tee $OUT/profile_qwen2-1.5b.txt
