"""How many held-out questions of a run share a family (a reasoning-gym template) with its training or
validation questions: many for a run whose split was made by question id alone (before families were
recorded), none for a split made by family.

Usage: python benchmarks/split_families.py CONFIG.yaml REPORT_METRICS.json [OUT.json]

The split is recomputed from the config's probe settings, by question id and by family, and one of the two must
give the report's held-out questions; the families come from the config's source.
"""
import json
import sys

from specprobe.data_gen.pipeline import load_source_traces
from specprobe.train.config import load_config
from specprobe.train.pipeline import QuestionSplit


def main(config: str, report_metrics: str, out: str | None = None) -> dict:
    cfg = load_config(config)
    traces = load_source_traces(cfg.source)
    family = {t.id: t.split_group for t in traces}
    heldout = json.load(open(report_metrics))["heldout"]
    side = heldout["split"]
    splits = {"question id": QuestionSplit.make(sorted(family), cfg.probe),
              "family": QuestionSplit.make(sorted(family), cfg.probe, {t.id: t.family for t in traces if t.family})}
    made_by = next((by for by, split in splits.items() if split.questions(side) == sorted(heldout["questions"])), None)
    if made_by is None:
        raise SystemExit(f"neither recomputed {side} split is the report's held-out questions: wrong config?")
    split = splits[made_by]
    seen = {family[q] for s in ("train", "val") for q in split.questions(s)}
    held = split.questions(side)
    shared = [q for q in held if family[q] in seen]
    result = {"config": config, "report": report_metrics, "split": side, "split_made_by": made_by,
              "questions": len(family),
              "families": len(set(family.values())), "heldout_questions": len(held),
              "heldout_families": len({family[q] for q in held}),
              "heldout_sharing_a_family_with_train_or_val": len(shared),
              "heldout_families_unseen": len({family[q] for q in held} - seen),
              "heldout_questions_of_unseen_families": [q for q in held if family[q] not in seen]}
    text = json.dumps(result, indent=2) + "\n"
    if out:
        open(out, "w").write(text)
    print(text, end="")
    return result


if __name__ == "__main__":
    main(*sys.argv[1:4])
