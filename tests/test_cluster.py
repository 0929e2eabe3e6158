"""Greedy clustering with deterministic fake judges: known answers, edge cases, batching and cost."""
from __future__ import annotations

import math
import random

import pytest

from specprobe.data_gen.cluster import (
    ClusterStats,
    PairQuery,
    assign_many,
    assign_to_clusters,
    cluster_many,
    cluster_samples,
    normalise_step,
    semantic_entropy,
    semantic_probabilities,
)


class FirstWordJudge:
    """Equivalent iff the first words match (case-insensitive). Records every call."""

    def __init__(self):
        self.calls: list[list[PairQuery]] = []

    @property
    def model_calls(self) -> int:
        return sum(len(c) for c in self.calls)

    def judge(self, items):
        items = list(items)
        self.calls.append(items)
        return [q.a.split()[0].lower() == q.b.split()[0].lower() for q in items]


class NearNumberJudge:
    """Equivalent iff the integers differ by at most 1: NOT transitive, so greedy order matters."""

    def __init__(self):
        self.pairs = 0

    def judge(self, items):
        self.pairs += len(items)
        return [abs(int(q.a) - int(q.b)) <= 1 for q in items]


def sequential_greedy(samples, same) -> tuple[list[int], int]:
    """The textbook one-sample-at-a-time greedy loop, for comparison: (ids, comparisons)."""
    reps: list[str] = []
    ids, comparisons = [], 0
    for s in samples:
        for k, r in enumerate(reps):
            comparisons += 1
            if same(r, s):
                ids.append(k)
                break
        else:
            reps.append(s)
            ids.append(len(reps) - 1)
    return ids, comparisons


def test_normalise_step():
    assert normalise_step("  The  Answer\n\nis 72. ") == "The Answer is 72."  # case is kept
    assert normalise_step("\t") == ""


@pytest.mark.parametrize("scheme, round_sizes", [("reference", [4, 3, 1]), ("first_match", [4, 2])])
def test_known_clusters_in_order_of_first_appearance(scheme, round_sizes):
    judge = FirstWordJudge()
    samples = ["b one", "a two", "b three", "c four", "a five"]
    assert cluster_samples("ctx", samples, judge, scheme=scheme) == [0, 1, 0, 2, 1]
    # Round 1: rep "b one" vs the 4 others; round 2: "a two" vs the 3 after it (reference) or the 2 still
    # unplaced (first match); round 3: "c four" vs the placed "a five" (reference) or nothing (first match).
    assert [len(c) for c in judge.calls] == round_sizes
    assert all(q.context == "ctx" for c in judge.calls for q in c)
    assert judge.calls[0][0] == PairQuery("ctx", "b one", "a two")  # a = representative, b = candidate


def test_all_equal_needs_one_round():
    judge = FirstWordJudge()
    samples = [f"same {i}" for i in range(6)]
    assert cluster_samples("c", samples, judge) == [0] * 6
    assert judge.model_calls == 5 and len(judge.calls) == 1


def test_all_different():
    judge = FirstWordJudge()
    samples = [f"w{i} x" for i in range(5)]
    assert cluster_samples("c", samples, judge) == [0, 1, 2, 3, 4]
    assert judge.model_calls == 4 + 3 + 2 + 1  # every pair once: the worst case equals all pairs


def test_exact_duplicates_cost_no_model_call():
    judge = FirstWordJudge()
    samples = ["The answer is 72.", "The  answer is 72.  ", "The answer\nis 72."]
    result = cluster_many(["c"], [samples], judge)[0]
    assert result.cluster_ids == [0, 0, 0]
    assert judge.model_calls == 0 and judge.calls == []
    assert result.stats.duplicates == 2 and result.stats.judge_pairs == 0


@pytest.mark.parametrize("scheme, pairs", [("reference", 4), ("first_match", 3)])
def test_duplicates_join_the_cluster_of_their_first_copy(scheme, pairs):
    judge = FirstWordJudge()
    samples = ["x a", "y b", "x  a", "y b", "z c"]
    assert cluster_samples("c", samples, judge, scheme=scheme) == [0, 1, 0, 1, 2]
    # One query per distinct text per round. Reference: "x a" vs {y b, z c}, then "y b" vs {x a, z c}
    # (the placed "x  a" is asked again); first match: 2 + 1 ("y b" vs "z c" only).
    assert judge.model_calls == pairs


