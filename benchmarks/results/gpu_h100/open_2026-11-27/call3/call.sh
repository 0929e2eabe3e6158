# device call 3 (timeout_s 245, carry [".gpu"]), 2026-11-28 00:03:40-00:04:48 UTC, the same warm machine; 68.4 s; code d563bb7
# (call 2, the same command without carry, found no .gpu/tok and stopped in 23 s: nothing measured)
export PYTHONPATH=/tmp/pkg SPECPROBE_RANDOM_TOKENIZER=.gpu/tok PYTHONUNBUFFERED=1; date -u; MERGED_LINEAR=off CAPTURE_JOINS=off,on LIMITS="0 0 0 200 0" timeout -k 5 225 bash benchmarks/gpu_bench.sh open /tmp/o3 2>&1 | grep -v "Warning\|warn(" > $OUT/open_log2.txt; cp /tmp/o3/*.txt $OUT/; date -u; tail -c 7000 $OUT/open_log2.txt
