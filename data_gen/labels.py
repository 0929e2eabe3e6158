"""Labels of sampled steps, from meaning clusters (pure functions, no models).

Per model and context (SemanticSpec, papers.md §1): N samples were drawn; samples whose text is empty
or whitespace (e.g. the model ended its answer at once) cannot be clustered or recorded, so they are
not stored, but they still count in N and form one "empty" meaning of their own. Hence for a stored
sample of cluster k: semantic probability = |C_k| / N, and the stored cluster sizes of a context plus
its ``num_empty`` sum to N; ``num_clusters`` and the entropy include the empty group when present.

A draft sample's probability under the TARGET's meaning distribution is |C_t| / N_target for the
target cluster C_t it was assigned to (compared with each target cluster's first member by the clustering's
scheme: `cluster.assign_to_clusters`), else 0.

One scale for training and scoring: |C_k| / N counts the sample itself (it is at least 1 / N and, for a
meaning said with probability pi, averages pi + (1 - pi) / N), while a draft step is not among the target's
samples, so its label under the target averages pi. A model's own step therefore also gets the
leave-one-out label (|C_k| - 1) / (N - 1) (``own_probs``: the other N - 1 samples that agree with it,
averaging pi), which the probes learn; |C_k| / N (SemanticSpec's definition) stays as a column. A draft
step textually equal to a target sample gets |C_t| / N_target under the target.

Pairs for verifier training: every distinct sample against every cluster representative of the same
model, and every distinct draft sample against every target representative. Each unordered pair of
texts (after `normalise_step`) is stored once per context, so equivalence is symmetric by
construction; ``judged`` tells pairs the judge decided from pairs whose label follows from cluster
membership (greedy clustering never compares two members directly).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specprobe.data_gen.cluster import (
    distinct_texts,
    first_members,
    normalise_step,
    semantic_entropy,
    semantic_probabilities,
)

__all__ = ["is_empty_step", "ModelLabels", "model_labels", "draft_under_target", "pair_key", "build_pairs"]


def is_empty_step(text: str) -> bool:
    return not text.strip()


@dataclass
class ModelLabels:
    """Cluster labels of one model's stored (non-empty) samples on one context."""

    cluster_ids: list[int]
    num_samples: int  # N drawn, empty ones included
    cluster_sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.cluster_ids) > self.num_samples:
            raise ValueError(f"{len(self.cluster_ids)} cluster ids for {self.num_samples} samples")
        k = max(self.cluster_ids) + 1 if self.cluster_ids else 0
        if sorted(set(self.cluster_ids)) != list(range(k)):
            raise ValueError(f"cluster ids must be 0..K-1 without gaps, got {self.cluster_ids}")
        self.cluster_sizes = [self.cluster_ids.count(c) for c in range(k)]

    @property
    def num_empty(self) -> int:
        return self.num_samples - len(self.cluster_ids)

    def _with_empty(self) -> list[int]:
        """Cluster ids of all N samples, the empty group as id K."""
        return list(self.cluster_ids) + [len(self.cluster_sizes)] * self.num_empty

    @property
    def semantic_probs(self) -> list[float]:
        return semantic_probabilities(self._with_empty())[: len(self.cluster_ids)]

    @property
    def own_probs(self) -> list[float | None]:
        """(|C_k| - 1) / (N - 1): the share of the OTHER N - 1 samples that agree with each sample, an unbiased
        estimate of its meaning's probability on the scale of a draft step's label under the target (None
        when N = 1)."""
        if self.num_samples < 2:
            return [None] * len(self.cluster_ids)
        return [(self.cluster_sizes[c] - 1) / (self.num_samples - 1) for c in self.cluster_ids]

    @property
    def num_clusters(self) -> int:
        return len(self.cluster_sizes) + (1 if self.num_empty else 0)

    @property
    def semantic_entropy(self) -> float:
        return semantic_entropy(self._with_empty())

    def representatives(self) -> list[int]:
        """Index (into the stored samples) of each cluster's first member, by cluster id."""
        first = first_members(self.cluster_ids)
        return [first[c] for c in range(len(self.cluster_sizes))]


