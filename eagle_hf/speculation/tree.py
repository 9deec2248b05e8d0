"""A round's draft tree (`DraftTree`) and its verification against the target: logits processing per node,
greedy and sampling acceptance.

Vocabulary (eagle_spec.md §6.3): `depth` draft levels, `top_k` children expanded per frontier node,
`total_tokens` verified tokens including the root. Node 0 is the root (the last token the target emitted);
nodes 1..N are drafts, parents before children. A chain is the tree with ``top_k=1``. Built by
`eagle_hf.speculation.drafting.draft_trees`. What the target keeps (as vLLM names it): *accepted* drafts, then
one token of its own: the *bonus* token after the last accepted draft, or the *recovered* token drawn from the
residual distribution when a draft is rejected.
"""

from __future__ import annotations

import array
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..programs import pack

#: the sources a draft node can come from (bits of `DraftTree.sources`; a node both proposed carries both)
EAGLE, COPY = 1, 2
SOURCE_NAMES = {EAGLE: "eagle", COPY: "copy"}


class DraftTree:
    """A round's draft tree. It lives on the host (`host`: Python lists, what acceptance walks); its tensors
    (`tokens`, `parents`, `scores`, `sources`) are made from the lists when first asked for (trees the loop
    builds every round never need them). Built from tensors (`DraftTree(tokens, parents, scores)`) or host
    lists (`of_lists`); scores are kept at float32, as a tree's tensors hold them."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                 sources: torch.Tensor | None = None):
        # tokens [N+1] target ids (tokens[0] the root); parents [N+1] parent node index (parents[0] = -1);
        # scores [N+1] cumulative draft log-probability (root 0); sources [N+1] bits EAGLE | COPY of who
        # proposed each node (None: all EAGLE)
        self.__dict__.update(tokens=tokens, parents=parents, scores=scores, sources=sources)
        self.host = _HostTree.of_lists(tokens.tolist(), parents.tolist(), scores.tolist(),
                                       None if sources is None else sources.tolist())
        self.all_eagle = sources is None

    @classmethod
    def root(cls, token: int) -> DraftTree:
        """The tree of a plain step: the root alone (the target decodes one token)."""
        return cls._of_host(_HostTree([token], [-1], [0.0], [EAGLE], [[]], [0]), all_eagle=True)

    @classmethod
    def of_lists(cls, tokens: list[int], parents: list[int], scores: list[float],
                 sources: list[int] | None = None) -> DraftTree:
        """A deterministic tree from host lists (node 0 the root, parents before children; `sources`: who proposed
        each node, default the drafter)."""
        host = _HostTree.of_lists(tokens, parents, array.array("f", scores).tolist(), sources)  # (float32)
        return cls._of_host(host, all_eagle=sources is None)

    @classmethod
    def _of_host(cls, host: _HostTree, all_eagle: bool) -> DraftTree:
        tree = cls.__new__(cls)
        tree.host, tree.all_eagle = host, all_eagle
        return tree

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.host.tokens)

    @functools.cached_property
    def parents(self) -> torch.Tensor:
        return torch.tensor(self.host.parents)

    @functools.cached_property
    def scores(self) -> torch.Tensor:
        return torch.tensor(self.host.scores)

    @functools.cached_property
    def sources(self) -> torch.Tensor | None:
        return None if self.all_eagle else torch.tensor(self.host.sources, dtype=torch.uint8)

    def source(self, node: int) -> int:
        return self.host.sources[node]

    def graft(self, other: DraftTree) -> DraftTree:
        """This tree with the nodes of `other`, a tree of the same root (the copy source's), below its root: a node
        both have is one, marked as proposed by both; `other`'s other nodes keep their own log-probabilities,
        added to their new parents' scores."""
        h, o = self.host, other.host
        tokens, parents, scores, sources = list(h.tokens), list(h.parents), list(h.scores), list(h.sources)
        child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
        node_of = [0]  # each of `other`'s nodes here
        for j in range(1, len(o.tokens)):
            parent, token = node_of[o.parents[j]], o.tokens[j]
            node = child.get((parent, token))
            if node is None:
                tokens.append(token), parents.append(parent), sources.append(o.sources[j])
                scores.append(scores[parent] + o.scores[j] - o.scores[o.parents[j]])
                node = child[(parent, token)] = len(tokens) - 1
            else:
                sources[node] |= o.sources[j]
            node_of.append(node)
        return DraftTree.of_lists(tokens, parents, scores, sources)

    @property
    def num_drafts(self) -> int:
        return self.size - 1

    def path_tokens(self, node: int) -> list[int]:
        """The draft tokens from the root (excluded) down to `node` (included)."""
        tokens = self.host.tokens
        return [tokens[n] for n in self.host.path(node)[1:]]

    def children(self, node: int) -> list[int]:
        return self.host.children[node]

    @property
    def size(self) -> int:
        return len(self.host.tokens)

    def depths(self) -> torch.Tensor:
        """[N+1] depth of each node (root 0)."""
        return torch.tensor(self.host.depths)

    def confidences(self) -> list[float]:
        """Per depth 1..D: the drafter's probability that one of the children of its best node at the depth
        above is right (the sibling mass a tree's verification can accept from)."""
        scores, out, node = self.host.scores, [], 0
        while children := self.children(node):
            out.append(min(1.0, sum(math.exp(scores[c] - scores[node]) for c in children)))
            node = max(children, key=lambda c: scores[c])
        return out

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths (one per leaf), in node order of their leaves."""
        h = self.host
        if self.size == 1:
            return [[0]]
        return [h.path(leaf) for leaf in range(1, self.size) if not h.children[leaf]]

    def retrieve_indices(self) -> torch.Tensor:
        """[num_leaves, max_depth+1] node paths, padded with -1 (the EAGLE reference's layout)."""
        paths = self.paths()
        width = max(len(p) for p in paths)
        return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)


@dataclass
class _HostTree:
    """A `DraftTree` as Python lists, with each node's children and depth and its path from the root."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    sources: list[int]
    children: list[list[int]]
    depths: list[int]

    @classmethod
    def of_lists(cls, tokens: list[int], parents: list[int], scores: list[float],
                 sources: list[int] | None = None) -> _HostTree:
        children: list[list[int]] = [[] for _ in parents]
        depths = [0] * len(parents)
        for i in range(1, len(parents)):  # parents before children
            children[parents[i]].append(i)
            depths[i] = depths[parents[i]] + 1
        return cls(tokens, parents, scores, [EAGLE] * len(parents) if sources is None else sources, children, depths)

    def path(self, node: int) -> list[int]:
        """Node ids from the root down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


# ------------------------------------------------------------------ verification
#: transformers' logits warpers that read the scores alone, never the ids: with only these (temperature, top-k,
#: top-p, ...), a tree's nodes need no ids built from the context (work proportional to its length, every round)
SCORES_ONLY = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                         "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper"})


