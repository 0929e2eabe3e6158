"""Markdown for probe-eval: the report of one checkpoint and the side-by-side comparison of two.

Everything is rendered from the metrics dict (what metrics.json holds) and the list of figures, so a
report can be re-rendered from its metrics.json alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specprobe.train.report import evaluate as ev
from specprobe.train.report.evaluate import CALIBRATION_METRICS

METRIC_LABELS = {"ece_uniform": "ECE (equal-width)", "ece_quantile": "ECE (equal-mass)", "mce": "MCE",
                 "brier": "Brier", "log_loss": "log-loss", "mae": "MAE", "spearman": "Spearman", "auroc": "AUROC", "auprc": "AUPRC"}
ACCEPTANCE_METRICS = ("mean_predicted", "mean_empirical", "mae", "rmse", "bias", "spearman", "ece_uniform")


def num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def ci(entry: dict[str, Any] | None) -> str:
    """'est [low, high]' from a bootstrap entry; 'est (no interval)' when the set is too small for one."""
    if not entry or entry.get("estimate") is None:
        return "–"
    if entry.get("withheld"):
        return f"{num(entry['estimate'])} (no CI)"
    if entry.get("low") is None:
        return num(entry["estimate"])
    wilson = f"; Wilson over {entry['wilson_units']}" if entry.get("wilson_units") else ""
    return f"{num(entry['estimate'])} [{num(entry['low'])}, {num(entry['high'])}{wilson}]"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def figure_links(figures: Sequence[dict[str, Any]], section: str) -> str:
    return "\n\n".join(f"![{f['title']}]({f['file']})\n\n*{f['title']}* (`{f['file']}`)"
                       for f in figures if f["section"] == section)


# ----------------------------------------------------------------------------- sections
def size_warning(m: dict[str, Any]) -> str | None:
    """'too small' when any block of the report withheld its intervals (fewer than 20 held-out questions or
    10 positives), naming the reasons."""
    reasons = sorted({part for r in _too_small(m.get("parts", {})) if r for part in r.split("; ")})
    return ("; ".join(reasons)) if reasons else None


def _too_small(tree: Any):
    if isinstance(tree, dict):
        if tree.get("too_small"):
            yield tree["too_small"]
        for value in tree.values():
            yield from _too_small(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _too_small(value)


def header(m: dict[str, Any]) -> str:
    s = m.get("settings", {})
    held = m.get("heldout") or {}
    lines = [f"# probe-eval report: `{m.get('checkpoint', {}).get('name')}`", ""]
    if held.get("warning"):
        lines += [f"> **WARNING: {held['warning']}**", ""]
    small = size_warning(m)
    if small:
        lines += [f"> **THE HELD-OUT SET IS TOO SMALL for intervals to mean anything ({small}); they are withheld "
                  "and point estimates are shown without them. Do not read differences between predictors "
                  "from this report.**", ""]
    lines += [f"- checkpoint: `{m.get('checkpoint', {}).get('path')}`",
              f"- data: `{(m.get('data') or {}).get('folder')}` "
              f"({'the training data' if (m.get('data') or {}).get('is_training_data') else 'another data folder'})",
              f"- held out: {held.get('n_questions', '–')} questions — {held.get('how', 'none')}",
              f"- confidence intervals: {int(100 * (1 - s.get('alpha', 0.1)))}% percentile bootstrap, "
              f"{s.get('n_boot')} resamples of {_resampled_unit(s, held)}, withheld below {ev.MIN_QUESTIONS} "
              f"questions{_family_guard(s)} or {ev.MIN_POSITIVES} positives (AUROC, AUPRC: also below {ev.MIN_CLASS_QUESTIONS} "
              f"{'families' if s.get('resample') == 'family' else 'questions'} holding each class; any metric: when under {ev.MIN_VALID_SHARE:.0%} of the resamples define it); "
              f"calibration bins: {s.get('n_bins')} (equal-width: left-closed at exact k/n edges; equal-mass: by "
              "rank, tied predictions in one bin); 'majority meaning' = label ≥ 0.5 (AUROC, AUPRC). Percentile intervals of ECE/MCE "
              "can sit above the estimate: binned errors are biased upward on resamples with repeated rows",
              f"- written {m.get('created')}"]
    for model, st in ((m.get("data") or {}).get("steps") or {}).items():
        lines.append(f"- {model} steps in the data: {st['steps']}, {st['capped_share']:.1%} cut by the token cap, "
                     f"{st['eos_share']:.1%} ended by EOS, {st['mean_tokens']:.1f} tokens on average; no other sample "
                     f"agreed with {st['own_prob_zero_share']:.0%} of them (own_prob 0)")
    return "\n".join(lines)


SETTINGS_BEFORE = {"resample": "question"}  # what a report made before a setting existed did


def resample_unit(settings: dict[str, Any]) -> str:
    """What a report's bootstrap resampled whole: "family" or "question"."""
    return settings.get("resample", SETTINGS_BEFORE["resample"])


