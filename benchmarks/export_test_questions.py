"""Write a checkpoint's TEST questions (question, gold answer, id, and the family (template) where the data records
one) as jsonl for probe-bench (bench.source kind jsonl; its intervals draw whole families). probe-train writes the
same file as <output_dir>/test_questions.jsonl when it trains; this script writes it for an existing checkpoint.

Usage: python benchmarks/export_test_questions.py CHECKPOINT DATA_FOLDER OUT.jsonl
"""
import json
import sys

from specprobe.data_gen.store import open_dataset
from specprobe.train.pipeline import write_questions

ckpt, data, out = sys.argv[1:4]
test = json.load(open(f"{ckpt}/metrics.json"))["split"]["test"]
print(f"{write_questions(open_dataset(data), test, out)} test questions -> {out}")
