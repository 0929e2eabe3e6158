"""Meaning clusters of sampled steps: greedy clustering with any equivalence judge (pure algorithm).

Semantic probability (SemanticSpec, papers.md §1): sample N continuations of a context, cluster them by
meaning, label each sample of cluster C_k with |C_k| / N.

Two greedy schemes (``scheme``):

- ``"reference"`` (default): the scheme of the semantic-uncertainty code (``get_semantic_ids``). Walk the
  samples in order; each sample still without a cluster opens the next one as its representative and is
  compared with EVERY later sample, those already placed included; each one the judge calls equivalent
  moves to the new cluster. With a non-transitive judge a later equivalent representative therefore
  takes a sample over ("last match"). A representative is always its cluster's first member.
- ``"first_match"``: each sample is placed once, in the first cluster whose representative the judge
  calls equivalent (a representative is compared only with samples still unplaced: fewer judge pairs).

Both give the same clusters when the judge is an equivalence relation. Either runs in *rounds* so the
judge sees batches: a round compares the newest representative with all its candidates in one judge
call, so K clusters cost K calls (not O(N^2)); `cluster_many` runs the rounds of many contexts in
lockstep, so one judge call holds the pairs of all contexts (what the data pipeline uses).

Texts equal after `normalise_step` (whitespace only: "X = 5" and "x = 5" still go to the judge) are
judged once per round: a sample with the representative's own text joins it without a call (the judge
is taken to be reflexive), and several candidates with one text share one decision. With a judge whose
decisions depend only on the two texts, this gives exactly the clusters of the one-pair-at-a-time loop.

The judge is anything with ``judge(items: Sequence[PairQuery]) -> list[bool]`` (see data_gen.judges).
In every query ``a`` is the cluster representative (or reference) and ``b`` the sample being placed.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Scheme = Literal["reference", "first_match"]
SCHEMES: tuple[str, ...] = ("reference", "first_match")
# How each scheme places a draft step among the target's clusters (`assign_many`); data folders record it, since
# folders made before the reference scheme asked every representative used the first match under both schemes.
DRAFT_ASSIGNMENT = {"reference": "last_match", "first_match": "first_match"}


@dataclass(frozen=True)
class PairQuery:
    """Does step `b` mean the same as step `a`, both continuing `context`?"""

    context: str
    a: str
    b: str


class Judge(Protocol):
    def judge(self, items: Sequence[PairQuery]) -> list[bool]: ...


_WHITESPACE = re.compile(r"\s+")


def normalise_step(text: str) -> str:
    """Collapse runs of whitespace to one space and strip; equal results = the same step text.

    Letter case is kept: "X = 5" and "x = 5" may differ in meaning, so only the judge can merge them.
    """
    return _WHITESPACE.sub(" ", text).strip()


@dataclass
class ClusterStats:
    """Cost of clustering: `judge_pairs` the judge evaluated, `all_pairs` = sum of N(N-1)/2 over contexts
    (what comparing every pair would cost). Add stats with `+` to total several contexts."""

    num_samples: int = 0
    num_clusters: int = 0
    judge_pairs: int = 0
    duplicates: int = 0  # samples whose normalised text repeats an earlier sample's
    all_pairs: int = 0

    def __add__(self, other: ClusterStats) -> ClusterStats:
        return ClusterStats(self.num_samples + other.num_samples, self.num_clusters + other.num_clusters,
                            self.judge_pairs + other.judge_pairs, self.duplicates + other.duplicates,
                            self.all_pairs + other.all_pairs)


@dataclass
class Clustering:
    """Cluster ids (0..K-1 in order of first appearance) of one context's samples, and the cost."""

    cluster_ids: list[int]
    stats: ClusterStats = field(default_factory=ClusterStats)


def distinct_texts(samples: Sequence[str]) -> tuple[list[int], list[int]]:
    """(first index of each distinct normalised text, index into that list for every sample). The judge is asked
    once per distinct text, and the pairs stored for verifier training hold each distinct text once."""
    first_of: dict[str, int] = {}
    firsts: list[int] = []
    unique_of_sample: list[int] = []
    for i, text in enumerate(samples):
        key = normalise_step(text)
        if key not in first_of:
            first_of[key] = len(firsts)
            firsts.append(i)
        unique_of_sample.append(first_of[key])
    return firsts, unique_of_sample


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown clustering scheme {scheme!r}; use one of {', '.join(SCHEMES)}")