def _resampled_unit(settings: dict[str, Any], held: dict[str, Any]) -> str:
    if resample_unit(settings) == "question":
        return "whole questions" + (f" ({held['resample_note']})" if held.get("resample_note") else "")
    n = held.get("n_families")
    return ("whole question families (templates; a question without one is its own"
            + (f": {n} families among the held-out questions)" if n is not None else ")"))


def _family_guard(settings: dict[str, Any]) -> str:
    return "" if resample_unit(settings) == "question" else f", {ev.MIN_FAMILIES} families"


def skipped_section(m: dict[str, Any]) -> str:
    skipped = m.get("skipped") or []
    if not skipped:
        return "## Skipped parts\n\nNone: every part was evaluated."
    return "## Skipped parts\n\n" + table(["part", "why"], [(f"`{s['part']}`", s["reason"].replace("\n", " "))
                                                             for s in skipped])


PRECISION_WORDS = {"better": "is more precise than", "worse": "is LESS precise than",
                   "no clear difference": "is NOT clearly more precise than",
                   "too small to tell": "cannot be compared (set too small) with"}
VERDICT_WORDS = {"better": "beats", "worse": "is WORSE than", "no clear difference": "does NOT clearly beat",
                 "too small to tell": "cannot be compared (set too small) with"}


def verdict_lines(name: str, set_name: str, versus: dict[str, Any]) -> list[str]:
    """One sentence per baseline: does the probe beat it on Brier (paired interval of the difference)?"""
    lines = []
    for other, v in versus.items():
        delta, skill = v["brier_delta"], v["brier_skill"]
        lines.append(f"- `{name}` {VERDICT_WORDS.get(v['verdict'], v['verdict'])} **{other}** on `{set_name}`: "
                     f"Brier difference (probe − {other}) {ci(delta)}, Brier skill vs {other} {ci(skill)}.")
    return lines


def summary_lines(versus: dict[str, Any]) -> list[str]:
    """Per probe and row set: which baselines it beats and which it does not."""
    lines = []
    for name, per_set in versus.items():
        for set_name, against in per_set.items():
            groups: dict[str, list[str]] = {}
            for other, v in against.items():
                groups.setdefault(v["verdict"], []).append(other)
            said = [f"{VERDICT_WORDS.get(verdict, verdict)} {', '.join(others)}" for verdict, others in groups.items()]
            lines.append(f"- `{name}` on `{set_name}`: " + "; ".join(said) + ".")
    return lines


def probes_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 1. Probe calibration and baselines",
           "Each probe against the empirical semantic probabilities of held-out steps, next to its baselines "
           "(constant = mean training label, logprob = the step's mean token log-probability mapped to a "
           "probability, last_layer = the same MLP on the final layer only). Intervals in brackets. The label "
           "noise floor is the Brier score a perfect predictor of the true probability would still get, because "
           "each label is a frequency of d draws (the mean of each label's unbiased binomial variance, y(1−y)/(d−1): "
           "d = N for a draft step counted against the target's N samples, d = N − 1 for a model's own step, "
           "whose label counts the N − 1 other samples): no predictor can be expected to go below it."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated (see Skipped parts).*"])
    summary = summary_lines(part.get("versus") or {})
    if summary:
        out.append("**In short** (Brier score, paired bootstrap):\n\n" + "\n".join(summary))
    out.append("All probes and baselines in one table (point estimates; intervals in the tables below):")
    out.append(table(["probe", "held-out rows", "predictor", "n"] + [METRIC_LABELS[k] for k in CALIBRATION_METRICS],
                     [[f"`{r['probe']}`", r["set"], f"**{r['predictor']}**" if r["predictor"] == "probe"
                       else r["predictor"], r["n"]] + [num((r.get(k) or {}).get("estimate")) for k in CALIBRATION_METRICS]
                      for r in part["table"]]))
    versus = part.get("versus") or {}
    for name, per_set in part["by_probe"].items():
        for set_name, blocks in per_set.items():
            first = next(iter(blocks.values()))
            floor = first.get("noise_floor_brier")
            out.append(f"### `{name}` on `{set_name}` (n = {first['n']} steps, {first['n_questions']} questions, "
                       f"mean label {num(first['mean_label'])}, majority share {num(first['positive_rate'])}"
                       + (f", label noise floor of the Brier score {num(floor)}" if floor is not None else "") + ")")
            if first.get("too_small"):
                out.append(f"*Too small for intervals ({first['too_small']}): estimates are marked (no CI).*")
            out.append(table(["predictor", "mean pred"] + [METRIC_LABELS[k] for k in CALIBRATION_METRICS],
                             [[f"**{p}**" if p == "probe" else p, num(b["mean_pred"])]
                              + [ci(b["metrics"].get(k)) for k in CALIBRATION_METRICS] for p, b in blocks.items()]))
            lines = verdict_lines(name, set_name, (versus.get(name) or {}).get(set_name) or {})
            if lines:
                out.append("In words (paired bootstrap of the Brier difference):\n\n" + "\n".join(lines))
    out.append(figure_links(figures, "calibration"))
    return "\n\n".join(out)


