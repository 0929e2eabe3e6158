"""How many held-out questions of a run share a family (a reasoning-gym template) with its training or
validation questions, for a run whose split was made by question id alone (before families were recorded).

Usage: python benchmarks/split_families.py CONFIG.yaml REPORT_METRICS.json [OUT.json]

The split is recomputed by question id from the config's probe settings (as probe-train made it then) and must
give the report's held-out questions; the families come from the config's source.
"""
import json
import sys

from specprobe.data_gen.pipeline import load_source_traces
from specprobe.train.config import load_config
from specprobe.train.pipeline import QuestionSplit


def main(config: str, report_metrics: str, out: str | None = None) -> dict:
    cfg = load_config(config)
    family = {t.id: t.split_group for t in load_source_traces(cfg.source)}
    heldout = json.load(open(report_metrics))["heldout"]
    split = QuestionSplit.make(sorted(family), cfg.probe)  # by question id, as the run split
    side = heldout["split"]
    if split.questions(side) != sorted(heldout["questions"]):
        raise SystemExit(f"the recomputed {side} split is not the report's held-out questions: wrong config?")
    seen = {family[q] for s in ("train", "val") for q in split.questions(s)}
    held = split.questions(side)
    shared = [q for q in held if family[q] in seen]
    result = {"config": config, "report": report_metrics, "split": side, "questions": len(family),
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
