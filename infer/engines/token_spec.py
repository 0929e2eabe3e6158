"""Token-level speculation inside one step: proposers, the draft tree they return, and its one verification rule.

One interface, in the manner of vLLM's spec_decode: a proposer's `propose(context, k, stats)` returns a
`DraftTree` of tokens that might follow the context; `verify_tree` accepts a path of it against the target's
logits for every node, computed in one forward with tree attention. The proposers:
- prompt lookup (`NgramProposer`) and an assistant model's greedy tokens (`AssistantProposer`) return chains;
- Lookahead Decoding (`lookahead_decoding.JacobiProposer`) returns a trie of its pool's n-grams and, beside it,
  its Jacobi window (`SideBranch`): tokens fed in the same forward whose outputs only the proposer reads
  (`observe`); it keeps state per sequence, so a batch gives each row its own (`fork`);
- SEED's draft model (`seed_decoding.TreeDrafter`) returns a sampled token tree with its distributions q.
The first three run inside the transformers engine's batches (`infer.engines.hf_kv.DecodeBatch`, chains with a
causal mask, trees and side branches with a 4-D one laid out by `block_layout`; `static_kv.FastDecodeBatch`, every
block with a 4-D mask over its static buffers; `bounded_proposal` is their one rule for what a row may propose);
SEED and the sequence-level
`lookahead_decoding.LookaheadDecoder` run one sequence at a time on `sequence_kv.SequenceKV` (a one-slot
`static_kv.StaticKV`), with the same layout.

The rule (`verify_tree`):
- greedy (temperature 0): follow the child equal to the target's argmax, append the argmax at the first
  mismatch or after a leaf. The output is token for token what plain greedy decoding writes.
- sampling: a deterministic proposal x has q(x) = 1, so the speculative-sampling rule min(1, p/q) becomes
  "accept x with probability p(x)"; on rejection x is removed from p and the next sibling is tried against
  the rest (renormalised). Marginally every token is still distributed as p (lossless):
  P(x) = p(x), and P(y) = (1 − p(x)) · p(y) / (1 − p(x)) = p(y) for y ≠ x. Sampled proposals (SEED) use
  min(1, p'(x)/q(x)) and the residual norm(max(p' − q, 0)).

`p` is the distribution the engine samples from (temperature, then top-p), so speculation and plain
sampling target the same distribution: `draw_tokens` (the chain case) is the one sampling rule of the
transformers engine, with or without a proposal (no proposal: one draw from p, or the argmax under greedy).
The functions here are pure (tensors in, token lists out) and are unit-tested on tiny arrays.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal, Protocol

import torch

from specprobe.infer.engines.base import EngineStats
from specprobe.infer.engines.device_sampling import outside_nucleus

TokenSpecMethod = Literal["ngram", "assistant", "lookahead"]


@dataclass(frozen=True)
class LookaheadConfig:
    """Window W, n-gram size N, verification candidates G (the paper: W = 15, N = 5, G = W for a 7B model
    on an A100; smaller windows suit smaller accelerators, as its Table 1 shows)."""

    window: int = 15
    ngram: int = 5
    max_verify: int | None = None  # G; None means G = W
    seed: int = 0  # initial window guesses are drawn from the prompt with this seed (a batch row: its own, mixed)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"lookahead window W must be >= 1, got {self.window}")
        if self.ngram < 2:
            raise ValueError(f"lookahead n-gram size N must be >= 2, got {self.ngram}")
        if self.max_verify is not None and self.max_verify < 0:
            raise ValueError(f"lookahead max_verify G must be >= 0, got {self.max_verify}")

    @property
    def guesses(self) -> int:
        return self.window if self.max_verify is None else self.max_verify


@dataclass(frozen=True)
class TokenSpecConfig:
    """How a step engine speculates tokens inside a step (`StepEngine.with_token_spec`): prompt lookup, an
    assistant model, or Lookahead Decoding (its Jacobi window and n-gram pool; `lookahead` holds its
    `LookaheadConfig`, None: the paper's defaults). num_tokens caps the proposal's depth;
    Lookahead Decoding's n-grams are N - 1 deep at most."""

    method: TokenSpecMethod = "ngram"
    num_tokens: int = 8  # proposed tokens per round (LR's n-gram setting: 8)
    ngram_size: int = 3  # longest n-gram matched by prompt lookup; shorter ones are tried down to min_ngram
    min_ngram: int = 1
    lookahead: LookaheadConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "assistant", "lookahead"):
            raise ValueError(f"token speculation method must be 'ngram', 'assistant' or 'lookahead', "
                             f"got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.ngram_size:
            raise ValueError(f"need 1 <= min_ngram <= ngram_size, got {self.min_ngram} and {self.ngram_size}")


# ----------------------------------------------------------------------------- proposals
def ngram_propose(context: Sequence[int], max_ngram: int, k: int, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens and return
    (up to) k tokens that followed it. n goes from max_ngram down to min_ngram; [] when nothing matches."""
    if k < 1:
        return []
    ctx = list(context)
    size = len(ctx)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = ctx[size - n:]
        first = tail[0]
        # candidate starts i < size - n (the tail itself excluded), newest first
        for i in range(size - n - 1, -1, -1):
            if ctx[i] == first and ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k]
    return []


@dataclass(frozen=True)
class SideBranch:
    """Tokens a proposer feeds beside its tree in the verification forward, to read the target's outputs on
    them (Lookahead Decoding's Jacobi window): `allowed` (s, s) says which of them each one sees (each sees the
    whole context besides, never the tree), `offsets` their positions after the current token. They are never
    accepted: their KV is dropped after the forward."""

    tokens: tuple[int, ...]
    allowed: torch.Tensor = field(compare=False)
    offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        s = len(self.tokens)
        if tuple(self.allowed.shape) != (s, s) or len(self.offsets) != s:
            raise ValueError(f"a side branch of {s} tokens needs allowed of shape ({s}, {s}) and {s} offsets, got "
                             f"{tuple(self.allowed.shape)} and {len(self.offsets)}")


@dataclass(frozen=True)
class DraftTree:
    """What every token proposer returns: proposed tokens as a tree after the context.

    Node i holds tokens[i] and hangs below parents[i] (-1: the root, i.e. the context's last token); a
    parent always comes before its children. A chain has parents -1, 0, 1, ...; a trie of candidate
    sequences merges their common prefixes; SEED's trees have several children per node. q: the draft's
    distribution after node u (key -1: the root) when children were sampled from it, None when the
    proposals are deterministic. side: tokens fed beside the tree for the proposer's own use (`SideBranch`).
    Verification: `verify_tree`.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    q: dict | None = None
    side: SideBranch | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token, got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"draft tree parents must come before their children, got {list(self.parents)}")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def trie(cls, candidates: Sequence[Sequence[int]]) -> DraftTree:
        """Candidate sequences merged on common prefixes; children keep the order of first appearance
        (the order in which sampling tries them)."""
        tokens, parents, index = [], [], {}
        for cand in candidates:
            u = -1
            for t in cand:
                key = (u, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(u)
                u = index[key]
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Proposed tokens in one causal run (no branches, no side branch): a batch row verifies it with a
        plain causal mask."""
        return self.side is None and self.parents == tuple(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Depth of every node (1 below the root)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def reach(self) -> int:
        """How far after the current token its furthest token sits (depths, side-branch offsets); 0 when empty."""
        return max(self.depths() + ([] if self.side is None else list(self.side.offsets)), default=0)

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
        return kids

    def ancestry(self) -> torch.Tensor:
        """(m, m) bool tree-attention pattern: [i, j] is True when node j is node i or one of its ancestors
        (one tensor per tree shape, shared: callers copy it, never modify it)."""
        return _ancestry(self.parents)


@lru_cache(maxsize=256)  # SEED drafts one shape every round; Lookahead Decoding's tries repeat too
def _ancestry(parents: tuple[int, ...]) -> torch.Tensor:
    m = len(parents)
    allowed = torch.zeros((m, m), dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parents[j]
    return allowed


def block_layout(tree: DraftTree, cur_pos: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(tokens, allowed (m, m) bool, position ids (m,)) of the speculative block of one verification forward:
    the tree's nodes (each sees its ancestors and itself), then the side branch's tokens. cur_pos is the
    position of the current token (the context's last); the block sees the whole context besides. The side
    branch comes last so that a batch can crop it with the rejected tail."""
    side, t = tree.side, len(tree)
    m = t + (0 if side is None else len(side.tokens))
    allowed = torch.zeros((m, m), dtype=torch.bool)
    pos = torch.empty(m, dtype=torch.long)
    if t:
        allowed[:t, :t] = tree.ancestry()
        pos[:t] = torch.tensor([cur_pos + d for d in tree.depths()], dtype=torch.long)
    if side is not None:
        allowed[t:, t:] = side.allowed
        pos[t:] = torch.tensor([cur_pos + o for o in side.offsets], dtype=torch.long)
    return list(tree.tokens) + ([] if side is None else list(side.tokens)), allowed, pos


def bounded_proposal(proposer: Proposer, context: Sequence[int], k: int, pos: int, max_length: int | None,
                     stats: EngineStats | None) -> DraftTree:
    """A batch row's proposal (either decode path): none when k < 1, a chain cut to k tokens, and none when its
    furthest token (a side branch reaches past k) would sit at or past the model's last position; `pos` is the
    current token's position."""
    tree = proposer.propose(context, k, stats) if k > 0 else DraftTree()
    if tree.is_chain and len(tree) > k:
        tree = replace(tree, tokens=tree.tokens[:k], parents=tree.parents[:k])
    if max_length is not None and pos + tree.reach() >= max_length:
        return DraftTree()
    return tree


class Proposer(Protocol):
    """A token-level proposer (vLLM spec_decode's proposer role): prompt lookup, an assistant model, Lookahead
    Decoding's Jacobi pool, SEED's draft trees. Verification is `verify_tree`, whatever the proposer."""

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None) -> DraftTree:
        """Tokens that might follow `context` (token ids of the target's tokenizer), at most k deep; model
        work is added to `stats.proposer_forward_passes`."""
        ...

    def fork(self, seed: int | None) -> Proposer:
        """The proposer for one more sequence: itself when it keeps no state per sequence, else a fresh one
        (seeded with the sequence's seed where it draws anything)."""
        ...

    def observe(self, tree: DraftTree, side_logits: torch.Tensor) -> None:
        """The target's logits (s, vocab) on the side branch of the tree this proposer last proposed."""
        ...


class NoSideBranch:
    """Proposers that feed no side branch: nothing to observe."""

    def observe(self, tree: DraftTree, side_logits: torch.Tensor) -> None:
        raise ValueError(f"{type(self).__name__} proposes no side branch; nothing to observe")


class StatelessProposer(NoSideBranch):
    """Proposers that keep nothing per sequence and feed no side branch."""

    def fork(self, seed: int | None) -> StatelessProposer:
        return self


class NgramProposer(StatelessProposer):
    """Prompt-lookup proposals (no model)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> DraftTree:
        return DraftTree.chain(ngram_propose(context, self.max_ngram, k, self.min_ngram))


class AssistantProposer(StatelessProposer):
    """Greedy proposals from a smaller model with the same tokenizer (an HFStepEngine).

    The assistant's prefix cache makes each round incremental: only the tokens added since the last
    round are encoded before the k greedy tokens are decoded.
    """

    def __init__(self, assistant, target_tokenizer_id: str):
        if assistant.info.tokenizer_id != target_tokenizer_id:
            raise ValueError(
                f"assistant speculation needs the draft and target to share a tokenizer; "
                f"{assistant.info.model_id!r} has a different vocabulary. Use token_spec=ngram instead.")
        self.assistant = assistant

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> DraftTree:
        own = EngineStats()
        out = self.assistant.greedy_continue(list(context), k, own)
        if stats is not None:
            stats.proposer_forward_passes += own.forward_passes
        return DraftTree.chain(out)


# ----------------------------------------------------------------------------- distributions
def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), restricted to the top-p nucleus and
    renormalised. Works on (..., vocab); temperature must be > 0 (greedy has no distribution)."""
    if temperature <= 0:
        raise ValueError("filtered_probs needs temperature > 0; greedy decoding uses argmax")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    # The nucleus is usually a few tokens: sort only the top 64 when they hold top_p of the mass
    # (a full vocabulary sort costs milliseconds per token on a CPU).
    top_p_vals, order = probs.topk(min(64, probs.shape[-1]), dim=-1)
    if not bool((top_p_vals.sum(-1) >= top_p).all()):  # a flat distribution: sort everything
        top_p_vals, order = probs.sort(-1, descending=True)
    kept = top_p_vals.masked_fill(outside_nucleus(top_p_vals, top_p), 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, kept)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution by inverting its CDF with one uniform (much cheaper on a CPU
    than torch.multinomial for a large vocabulary). Tokens of probability 0 are never drawn."""
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u[None], right=True)[0]), probs.shape[0] - 1)


# ----------------------------------------------------------------------------- verification
def greedy_path(tree: DraftTree, argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """`verify_tree` at temperature 0 from the target's argmax per logits row (host ints, so that a batch can
    copy every row's argmax to the host at once): follow the child equal to the argmax; at a mismatch or a leaf
    append the argmax."""
    kids = tree.children()
    u, out, nodes = -1, [], []
    while True:
        best = int(argmax[u + 1])
        nxt = next((c for c in kids.get(u, ()) if tree.tokens[c] == best), None)
        out.append(best)
        nodes.append(-2 if nxt is None else nxt)
        if nxt is None:
            return out, nodes
        u = nxt


def _walk_sampled(tree: DraftTree, probs: Callable[[int], torch.Tensor],
                  generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Multi-candidate speculative sampling down the tree (see `verify_tree`); probs(i): row i's p."""
    kids = tree.children()
    u, out, nodes = -1, [], []
    while True:
        p = probs(u + 1)
        if u not in kids:  # a leaf: bonus token
            out.append(sample_from(p, generator))
            nodes.append(-2)
            return out, nodes
        residual, total, nxt = p, 1.0, None
        q = None if tree.q is None else tree.q[u].detach().float().cpu()
        for c in kids[u]:
            x = tree.tokens[c]
            ratio = float(residual[x]) / total if q is None else min(1.0, float(residual[x]) / max(float(q[x]), 1e-30))
            if float(torch.rand((), generator=generator)) < ratio:
                nxt = c
                break
            if q is None:  # a deterministic proposal: remove it, keep the rest (unnormalised, mass `total`)
                residual = residual.clone()
                residual[x] = 0.0
                total = float(residual.sum())
                if total <= 0.0:  # x held all the mass (p(x) == 1 up to rounding): it is the only possible token
                    nxt = c
                    break
            else:  # a draw from q: the residual norm(max(p' - q, 0))
                residual = torch.clamp(residual - q, min=0.0)
                total = float(residual.sum())
                residual, total = (residual / total, 1.0) if total > 0 else (p.clone(), 1.0)
        if nxt is None:  # every child rejected: draw from what is left
            out.append(sample_from(residual, generator))
            nodes.append(-2)
            return out, nodes
        out.append(tree.tokens[nxt])
        nodes.append(nxt)
        u = nxt


def verify_tree(tree: DraftTree, logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """The one verification rule of every token proposer: (accepted tokens plus one, node of each token or -2
    for the token the target drew itself).

    logits: (len(tree) + 1, vocab); row 0 is the target after the context, row i + 1 after the context and
    node i's path. Greedy (temperature 0): follow the child equal to the target's argmax; at a mismatch or a
    leaf append the argmax (exactly the target's greedy output). Sampling, p' starting as the target's
    filtered distribution p at the node: try the children in order, accepting child x with probability
    p'(x) when the proposals are deterministic (`tree.q` None: prompt lookup, an assistant's greedy tokens,
    a Jacobi pool) and then removing x from p'; with min(1, p'(x) / q(x)) when they were drawn i.i.d. from the
    draft's q (SEED), then p' <- norm(max(p' - q, 0)). With every child rejected draw from p'; at a leaf draw a
    bonus token from p. Every token is distributed as the target's p. On a chain with deterministic
    proposals this is the longest accepted prefix plus one token (standard speculative sampling at q = 1)."""
    if logits.ndim != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"logits must be (len(tree) + 1, vocab) = ({len(tree) + 1}, V), got {tuple(logits.shape)}")
    if temperature <= 0:
        return greedy_path(tree, logits.argmax(-1).tolist())
    rows: dict[int, torch.Tensor] = {}

    def probs(i: int) -> torch.Tensor:  # only the rows the walk reaches (a trie's path, not its 60 nodes)
        if i not in rows:
            rows[i] = filtered_probs(logits[i], temperature, top_p).detach().float().cpu()
        return rows[i]

    return _walk_sampled(tree, probs, generator)


def drawn_rows(nodes: Sequence[int]) -> list[int]:
    """The logits row each token of a verified path was drawn from (`verify_tree`'s nodes: row 0 after the
    context, row u + 1 after node u): the first after the context, each next one after the node before it."""
    return [0] + [u + 1 for u in nodes[:-1]]


def path_logprobs(chunk: Sequence[int], nodes: Sequence[int], logits: torch.Tensor) -> list[float]:
    """Log-probability of each token of a verified path under the target's unmodified distribution."""
    lsm = torch.log_softmax(logits[drawn_rows(nodes)].float(), -1)
    return [float(lsm[j, tok]) for j, tok in enumerate(chunk)]


def draw_tokens(proposal: Sequence[int], logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> list[int]:
    """The accepted proposal prefix plus one new token, from one row's logits (len(proposal) + 1, vocab):
    `verify_tree` on a chain, with one uniform draw per token from the row's own generator (so a row's draws
    never depend on the other rows of a batch). No proposal: the argmax, or one draw from p."""
    return verify_tree(DraftTree.chain(proposal), logits, temperature, top_p, generator)[0]