def acceptance_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 2. Acceptance ratio min(1, p/q) on draft steps",
           "The probes' acceptance probability for each held-out draft step, against the ratio of its empirical "
           "labels on the scale the probes learn (prob_under_target / the draft's leave-one-out own_prob; a step "
           "no other draft sample shared counts 1 where the target said its meaning, else 0). mean_predicted vs "
           "mean_empirical is the step acceptance rate the probes imply vs the data's."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated (see Skipped parts).*"])
    out.append(table(["from", "n"] + list(ACCEPTANCE_METRICS),
                     [[f"**{k}**" if k == "probes" else k, b["n"]] + [ci(b["metrics"][m]) for m in ACCEPTANCE_METRICS]
                      for k, b in part.items()]))
    versus = (part.get("probes") or {}).get("versus")
    if versus:  # squared error of the ratio ("Brier" on a continuous target), paired bootstrap
        out.append("In words (squared error of the ratio, paired bootstrap):\n\n"
                   + "\n".join(verdict_lines("probes", "the acceptance ratio", versus)))
    out.append(figure_links(figures, "acceptance"))
    return "\n\n".join(out)


def sweep_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 3. Per-layer sweep",
           "One small probe per hidden-state row (quick settings below), fitted on training questions; its epoch "
           "and the best layer are chosen on the validation questions, and the chosen layer's Brier score is "
           "reported on the held-out test questions (the table's split column says where there were no separate "
           "validation questions). The constant predictor is each row set's mean training label."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated or disabled (eval.layer_sweep).*"])
    s = part["settings"]
    out.append(f"Settings: width {s['hidden_dim']}, ≤ {s['epochs']} epochs, at most {s['max_layers']} layers.")
    rows = []
    for role, sweep in part.items():
        if role == "settings":
            continue
        best = sweep.get("best") or {}
        rows.append([role, ", ".join(sweep["sets"]), sweep["n_train"], sweep["n_val"], sweep.get("n_test", "–"),
                     len(sweep["entries"]), best.get("layer", "–"), num(best.get("val_brier")),
                     num(best.get("test_brier")), num(sweep.get("constant_test_brier")), sweep["how"]])
    out.append(table(["model", "rows", "n train", "n val", "n test", "layers", "chosen layer", "its val Brier",
                      "its test Brier", "constant test Brier", "split"], rows))
    words = []
    for role, sweep in part.items():
        v = (sweep.get("best") or {}).get("versus_constant") if role != "settings" else None
        if v:
            said = VERDICT_WORDS.get(v["verdict"], v["verdict"])
            shared = "" if sweep.get("independent") else " (chosen on the same questions: optimistic)"
            words.append(f"- {role}: the chosen layer {said} the per-set constant on test, Brier difference "
                         f"{ci(v['brier_delta'])}{shared}.")
    for role, sweep in part.items():
        failed = sweep.get("failed") if role != "settings" else None
        if failed:
            words.append(f"- {role}: no probe could be fitted on layer(s) "
                         f"{', '.join(str(f['layer']) for f in failed)} (left out of the table and the figure): "
                         f"{failed[0]['error']}")
    if words:
        out.append("In words (paired bootstrap):\n\n" + "\n".join(words))
    out.append(figure_links(figures, "layer_sweep"))
    return "\n\n".join(out)