def test_texts_differing_in_case_go_to_the_judge():
    for scheme in ("reference", "first_match"):
        judge = FirstWordJudge()
        result = cluster_many(["c"], [["X = 5", "x = 5", "X  =  5"]], judge, scheme=scheme)[0]
        assert judge.calls == [[PairQuery("c", "X = 5", "x = 5")]]
        assert result.cluster_ids == [0, 0, 0] and result.stats.duplicates == 1

        class NeverSame:
            def judge(self, items):
                return [False] * len(items)

        assert cluster_samples("c", ["X = 5", "x = 5"], NeverSame(), scheme=scheme) == [0, 1]


def test_one_sample_and_empty():
    judge = FirstWordJudge()
    assert cluster_samples("c", ["only one"], judge) == [0]
    assert cluster_samples("c", [], judge) == []
    assert judge.calls == []
    empty = cluster_many(["c"], [[]], judge)[0]
    assert empty.stats == ClusterStats(0, 0, 0, 0, 0)


def test_rounds_equal_sequential_greedy_for_a_non_transitive_judge():
    rng = random.Random(0)
    for _ in range(30):
        samples = [str(rng.randint(0, 8)) for _ in range(rng.randint(1, 15))]
        judge = NearNumberJudge()
        got = cluster_many(["c"], [samples], judge, scheme="first_match")[0]
        # Sequential greedy over distinct texts (duplicates are free in ours).
        distinct = list(dict.fromkeys(samples))
        ids, comparisons = sequential_greedy(distinct, lambda a, b: abs(int(a) - int(b)) <= 1)
        by_text = dict(zip(distinct, ids))
        assert got.cluster_ids == [by_text[s] for s in samples]
        assert judge.pairs == got.stats.judge_pairs == comparisons


def reference_semantic_ids(samples, equivalent) -> tuple[list[int], int]:
    """semantic-uncertainty's get_semantic_ids re-stated: (ids, comparisons). Each sample without an id
    opens a cluster and is compared with every later sample, placed or not; a match moves it over."""
    ids = [-1] * len(samples)
    next_id = comparisons = 0
    for i in range(len(samples)):
        if ids[i] != -1:
            continue
        ids[i] = next_id
        for j in range(i + 1, len(samples)):
            comparisons += 1
            if equivalent(samples[i], samples[j]):
                ids[j] = next_id
        next_id += 1
    return ids, comparisons


class RelationJudge:
    """Judge by a fixed set of ordered (representative, sample) pairs: asymmetric, not transitive."""

    def __init__(self, related: set[tuple[str, str]]):
        self.related = related
        self.calls: list[list[PairQuery]] = []

    def related_pair(self, a, b):
        return (a, b) in self.related

    def judge(self, items):
        self.calls.append(list(items))
        return [self.related_pair(q.a, q.b) for q in items]


def random_relation(texts, rng, p):
    return {(a, b) for a in texts for b in texts if a != b and rng.random() < p}


def test_reference_scheme_equals_get_semantic_ids_on_random_relations():
    differs = 0
    for seed in range(300):
        rng = random.Random(seed)
        texts = [f"s{i}" for i in range(rng.randint(1, 12))]
        judge = RelationJudge(random_relation(texts, rng, rng.choice([0.1, 0.3, 0.5])))
        got = cluster_many(["c"], [texts], judge)[0]
        want, comparisons = reference_semantic_ids(texts, judge.related_pair)
        assert got.cluster_ids == want, seed
        assert got.stats.judge_pairs == comparisons == sum(len(c) for c in judge.calls)
        # a = the representative, b = a later sample
        assert all(texts.index(q.a) < texts.index(q.b) for c in judge.calls for q in c)
        first = cluster_samples("c", texts, RelationJudge(judge.related), scheme="first_match")
        differs += first != want
    assert differs > 30  # the relations are non-transitive enough to tell the schemes apart


class NormalisedRelationJudge(RelationJudge):
    """Reflexive on whitespace-normalised text, else the relation on normalised texts."""

    def related_pair(self, a, b):
        x, y = normalise_step(a), normalise_step(b)
        return x == y or (x, y) in self.related

    def judge(self, items):
        self.calls.append(list(items))
        return [self.related_pair(q.a, q.b) for q in items]