def process_logits(logits_processor, prefix: torch.Tensor, paths: list[list[int]] | torch.Tensor,
                   logits: torch.Tensor, row: int = 0) -> torch.Tensor:
    """Apply the logits processors to each row of `logits` ([n, V]) with ``prefix + paths[row]`` as its input ids.

    Used for the target's logits at every tree node, and for the drafter's logits of every sampled draft, so
    that both follow the exact processing plain `generate()` applies (`paths`: host lists, or [n, d] device tokens
    of one length). prefix: [1, T], the call's batch row `row`
    (processors that hold a value per batch row see that row's, `per_row`). Warpers that read only the
    scores (`SCORES_ONLY`) process every row in one call on the prefix; otherwise the rows are processed in
    one call per path length (processors take a batch of equal-length ids), their paths copied to the device at
    once; a processor that reads the batch index (``prefix_allowed_tokens_fn``) gets one row at a time."""
    if len(logits_processor) == 0:
        return logits
    if any(type(p).__name__ in PER_ROW for p in logits_processor):
        return _process(per_row(logits_processor, row), prefix, paths, logits)
    return _process(logits_processor, prefix, paths, logits)


#: transformers' processors that hold a value per batch row (shaped for the call's batch, not a tree's nodes)
PER_ROW = frozenset({"RepetitionPenaltyLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor",
                     "EncoderNoRepeatNGramLogitsProcessor"})