def logistic_sweep_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 3b. Logistic probe per layer, per row set",
           "The classic probe (L2 logistic regression on one layer's pooled hidden state) fitted on each row set's "
           "training questions alone, its penalty chosen on the validation questions, scored on the test questions "
           "against that set's own constant (its mean training label). Brier difference below 0: the probe beats "
           "the constant; intervals are paired bootstraps. The chosen reading is the one with the "
           "lowest validation log-loss."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated or disabled (eval.logistic_sweep).*"])
    conf = part["settings"].get("confidence")
    rows, words = [], []
    for set_name, sweep in part["sets"].items():
        best = sweep["best"]
        wins = [e for e in sweep["entries"] if e["versus_constant"]["verdict"] == "better"]
        v = best["versus_constant"]
        rows.append([set_name, sweep["n_train"], sweep["n_test"], sweep["n_test_questions"], num(sweep["constant"]),
                     num(sweep["constant_test_brier"]), f"{best['pooling']} row {best['layer']} (l2 {best['l2']})",
                     num(best["test_brier"]), ci(v["brier_delta"]), ci(v["brier_skill"]),
                     f"{len(wins)} of {len(sweep['entries'])}"])
        if sweep.get("independent", True):
            words.append(f"- `{set_name}`: the reading chosen on validation {VERDICT_WORDS.get(v['verdict'], v['verdict'])} "
                         f"the set's constant on test (Brier difference {ci(v['brier_delta'])}).")
        else:  # no validation questions apart: the choice saw the questions it is scored on
            words.append(f"- `{set_name}`: the reading chosen and scored on the same questions "
                         f"{VERDICT_WORDS.get(v['verdict'], v['verdict'])} the set's constant (Brier difference "
                         f"{ci(v['brier_delta'])}); optimistic, since the choice saw these questions ({sweep['how']}).")
    shared = chosen_on_scored(part["sets"])
    if shared:
        out.append("**Here the reading was chosen on the questions it is scored on** (" + "; ".join(shared)
                   + "): the verdicts below are optimistic.")
    out.append(table(["row set", "n train", "n test", "test questions", "constant", "constant test Brier",
                      "chosen reading", "its test Brier", f"difference ({conf:.0%} interval)" if conf else "difference",
                      "Brier skill", "readings that beat the constant"], rows))
    out.append("In words:\n\n" + "\n".join(words))
    out.append(figure_links(figures, "logistic_sweep"))
    return "\n\n".join(out)


def chosen_on_scored(sets: dict[str, Any]) -> list[str]:
    """How the questions were split (`sweep_split`'s words) for the row sets whose reading was chosen on the questions
    it is scored on, so that their verdicts are optimistic; [] when every set had validation questions apart."""
    return sorted({s["how"] for s in sets.values() if not s.get("independent", True)})