def test_reference_scheme_with_duplicates_and_lockstep_contexts():
    """Repeated and whitespace-variant texts: the same clusters as get_semantic_ids with a reflexive judge
    that sees normalised text, fewer judge pairs, and one judge call per round for all contexts."""
    for seed in range(100):
        rng = random.Random(1000 + seed)
        base = [f"t{i}" for i in range(rng.randint(1, 6))]
        related = random_relation(base, rng, 0.4)
        sample_lists = [[rng.choice(base) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(0, 10))]
                        for _ in range(3)]
        judge = NormalisedRelationJudge(related)
        got = cluster_many(["a", "b", "c"], sample_lists, judge)
        for result, samples in zip(got, sample_lists):
            want, comparisons = reference_semantic_ids(samples, judge.related_pair)
            assert result.cluster_ids == want, seed
            assert result.stats.judge_pairs <= comparisons
        assert len(judge.calls) <= max((r.stats.num_clusters for r in got), default=0)
        split = cluster_many(["a", "b", "c"], sample_lists, NormalisedRelationJudge(related), max_pairs_per_call=2)
        assert [r.cluster_ids for r in split] == [r.cluster_ids for r in got]


def test_cluster_many_equals_per_context_clustering_and_batches_rounds():
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta"]
    contexts = [f"ctx{i}" for i in range(5)]
    sample_lists = [[f"{rng.choice(words[:k + 1])} {j}" for j in range(rng.randint(0, 10))]
                    for k, _ in enumerate(contexts)]
    batched_judge = FirstWordJudge()
    batched = cluster_many(contexts, sample_lists, batched_judge)
    singles = []
    single_calls = 0
    for ctx, samples in zip(contexts, sample_lists):
        j = FirstWordJudge()
        singles.append(cluster_samples(ctx, samples, j))
        single_calls += len(j.calls)
    assert [r.cluster_ids for r in batched] == singles
    # Lockstep rounds: calls = the largest number of rounds of any context, not their sum.
    assert len(batched_judge.calls) <= max(len(set(s)) for s in singles if s)
    assert len(batched_judge.calls) < single_calls
    # Each query carries its own context.
    for call in batched_judge.calls:
        for q in call:
            i = contexts.index(q.context)
            assert q.a in sample_lists[i] and q.b in sample_lists[i]


def test_max_pairs_per_call_splits_rounds_without_changing_results():
    samples = [f"{w} {i}" for i, w in enumerate("a b a c b a d a".split())]
    whole, split = FirstWordJudge(), FirstWordJudge()
    r1 = cluster_many(["c", "d"], [samples, samples[::-1]], whole)
    r2 = cluster_many(["c", "d"], [samples, samples[::-1]], split, max_pairs_per_call=3)
    assert [r.cluster_ids for r in r1] == [r.cluster_ids for r in r2]
    assert max(len(c) for c in split.calls) <= 3
    with pytest.raises(ValueError, match="max_pairs_per_call"):
        cluster_many(["c"], [samples], whole, max_pairs_per_call=0)


def test_far_fewer_judge_pairs_than_all_pairs_when_few_clusters():
    samples = [f"{['x', 'y', 'z'][i % 3]} variant {i}" for i in range(20)]
    judge, first = FirstWordJudge(), FirstWordJudge()
    stats = cluster_many(["c"], [samples], judge)[0].stats
    first_stats = cluster_many(["c"], [samples], first, scheme="first_match")[0].stats
    assert stats.num_clusters == first_stats.num_clusters == 3 and stats.num_samples == 20
    assert stats.all_pairs == 190
    # reference: each rep vs every later sample (19 + 18 + 17)
    assert stats.judge_pairs == 19 + 18 + 17 == judge.model_calls
    # first match: rep x vs the 19 others, rep y vs the 12 left after it, rep z vs its 5 fellows
    assert first_stats.judge_pairs == 19 + 12 + 5 == first.model_calls
    assert first_stats.judge_pairs < stats.judge_pairs < stats.all_pairs / 3
    total = sum((r.stats for r in cluster_many(["a", "b"], [samples, samples[:4]], FirstWordJudge())),
                ClusterStats())
    assert total.num_samples == 24 and total.all_pairs == 190 + 6


def test_mismatched_inputs_and_bad_judges_raise():
    with pytest.raises(ValueError, match="contexts"):
        cluster_many(["a", "b"], [["x"]], FirstWordJudge())

    class ShortJudge:
        def judge(self, items):
            return [True]

    with pytest.raises(RuntimeError, match="decisions"):
        cluster_samples("c", ["a 1", "b 2", "c 3"], ShortJudge())


def test_semantic_probabilities_sum_to_one_per_context():
    ids = [0, 1, 0, 2, 0, 1]
    probs = semantic_probabilities(ids)
    assert probs == pytest.approx([3 / 6, 2 / 6, 3 / 6, 1 / 6, 3 / 6, 2 / 6])
    # Summed once per cluster (each sample carries its cluster's mass): sum_k |C_k|/N = 1.
    per_cluster = {k: p for k, p in zip(ids, probs)}
    assert sum(per_cluster.values()) == pytest.approx(1.0)
    assert semantic_probabilities([]) == []


