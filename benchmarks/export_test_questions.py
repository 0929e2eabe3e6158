"""Write a checkpoint's TEST questions (question, gold answer, id) as jsonl for probe-bench (bench.source kind jsonl).

Usage: python benchmarks/export_test_questions.py CHECKPOINT DATA_FOLDER OUT.jsonl
"""
import json
import sys

from specprobe.data_gen.store import open_dataset

ckpt, data, out = sys.argv[1:4]
split = json.load(open(f"{ckpt}/metrics.json"))["split"]
test = set(split["test"])
ds = open_dataset(data)
ctx = ds.contexts
seen = set()
with open(out, "w") as fh:
    for qid, question, answer in zip(ctx.column("question_id").to_pylist(), ctx.column("question").to_pylist(),
                                     ctx.column("answer").to_pylist()):
        if qid in test and qid not in seen:
            seen.add(qid)
            fh.write(json.dumps({"id": qid, "question": question, "answer": answer}) + "\n")
print(f"{len(seen)} test questions -> {out}")