def positive_control_section(part: dict[str, Any] | None) -> str:
    out = ["## 3c. Positive control",
           "The same logistic pipeline asked for quantities every step's hidden states carry: its geometric-mean "
           "token probability exp(mean log-prob) and its length as a share of the token cap. Passing means a Brier "
           "skill over the constant whose whole interval is above 0 on the test questions."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated or disabled (eval.logistic_sweep).*"])
    rows = [[set_name, target, f"{t['pooling']} row {t['layer']}", num(t["test_brier"]),
             ci(t["versus_constant"]["brier_skill"]), f"**{t['check']}**" if t["check"] == "FAILED" else t["check"]]
            for set_name, s in part["sets"].items() for target, t in s["targets"].items()]
    out.append(table(["row set", "quantity", "reading", "test Brier", "Brier skill vs constant", "check"], rows))
    out.append(f"**Verdict:** {part['verdict']}.")
    shared = chosen_on_scored(part["sets"])
    if shared:  # the reading was chosen on the questions it is scored on: a pass is optimistic
        out.append("The reading was chosen and scored on the same questions, so a pass is optimistic: "
                   + "; ".join(shared) + ".")
    return "\n\n".join(out)


def umap_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 4. Hidden states (UMAP)",
           "Pooled hidden states of each model's own steps, coloured by their semantic probability in 0.1-wide "
           "bins (SemanticSpec's figure 2). All questions, subsampled to eval.umap_max_points."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated (see Skipped parts).*"])
    out.append(table(["model", "layer", "points", "points per bin (0.0–0.1 … 0.9–1.0)"],
                     [[r, p["layer"], p["n"], " ".join(str(c) for c in p["bin_counts"])] for r, p in part.items()]))
    out.append(figure_links(figures, "umap"))
    return "\n\n".join(out)


def fit_status(info: dict[str, Any]) -> str:
    """How the verifier's threshold was fitted, in words."""
    if info.get("fit_error"):
        return f"NO threshold could be fitted ({info['fit_error']}); the default is used"
    if info.get("met_target") is None:
        return "–"
    where = f" on {info['fit_on']}" if info.get("fit_on") else ""
    return (f"{'met' if info['met_target'] else 'did NOT meet'} target precision "
            f"{num(info.get('target_precision'), 2)}{where}")


def verifiers_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 5. Pair verifiers", "Held-out step pairs (does the draft step mean the same as the other?)."]
    if not part:
        return "\n\n".join(out + ["*Not evaluated (see Skipped parts).*"])
    p = part["pairs"]
    out.append(f"{p['n']} pairs from {p['n_questions']} questions, {p['n_positive']} equivalent; by source: "
               + ", ".join(f"{k} {v}" for k, v in p["sources"].items()) + ".")
    rows = []
    for name, b in part["by_verifier"].items():
        at = b["at_threshold"]
        info = b.get("info") or {}
        fitted = fit_status(info)
        ranks = ([ci(b["metrics"]["auroc"]), ci(b["metrics"]["auprc"])] if not b.get("ranking_not_evaluable")
                 else ["not evaluable", "not evaluable"])
        rows.append([name, b["n"], *ranks, num(at["threshold"]), fitted,
                     ci(b["metrics"]["acceptance_rate"]), ci(b["metrics"]["precision"]), num(at["recall"]),
                     num(at["false_accept_rate"])])
    out.append(table(["verifier", "n", "AUROC", "AUPRC", "threshold", "threshold fit (on pairs not trained on)",
                      "acceptance", "precision", "recall", "false accepts"], rows))
    if any((b["metrics"].get(k) or {}).get("wilson_units") and b["metrics"][k].get("low") is not None
           for b in part["by_verifier"].values() for k in ("acceptance_rate", "precision")):
        out.append("*[low, high; Wilson over N]: every resampled unit (question, or family) had the same share, so no "
                   "resample could differ; the interval is Wilson's over the N units, each one trial at that share.*")
    for name, b in part["by_verifier"].items():
        if b.get("ranking_not_evaluable"):
            out.append(f"*`{name}`: these pairs cannot evaluate its ranking ({b['ranking_not_evaluable']}); its AUROC "
                       "and AUPRC are not quoted (metrics.json keeps the raw estimates, flagged "
                       "`ranking_not_evaluable`).*")
    base_rows = [[name, "**its chosen threshold**", num(b["at_threshold"]["threshold"]),
                  num(b["at_threshold"]["acceptance_rate"]), num(b["at_threshold"]["precision"]),
                  num(b["at_threshold"]["recall"]), num(b["at_threshold"]["false_accept_rate"])]
                 for name, b in part["by_verifier"].items() if b.get("baselines")]
    for name, b in part["by_verifier"].items():
        for label, a in (b.get("baselines") or {}).items():
            base_rows.append([name, label, "–" if label == "accept all" else num(a["threshold"]),
                              num(a["acceptance_rate"]), num(a["precision"]), num(a["recall"]),
                              num(a["false_accept_rate"])])
    if base_rows:
        out.append("Beside baselines on the same pairs (accepting every pair: its precision is the share of "
                   "equivalent pairs; the embedding's cosine at the config's fixed thresholds, chosen without "
                   "labels):\n\n" + table(["verifier", "operating point", "threshold", "acceptance", "precision",
                                            "recall", "false accepts"], base_rows))
    words = []
    for name, b in part["by_verifier"].items():
        v = b.get("versus_accept_all")
        if v:
            words.append(f"- `{name}` at its threshold {PRECISION_WORDS.get(v['verdict'], v['verdict'])} accepting "
                         f"every pair: precision minus the share of equivalent pairs "
                         f"{ci(v['precision_minus_positive_rate'])}, while it accepts "
                         f"{num(b['at_threshold']['acceptance_rate'])} of the pairs.")
        if name == "judge":
            base = b.get("judge_base_at_training") or {}
            at = base.get("p>=0.5") or {}
            words.append("- The judge's untrained base model is not scored on these pairs (too slow on a CPU); "
                         + (f"on the training run's balanced test pairs it had AUROC {num(base.get('auroc'))} and, at "
                            f"p ≥ 0.5, precision {num(at.get('precision'))} (`metrics.json` of the checkpoint)."
                            if base else "the checkpoint records no test figures for it."))
    if words:
        out.append("In words:\n\n" + "\n".join(words))
    src = [[name, s, num(a["acceptance_rate"]), num(a["precision"]), num(a["recall"])]
           for name, b in part["by_verifier"].items() for s, a in b["by_source"].items()]
    out.append("At the chosen threshold, by pair source:\n\n"
               + table(["verifier", "source", "acceptance", "precision", "recall"], src))
    out.append("Agreement of decisions (label = the equivalence label of the data):\n\n"
               + table(["first", "second", "pairs", "agreement", "Cohen's kappa", "both accept", "both reject",
                        "only first", "only second"],
                       [[a["first"], a["second"], a["n"], num(a["agreement"]), num(a["cohen_kappa"]), a["both_accept"],
                         a["both_reject"], a["only_first"], a["only_second"]] for a in part["agreement"]]))
    out.append(figure_links(figures, "verifiers"))
    return "\n\n".join(out)


def training_section(part: dict[str, Any] | None, figures) -> str:
    out = ["## 6. Training curves",
           "As probe-train recorded them in the checkpoint's metrics (not recomputed): each MLP probe's loss per epoch "
           "on its training rows and its validation questions (early stopping keeps the epoch of the lowest "
           "validation loss), and the judge LoRA's loss per step on its training pairs."]
    if not part:
        return "\n\n".join(out + ["*Not shown (see Skipped parts).*"])
    rows = [[f"`{name}`", num(h.get("epochs_run")), num(h.get("best_epoch")), num(h.get("best_val_loss")),
             "yes" if h.get("stopped_early") else "no"] for name, h in part["probes"].items()]
    if rows:
        out.append(table(["probe", "epochs run", "kept epoch (from 0)", "validation loss there", "stopped early"],
                         rows))
    judge = part.get("judge")
    if judge:
        resumed = judge.get("resumed")
        out.append(f"Judge LoRA: {judge['steps']} steps"
                   + (f" (continued after step {resumed['after_step']} from an earlier run's saved state)."
                      if resumed else "."))
    out.append(figure_links(figures, "training"))
    return "\n\n".join(out)


def render_report(metrics: dict[str, Any]) -> str:
    """The whole report.md from a metrics dict (as written to metrics.json)."""
    parts = metrics.get("parts", {})
    figures = metrics.get("figures", [])
    return "\n\n".join([
        header(metrics), skipped_section(metrics),
        probes_section(parts.get("probes"), figures), acceptance_section(parts.get("acceptance"), figures),
        sweep_section(parts.get("layer_sweep"), figures), logistic_sweep_section(parts.get("logistic_sweep"), figures),
        positive_control_section(parts.get("positive_control")), umap_section(parts.get("umap"), figures),
        verifiers_section(parts.get("verifiers"), figures), training_section(parts.get("training"), figures),
    ]) + "\n"


def render_comparison(name_a: str, name_b: str, rows: Sequence[dict[str, Any]], warning: str | None = None) -> str:
    """Two checkpoints side by side: every shared headline metric, its delta (B - A) and which is better."""
    body = table(["metric", f"A: {name_a}", f"B: {name_b}", "Δ (B − A)", "better"],
                 [[f"`{r['metric']}`", num(r["a"]), num(r["b"]),
                   "–" if r["delta"] is None else f"{r['delta']:+.3f}", r["better"] or ""] for r in rows])
    return ("# probe-eval comparison\n\n" + (f"**WARNING: {warning}**\n\n" if warning else "")
            + f"- A: `{name_a}`\n- B: `{name_b}`\n\n"
            "Point estimates of each report (intervals are in the reports themselves). `better` follows the "
            "metric's direction (lower ECE/Brier/MAE, higher AUROC/Spearman/precision) and names a side only where "
            "the two reports' intervals do not overlap; blank: no clear difference.\n\n" + body + "\n")