class _ContextState:
    """Greedy rounds of one context: round k compares representative k with its candidates."""

    def __init__(self, context: str, samples: Sequence[str], scheme: str):
        check_scheme(scheme)
        self.context = context
        self.samples = list(samples)
        self.reference = scheme == "reference"
        self.firsts, self.text_of = distinct_texts(self.samples)
        self.ids: list[int | None] = [None] * len(self.samples)
        self.rep = -1  # sample index of the newest representative
        self.asked: list[int] = []  # distinct texts asked in the open round
        self.candidates: dict[int, list[int]] = {}  # distinct text -> candidate samples with it
        self.num_clusters = 0
        self.judge_pairs = 0

    def has_round(self) -> bool:
        return any(c is None for c in self.ids[self.rep + 1:])

    def open_cluster(self) -> list[PairQuery]:
        """Open a cluster for the next unplaced sample; one query per distinct text among its candidates."""
        self.rep = next(i for i in range(self.rep + 1, len(self.samples)) if self.ids[i] is None)
        cluster = self.num_clusters
        self.num_clusters += 1
        self.ids[self.rep] = cluster
        rep_text = self.text_of[self.rep]
        self.candidates = {}
        for j in range(self.rep + 1, len(self.samples)):
            if self.reference or self.ids[j] is None:
                if self.text_of[j] == rep_text:
                    self.ids[j] = cluster  # same text as the representative: no judge call
                else:
                    self.candidates.setdefault(self.text_of[j], []).append(j)
        self.asked = list(self.candidates)
        rep = self.samples[self.rep]
        return [PairQuery(self.context, rep, self.samples[self.firsts[t]]) for t in self.asked]

    def absorb(self, decisions: Sequence[bool]) -> None:
        """Candidates the judge called equivalent to the newest representative move to its cluster."""
        if len(decisions) != len(self.asked):
            raise RuntimeError(f"judge returned {len(decisions)} decisions for {len(self.asked)} pairs")
        self.judge_pairs += len(decisions)
        cluster = self.num_clusters - 1
        for t, same in zip(self.asked, decisions):
            if same:
                for j in self.candidates[t]:
                    self.ids[j] = cluster

    def result(self) -> Clustering:
        stats = ClusterStats(num_samples=len(self.samples), num_clusters=self.num_clusters,
                             judge_pairs=self.judge_pairs, duplicates=len(self.samples) - len(self.firsts),
                             all_pairs=len(self.samples) * (len(self.samples) - 1) // 2)
        return Clustering(list(self.ids), stats)  # type: ignore[arg-type]  # every id is set once rounds end


def _judge_in_chunks(judge: Judge, queries: list[PairQuery], max_pairs_per_call: int | None) -> list[bool]:
    if not queries:
        return []
    step = max_pairs_per_call or len(queries)
    decisions: list[bool] = []
    for start in range(0, len(queries), step):
        chunk = queries[start:start + step]
        got = list(judge.judge(chunk))
        if len(got) != len(chunk):
            raise RuntimeError(f"{type(judge).__name__}.judge returned {len(got)} decisions for {len(chunk)} pairs")
        decisions.extend(bool(d) for d in got)
    return decisions


def cluster_many(contexts: Sequence[str], samples_per_context: Sequence[Sequence[str]], judge: Judge,
                 max_pairs_per_call: int | None = None, scheme: Scheme = "reference") -> list[Clustering]:
    """Cluster the samples of many contexts; each round's pairs of all contexts go in one judge call.

    scheme: "reference" (semantic-uncertainty's last match) or "first_match" (see the module docstring).
    max_pairs_per_call: split a round into several judge calls of at most this many pairs (bounds the
    work lost if a run dies mid-call when the judge persists its decisions); None = one call per round.
    """
    if len(contexts) != len(samples_per_context):
        raise ValueError(f"{len(contexts)} contexts but {len(samples_per_context)} sample lists")
    if max_pairs_per_call is not None and max_pairs_per_call < 1:
        raise ValueError(f"max_pairs_per_call must be >= 1 or None, got {max_pairs_per_call}")
    states = [_ContextState(c, s, scheme) for c, s in zip(contexts, samples_per_context)]
    _lockstep(states, lambda s: s.has_round(), lambda s: s.open_cluster(), judge, max_pairs_per_call)
    return [s.result() for s in states]


def _lockstep(states, is_active, next_queries, judge: Judge, max_pairs_per_call: int | None) -> None:
    """Advance every still-active state one round at a time; each round's queries of all states go to
    the judge together, and each state absorbs its own slice of the decisions."""
    while True:
        active = [s for s in states if is_active(s)]
        if not active:
            return
        per_state = [next_queries(s) for s in active]
        decisions = _judge_in_chunks(judge, [q for qs in per_state for q in qs], max_pairs_per_call)
        offset = 0
        for state, queries in zip(active, per_state):
            state.absorb(decisions[offset:offset + len(queries)])
            offset += len(queries)


def cluster_samples(context: str, samples: Sequence[str], judge: Judge, scheme: Scheme = "reference") -> list[int]:
    """Cluster ids (0..K-1, in order of first appearance) of one context's samples."""
    return cluster_many([context], [samples], judge, scheme=scheme)[0].cluster_ids


def semantic_probabilities(cluster_ids: Sequence[int]) -> list[float]:
    """|C_k| / N for every sample (the SemanticSpec label)."""
    sizes = Counter(cluster_ids)
    n = len(cluster_ids)
    return [sizes[k] / n for k in cluster_ids]


def semantic_entropy(cluster_ids: Sequence[int]) -> float:
    """Entropy (natural log) of the empirical cluster distribution |C_k| / N."""
    if not cluster_ids:
        raise ValueError("semantic_entropy of an empty sample list is undefined")
    n = len(cluster_ids)
    return -sum((c / n) * math.log(c / n) for c in Counter(cluster_ids).values())


def first_members(cluster_ids: Sequence[int]) -> dict[int, int]:
    """Index of every cluster's first member (its representative), by cluster id in ascending order."""
    first: dict[int, int] = {}
    for i, cid in enumerate(cluster_ids):
        first.setdefault(int(cid), i)
    return dict(sorted(first.items()))


def _representatives(reference_samples: Sequence[str], reference_ids: Sequence[int]) -> list[tuple[int, str]]:
    """(cluster id, first member's text) for every reference cluster, ordered by id."""
    if len(reference_samples) != len(reference_ids):
        raise ValueError(f"{len(reference_samples)} reference samples but {len(reference_ids)} ids")
    return [(cid, reference_samples[i]) for cid, i in first_members(reference_ids).items()]


class _AssignState:
    """Rounds of `assign_many` for one context: round r compares every unmatched query with cluster r."""

    def __init__(self, context: str, queries: Sequence[str], reference_samples: Sequence[str],
                 reference_ids: Sequence[int], scheme: Scheme = "reference"):
        check_scheme(scheme)
        self.last_match = DRAFT_ASSIGNMENT[scheme] == "last_match"  # every representative is asked; the last wins
        self.context = context
        self.queries = list(queries)
        self.reps = _representatives(reference_samples, reference_ids)
        exact = {}
        for text, cid in zip(reference_samples, reference_ids):
            exact.setdefault(normalise_step(text), int(cid))
        self.firsts, self.unique_of_query = distinct_texts(self.queries)
        # A query textually equal to any reference sample takes that sample's cluster without a call.
        self.unique_cluster: list[int | None] = [exact.get(normalise_step(self.queries[f])) for f in self.firsts]
        self.unmatched = [u for u, c in enumerate(self.unique_cluster) if c is None]
        self.next_rep = 0
        self.judge_pairs = 0

    @property
    def active(self) -> bool:
        return bool(self.unmatched) and self.next_rep < len(self.reps)

    def round_queries(self) -> list[PairQuery]:
        _, rep_text = self.reps[self.next_rep]
        return [PairQuery(self.context, rep_text, self.queries[self.firsts[u]]) for u in self.unmatched]

    def absorb(self, decisions: Sequence[bool]) -> None:
        cid, _ = self.reps[self.next_rep]
        self.judge_pairs += len(decisions)
        left = []
        for u, same in zip(self.unmatched, decisions):
            if same:
                self.unique_cluster[u] = cid
            if not same or self.last_match:
                left.append(u)
        self.unmatched = left
        self.next_rep += 1

    def result(self) -> list[int | None]:
        return [self.unique_cluster[u] for u in self.unique_of_query]


def assign_many(contexts: Sequence[str], queries_per_context: Sequence[Sequence[str]],
                reference_samples_per_context: Sequence[Sequence[str]],
                reference_ids_per_context: Sequence[Sequence[int]], judge: Judge,
                max_pairs_per_call: int | None = None, scheme: Scheme = "reference") -> list[list[int | None]]:
    """`assign_to_clusters` for many contexts, rounds in lockstep (one judge call per round)."""
    n = len(contexts)
    if not (len(queries_per_context) == len(reference_samples_per_context) == len(reference_ids_per_context) == n):
        raise ValueError("assign_many needs one query list, reference list and id list per context")
    states = [_AssignState(*args, scheme) for args in zip(contexts, queries_per_context,
                                                           reference_samples_per_context, reference_ids_per_context)]
    _lockstep(states, lambda s: bool(s.active), lambda s: s.round_queries(), judge, max_pairs_per_call)
    return [s.result() for s in states]


def assign_to_clusters(context: str, queries: Sequence[str], reference_samples: Sequence[str],
                       reference_ids: Sequence[int], judge: Judge, scheme: Scheme = "reference") -> list[int | None]:
    """For each query (e.g. a draft sample), the reference (target) cluster it means the same as, or None.

    Queries are compared with each reference cluster's first member in id order, by the scheme that clustered
    the references: "reference" asks every representative and the LAST match wins, the cluster
    ``get_semantic_ids`` gives the query appended to the reference samples (so a draft step gets the cluster a
    target sample of the same text would, also with a non-transitive judge, and every draft-representative pair
    is judged); "first_match" stops at the first match (fewer pairs). A query equal (after normalisation) to a
    reference sample takes that sample's cluster with no judge call (the judge is taken to be reflexive; with a
    non-transitive judge get_semantic_ids could move such a query to a later cluster). The draft sample's
    probability under the target's meaning distribution is then |C_k| / N_ref (0 for None).
    """
    return assign_many([context], [queries], [reference_samples], [reference_ids], judge, scheme=scheme)[0]
