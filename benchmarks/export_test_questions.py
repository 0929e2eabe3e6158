"""Write a checkpoint's TEST questions (question, gold answer, id, and the family (template) where the data records
one) as jsonl for probe-bench (bench.source kind jsonl; its intervals draw whole families).

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
families = ds.question_families()  # a question without a family is its own
seen = set()
with open(out, "w") as fh:
    for qid, question, answer in zip(ctx.column("question_id").to_pylist(), ctx.column("question").to_pylist(),
                                     ctx.column("answer").to_pylist()):
        if qid in test and qid not in seen:
            seen.add(qid)
            family = {"family": families[qid]} if families.get(qid, qid) != qid else {}
            fh.write(json.dumps({"id": qid, "question": question, "answer": answer, **family}) + "\n")
print(f"{len(seen)} test questions -> {out}")