def model_labels(cluster_ids: Sequence[int], num_samples: int) -> ModelLabels:
    return ModelLabels([int(c) for c in cluster_ids], int(num_samples))


def draft_under_target(matches: Sequence[int | None], target: ModelLabels) -> tuple[list[int], list[float]]:
    """(matched target cluster or -1, |C_t| / N_target or 0) for every draft sample."""
    ids, probs = [], []
    for m in matches:
        if m is None:
            ids.append(-1)
            probs.append(0.0)
        else:
            if not 0 <= m < len(target.cluster_sizes):
                raise ValueError(f"draft sample matched target cluster {m}, but there are {len(target.cluster_sizes)}")
            ids.append(int(m))
            probs.append(target.cluster_sizes[m] / target.num_samples)
    return ids, probs


def pair_key(context: str, a: str, b: str) -> tuple[str, str, str]:
    """Order-free identity of a judged pair: (context, the two normalised texts sorted)."""
    x, y = normalise_step(a), normalise_step(b)
    return (context, x, y) if x <= y else (context, y, x)


@dataclass
class _Candidate:
    a_text: str
    b_text: str
    a_model: str
    b_model: str
    equivalent: bool  # as implied by the clusters / the assignment
    source: str


def _candidates(texts: dict[str, list[str]], labels: dict[str, ModelLabels],
                draft_matches: Sequence[int | None] | None) -> list[_Candidate]:
    out: list[_Candidate] = []

    def add(a: str, b: str, a_model: str, b_model: str, same: bool, source: str) -> None:
        if normalise_step(a) != normalise_step(b):
            out.append(_Candidate(a, b, a_model, b_model, same, source))

    for model, lab in labels.items():
        reps = lab.representatives()
        for i in distinct_texts(texts[model])[0]:
            for cid, r in enumerate(reps):
                add(texts[model][r], texts[model][i], model, model, lab.cluster_ids[i] == cid, "cluster")
    if draft_matches is not None and "target" in labels and "draft" in texts:
        reps = labels["target"].representatives()
        for i in distinct_texts(texts["draft"])[0]:
            for cid, r in enumerate(reps):
                add(texts["target"][r], texts["draft"][i], "target", "draft", draft_matches[i] == cid,
                    "draft_vs_target")
    return out


def build_pairs(context: str, texts: dict[str, list[str]], labels: dict[str, ModelLabels],
                draft_matches: Sequence[int | None] | None,
                judged: dict[tuple[str, str, str], bool]) -> tuple[list[dict], int]:
    """(pair records, number of unordered pairs dropped because their implied labels disagree).

    texts/labels: per model ("target", "draft") the stored samples and their clusters; draft_matches:
    the target cluster of each draft sample (or None); judged: the judge's decision for every
    `pair_key` it decided. A pair the judge decided carries that decision (``judged`` True); any other
    pair carries the label its clusters imply, and is dropped when two of its sources imply different
    labels (possible because a judge need not be transitive).
    """
    groups: dict[tuple, list[_Candidate]] = {}
    for cand in _candidates(texts, labels, draft_matches):
        groups.setdefault(pair_key(context, cand.a_text, cand.b_text), []).append(cand)
    records, conflicts = [], 0
    for key, cands in groups.items():
        if key in judged:
            label = bool(judged[key])
            # Attribute the pair to a source whose clusters agree with the judge when there is one.
            chosen = next((c for c in cands if c.equivalent == label), cands[0])
        elif len({c.equivalent for c in cands}) == 1:
            chosen, label = cands[0], cands[0].equivalent
        else:
            conflicts += 1
            continue
        records.append(dict(a_text=chosen.a_text, b_text=chosen.b_text, a_model=chosen.a_model,
                            b_model=chosen.b_model, equivalent=label, source=chosen.source,
                            judged=key in judged))
    return records, conflicts