def test_semantic_entropy():
    for k in (1, 2, 5):
        assert semantic_entropy(list(range(k)) * 3) == pytest.approx(math.log(k))
    assert semantic_entropy([0, 0, 0]) == 0.0
    assert semantic_entropy([0, 0, 0, 1]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    with pytest.raises(ValueError, match="empty"):
        semantic_entropy([])


def test_assign_to_clusters():
    refs = ["a one", "b two", "a three", "c four"]
    ref_ids = cluster_samples("c", refs, FirstWordJudge())
    assert ref_ids == [0, 1, 0, 2]
    judge = FirstWordJudge()
    queries = ["c new", "A THREE", "d none", "b other", "c new", "a  three"]
    got = assign_to_clusters("c", queries, refs, ref_ids, judge, scheme="first_match")
    assert got == [2, 0, None, 1, 2, 0]
    # "a  three" matched a reference sample textually: no call; "A THREE" differs in case, so it is asked.
    # Distinct unmatched queries: c new, A THREE, d none, b other -> vs "a one" (4 pairs; A THREE
    # matches), vs "b two" (3; b other matches), vs "c four" (2; c new matches).
    assert judge.model_calls == 4 + 3 + 2
    assert all(q.a in ("a one", "b two", "c four") for c in judge.calls for q in c)
    # the reference scheme asks every representative about every unmatched distinct query (same clusters here:
    # the judge is transitive)
    every = FirstWordJudge()
    assert assign_to_clusters("c", queries, refs, ref_ids, every) == got and every.model_calls == 4 * 3


def test_assign_stops_when_all_matched_and_handles_empty():
    judge = FirstWordJudge()
    assert assign_to_clusters("c", ["a x", "a y"], ["a 1", "b 2"], [0, 1], judge, scheme="first_match") == [0, 0]
    assert len(judge.calls) == 1  # both matched cluster 0; cluster 1 is never asked
    assert assign_to_clusters("c", ["a x"], [], [], judge) == [None]
    assert assign_to_clusters("c", [], ["a 1"], [0], judge) == []
    with pytest.raises(ValueError, match="reference"):
        assign_to_clusters("c", ["a"], ["a 1", "b 2"], [0], judge)


def test_reference_assignment_is_get_semantic_ids_with_the_query_appended():
    """With a non-transitive judge the reference scheme places a draft step where get_semantic_ids would place it
    among the target's samples (the last equivalent representative); first_match can differ."""
    differs = 0
    for seed in range(300):
        rng = random.Random(5000 + seed)
        refs = [f"s{i}" for i in range(rng.randint(1, 10))]
        queries = [f"q{i}" for i in range(rng.randint(1, 4))]
        related = random_relation(refs + queries, rng, rng.choice([0.2, 0.4, 0.6]))
        ref_ids, _ = reference_semantic_ids(refs, lambda a, b, r=related: (a, b) in r)
        got = assign_to_clusters("c", queries, refs, ref_ids, RelationJudge(related))
        for query, cid in zip(queries, got):
            appended, _ = reference_semantic_ids(refs + [query], lambda a, b, r=related: (a, b) in r)
            assert appended[:-1] == ref_ids  # a later sample never moves an earlier one
            assert cid == (appended[-1] if appended[-1] in ref_ids else None), seed
        first = assign_to_clusters("c", queries, refs, ref_ids, RelationJudge(related), scheme="first_match")
        differs += first != got
    assert differs > 20
    with pytest.raises(ValueError, match="scheme"):
        assign_to_clusters("c", ["a"], ["a 1"], [0], FirstWordJudge(), scheme="last")


def test_assign_many_equals_per_context():
    refs = [["a 1", "b 2", "a 3"], ["x 1", "y 2"]]
    ids = [cluster_samples("c", r, FirstWordJudge()) for r in refs]
    queries = [["b q", "z q", "a q"], ["y q", "x 1"]]
    judge = FirstWordJudge()
    many = assign_many(["c0", "c1"], queries, refs, ids, judge)
    singles = [assign_to_clusters(c, q, r, i, FirstWordJudge()) for c, q, r, i in zip(["c0", "c1"], queries, refs, ids)]
    assert many == singles == [[1, None, 0], [1, 0]]
    assert len(judge.calls) == 2  # two rounds shared by both contexts
