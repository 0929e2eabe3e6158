"""Reads verifier_calls.csv (every Bernoulli draw of the 40-problem lr_sync run, in call order) and prints the
acceptance on the accepted walk (each cycle's positions up to and including its first rejection), off it, on
problems 1-16 and 17-40, and how many walk draws reuse a seed drawn before or repeat one on the walk."""
import collections
import csv
import math
from pathlib import Path

rows = list(csv.DictReader(open(Path(__file__).with_name("verifier_calls.csv"))))
rows = [r for r in rows if not r["question"].startswith("Warm")]  # the throwaway warm-up problem
problem = -1
for r in rows:  # a problem's first draw is the only one with no steps before it (its first cycle's root)
    problem += r["context_steps"] == "0"
    r["problem"] = problem
cycles, cur = [], []
for r in rows:
    if r["position"] == "0" and cur:
        cycles.append(cur)
        cur = []
    cur.append(r)
cycles.append(cur)
walk, off = [], []
for c in cycles:
    rejected = False
    for r in c:
        (off if rejected else walk).append(r)
        rejected = rejected or r["accepted"] == "0"
first = {}
for r in rows:
    first.setdefault(r["seed"], r["call"])


def rate(rs):
    n, a = len(rs), sum(r["accepted"] == "1" for r in rs)
    return f"{a}/{n} = {a / n:.3f} (z {(a / n - 0.6) / math.sqrt(0.24 / n):+.2f})"


print("problems", problem + 1, "| walk", rate(walk), "| off the walk", rate(off))
print("walk, problems 1-16", rate([r for r in walk if r["problem"] < 16]),
      "| problems 17-40", rate([r for r in walk if r["problem"] >= 16]))
print("walk draws whose seed was drawn before, off the walk", rate([r for r in walk if first[r["seed"]] != r["call"]]))
print("seeds used twice on the walk", sum(n > 1 for n in collections.Counter(r["seed"] for r in walk).values()))