def per_row(logits_processor, row: int):
    """`logits_processor` as batch row `row` alone sees it, for any number of ids rows: a callable like it."""

    def call(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        for p in logits_processor:
            name = type(p).__name__
            if name == "RepetitionPenaltyLogitsProcessor" and isinstance(p.prompt_ignore_length, torch.Tensor):
                kept = p.prompt_ignore_length
                p.prompt_ignore_length = kept[row : row + 1].to(input_ids.device).expand(n)
                scores = p(input_ids, scores)
                p.prompt_ignore_length = kept
            elif name == "EncoderRepetitionPenaltyLogitsProcessor":
                kept = p.encoder_input_ids
                p.encoder_input_ids = kept[row : row + 1].expand(n, -1)
                scores = p(input_ids, scores)
                p.encoder_input_ids = kept
            elif name == "EncoderNoRepeatNGramLogitsProcessor":
                kept = p.generated_ngrams, p.batch_size
                p.generated_ngrams, p.batch_size = [kept[0][row]] * n, n
                scores = p(input_ids, scores)
                p.generated_ngrams, p.batch_size = kept
            else:
                scores = p(input_ids, scores)
        return scores

    call.processors = list(logits_processor)  # (what `_process` inspects)
    return call


def _process(logits_processor, prefix: torch.Tensor, paths: list[list[int]] | torch.Tensor,
             logits: torch.Tensor) -> torch.Tensor:
    processors = getattr(logits_processor, "processors", logits_processor)
    if all(type(p).__name__ in SCORES_ONLY for p in processors):  # (sampling's warpers): no ids to build
        return logits_processor(prefix.expand(logits.shape[0], -1), logits)  # (a view: nothing copied)
    if isinstance(paths, torch.Tensor):  # [n, d] paths of one length, on the device already
        return logits_processor(torch.cat([prefix.expand(paths.shape[0], -1), paths.to(prefix.dtype)], 1), logits)
    if any(type(p).__name__ == "PrefixConstrainedLogitsProcessor" for p in processors):
        return _process_each(logits_processor, prefix, paths, logits)
    by_length: dict[int, list[int]] = {}
    for i, path in enumerate(paths):
        by_length.setdefault(len(path), []).append(i)
    if list(by_length) == [0]:  # no paths: the prefix for every row
        return logits_processor(prefix.expand(len(paths), -1), logits)
    arrays = {}
    for d, rows in by_length.items():
        arrays[f"rows{d}"] = rows
        if d:
            arrays[f"paths{d}"] = [paths[i] for i in rows]
    dev = pack(prefix.device, **arrays)
    out = torch.empty_like(logits)
    for d, rows in by_length.items():
        ids = prefix.expand(len(rows), -1)
        if d:
            ids = torch.cat([ids, dev[f"paths{d}"].to(prefix.dtype)], 1)  # [n_d, T + d]
        index = dev[f"rows{d}"]
        out.index_copy_(0, index, logits_processor(ids, logits.index_select(0, index)))
    return out


def _process_each(logits_processor, prefix, paths, logits) -> torch.Tensor:
    out = torch.empty_like(logits)
    for i, path in enumerate(paths):
        ids = torch.cat([prefix, torch.tensor([path], dtype=prefix.dtype, device=prefix.device)], 1) if path else prefix
        out[i : i + 1] = logits_processor(ids, logits[i : i + 1])
    return out


def accept_greedy(tree: DraftTree, target_tokens: Sequence[int]) -> list[int]:
    """Longest root path whose drafts equal the target's choice at their parent.

    target_tokens: [N+1] the target's (greedy) token after each node. Returns the accepted node path
    (root first); the bonus token is ``target_tokens[path[-1]]``.
    """
    if tree.size == 1:  # a plain step
        return [0]
    tokens, chosen = tree.host.tokens, [int(t) for t in target_tokens]
    best: list[int] = [0]
    for path in tree.paths():
        ok = [0]
        for node in path[1:]:
            if tokens[node] != chosen[ok[-1]]:
                break
            ok.append(node)
        if len(ok) > len(best):
            best = ok
    return best


#: tokens per block of the two-level draw (`draw`)
DRAW_BLOCK = 256


def greedy(scores: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token of `scores` [..., V] (as float32: a bf16 reduction is several times slower on a CPU)
    -> [...], the first maximum as ``argmax`` has it, found by ``max``: on a CPU a third of ``argmax``'s time at
    a 49k vocabulary (8 rows: 0.15 ms against 0.49 on a 2-core Xeon, one thread)."""
    return scores.float().max(-1).indices


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [n, V] (non-negative weights, not necessarily normalised, each row with some
    mass), by inverse transform in two levels: a block of `DRAW_BLOCK` tokens by the blocks' weights, then a token
    of that block by its own; [n], on the device. Exact to float64 rounding (the weights are summed in float64),
    and nothing of the vocabulary's size is allocated. On a CPU at a 49k vocabulary it takes ~0.04 ms a row
    against `torch.multinomial`'s ~0.85 ms (a sampled round's draws, one per node, had been a tenth of its
    time)."""
    n, v = probs.shape
    full = v // DRAW_BLOCK * DRAW_BLOCK
    weights = probs[:, :full].reshape(n, -1, DRAW_BLOCK).sum(-1, dtype=torch.float64)  # [n, v // DRAW_BLOCK]
    if full < v:  # the last, shorter block
        weights = torch.cat([weights, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    u = 1.0 - torch.rand(n, 2, dtype=torch.float64, device=probs.device, generator=generator)  # [n, 2] in (0, 1]
    block = _inverse(weights, u[:, :1])  # [n, 1]
    at = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)  # [n, DRAW_BLOCK] the block's tokens
    inside = torch.where(at < v, probs.gather(1, at.clamp(max=v - 1)).double(), 0.0)  # [n, DRAW_BLOCK]
    return (at.gather(1, _inverse(inside, u[:, 1:])))[:, 0]


def _inverse(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[n, 1] per row of `weights` [n, m] (float64) the first index whose cumulative weight reaches `u` [n, 1] in
    (0, 1] of the row's total: an index of weight 0 is never drawn."""
    cdf = weights.cumsum(-1)  # [n, m]
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=weights.shape[1] - 1)


def sampling_draws(probs: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Everything rejection sampling over a tree of deterministic drafts (recursive rejection across siblings,
    docs/concepts.md) needs from the device, drawn up front and read back with the round's one read: a flat
    float64 tensor of, per draft node i = 1..N (node order), the target's probability of its token at its parent
    ``P_parent(x_i)`` and a uniform u_i; then per node n = 0..N a token drawn from its *residual*: P_n without its
    children's tokens (P_n itself at a leaf, or where its children took all the mass). `accept_drawn` walks the
    tree with them on the host. probs: [N+1, V] the target's processed distribution after each node; parents,
    tokens: [N] each draft's parent node and token, on the device. (A sampled chain's drafts, drawn from the
    drafter's own distribution, are accepted by transformers' assisted loop with that distribution.)"""
    device = probs.device
    p_edge = probs[parents, tokens]  # [N]
    residual = probs.index_put((parents, tokens), torch.zeros_like(p_edge))  # [N+1, V]
    left = residual.sum(-1, keepdim=True)
    residual = torch.where(left > 0, residual, probs)
    drawn = draw(residual)  # [N+1]
    uniform = torch.rand(p_edge.shape, dtype=torch.float64, device=device)
    return torch.cat([p_edge.double(), uniform, drawn.double()])


def accept_drawn(tree: DraftTree, drawn: Sequence[float]) -> tuple[list[int], int]:
    """Rejection sampling over a tree of deterministic drafts from the values `sampling_draws` read back:
    (accepted node path, bonus or recovered token). At a node, its children are tried in node order: child x is
    accepted with probability ``P(x) / (1 - P(rejected siblings' tokens))`` (P renormalised after each
    rejection); when none is, the token is the node's residual draw."""
    h = tree.host
    n = tree.size - 1
    p_edge, uniform, residual = drawn[:n], drawn[n : 2 * n], drawn[2 * n :]
    node, path = 0, [0]
    while True:
        rejected, tried, accepted = 0.0, set(), None
        for child in h.children[node]:
            tok = h.tokens[child]
            if tok in tried:
                continue  # a duplicate of a rejected sibling: its probability is 0 now
            tried.add(tok)
            p = p_edge[child - 1] / (1.0 - rejected) if rejected < 1.0 else 0.0
            if uniform[child - 1] <= p:
                accepted = child
                break
            rejected += p_edge[child - 1]
        if accepted is None:
            return path, int(residual[node])
        path.append(accepted)
        node = accepted


def accept_paths(trees: Sequence[DraftTree], values: Sequence[float], sampled: bool, width: int | None = None,
                 columns: list[list[int]] | None = None) -> list[tuple[list[int], int]]:
    """Each row's acceptance from the round's read-back: (its accepted node path, root first; the token that follows
    it: the target's bonus token, or the recovered one). `values` hold, row after row, `width` values each (a
    batch's greedy verify: the target's token after each of its columns; `columns[b]`: each node's column, None:
    its own) or, where `width` is None, the row's own: the target's token after each node (greedy) or what
    `sampling_draws` drew (3N+1 for N drafts)."""
    out, at = [], 0
    for b, tree in enumerate(trees):
        n = width if width is not None else 3 * tree.size - 2 if sampled else tree.size
        mine = values[at : at + n]
        at += n
        if sampled:
            out.append(accept_drawn(tree, mine))
            continue
        chosen = [int(mine[c]) for c in (columns[b] if columns is not None else range(tree.size))]  # [N+1]
        path = accept_greedy(tree, chosen)
        out.append((path, chosen[path[-1]]))
    return out
