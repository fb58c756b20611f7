"""Faithful re-implementations of the anchors' routing policies, for comparison.

Each class states the rule it follows and the source file and version it was read from
(listed in docs/reference.md section 5). They take the same inputs as our
policies (``RouteRequest``, ``Candidate``) plus what each anchor looks at: the prompt's
characters (SGLang, Ray), the first user message (KubeAI), the engine's waiting queue and KV
usage (llm-d), the router-tracked prefill and decode load (Dynamo). Policies that learn from
their own decisions (radix trees) do so in ``on_routed``. Selectable by name like the others
(``router.policy.make_policy``), and driven by the virtual-time simulator in ``loadtest/``.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

import xxhash

from router.policy.base import Candidate, Decision, Policy, RouteRequest


# --- a character radix tree with tenants (SGLang's and Ray's prefix trees) -------------------
@dataclass(eq=False)
class _Node:
    text: str = ""
    children: dict = field(default_factory=dict)       # first char -> _Node
    tenants: dict = field(default_factory=dict)         # tenant -> last access time
    parent: "_Node | None" = None


class CharRadixTree:
    """Radix tree over characters; each node records which tenants (replicas) inserted text
    through it and when. ``match`` returns the matched character count and the tenants of the
    deepest node reached (a partially matched edge counts its shared characters, and that
    node's tenants), as both anchors' ``prefix_match`` do."""

    def __init__(self):
        self.root = _Node()
        self.char_count: dict[str, int] = {}

    def insert(self, text: str, tenant: str, now: float) -> None:
        node = self.root
        node.tenants[tenant] = now
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                new = _Node(text[i:], parent=node)
                new.tenants[tenant] = now
                node.children[text[i]] = new
                self.char_count[tenant] = self.char_count.get(tenant, 0) + len(text) - i
                return
            k = _common(child.text, text, i)
            if k < len(child.text):  # split the edge
                mid = _Node(child.text[:k], parent=node, tenants=dict(child.tenants))
                child.text = child.text[k:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[text[i]] = mid
                child = mid
            if tenant not in child.tenants:
                self.char_count[tenant] = self.char_count.get(tenant, 0) + len(child.text)
            child.tenants[tenant] = now
            node = child
            i += k

    def match(self, text: str, allowed: set[str] | None = None
              ) -> tuple[int, list[str]]:
        """(matched characters, tenants at the deepest node reached). With ``allowed``, the
        walk follows only nodes owned by one of them (Ray's candidate restriction)."""
        node, i = self.root, 0
        tenants = list(node.tenants)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            owners = [t for t in child.tenants if allowed is None or t in allowed]
            if not owners:
                break
            k = _common(child.text, text, i)
            i += k
            tenants = owners
            node = child
            if k < len(child.text):
                break
        return i, tenants

    def remove_tenant(self, tenant: str) -> None:
        stack = [self.root]
        while stack:
            n = stack.pop()
            n.tenants.pop(tenant, None)
            stack.extend(n.children.values())
        self.char_count.pop(tenant, None)

    def evict_tenant(self, tenant: str, max_chars: int) -> None:
        """Drop the tenant's least recently used leaves until it owns at most ``max_chars``."""
        while self.char_count.get(tenant, 0) > max_chars:
            leaf = self._lru_leaf(tenant)
            if leaf is None:
                return
            del leaf.tenants[tenant]
            self.char_count[tenant] -= len(leaf.text)
            if not leaf.tenants and leaf.parent is not None and not leaf.children:
                del leaf.parent.children[leaf.text[0]]

    def _lru_leaf(self, tenant: str) -> _Node | None:
        best, best_t = None, math.inf
        stack = [self.root]
        while stack:
            n = stack.pop()
            owned_children = [c for c in n.children.values() if tenant in c.tenants]
            if n is not self.root and tenant in n.tenants and not owned_children:
                if n.tenants[tenant] < best_t:
                    best, best_t = n, n.tenants[tenant]
            stack.extend(owned_children)
        return best


def _common(edge: str, text: str, start: int) -> int:
    k = 0
    n = min(len(edge), len(text) - start)
    while k < n and edge[k] == text[start + k]:
        k += 1
    return k


# --- SGLang cache_aware -----------------------------------------------------------------------
class SGLangCacheAware(Policy):
    """SGLang Model Gateway ``cache_aware`` (lightseekorg/smg @73da68c,
    ``model_gateway/src/policies/cache_aware.rs``; CLI defaults of ``main.rs``).

    Per request over healthy workers: load = the gateway's in-flight count. Imbalanced if
    ``max_load - min_load > balance_abs_threshold`` and ``max_load > balance_rel_threshold *
    min_load``; then the min-load worker (lexicographic ``(load, processed_requests, index)``)
    takes it. Otherwise walk the shared character radix tree: if ``matched / len(text) >
    cache_threshold``, the tenant of the deepest node reached (its last tenant), else the
    min-load worker. The text is inserted under the chosen worker either way. Eviction: every
    ``eviction_interval_s`` each tenant is cut to ``max_tree_size`` characters.
    """

    name = "sglang_cache_aware"
    uses_text = True

    def __init__(self, rng: random.Random | None = None, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 eviction_interval_s: float = 120.0, max_tree_size: int = 67_108_864):
        super().__init__(rng)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.tree = CharRadixTree()
        self.processed: dict[str, int] = {}
        self.now = 0.0
        self._last_eviction = 0.0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        loads = [c.load.inflight for c in candidates]
        min_c = min(range(len(candidates)), key=lambda i: (
            loads[i], self.processed.get(candidates[i].replica, 0), i))
        imbalanced = (max(loads) - min(loads) > self.balance_abs
                      and max(loads) > self.balance_rel * min(loads))
        pick = candidates[min_c].replica
        if not imbalanced and request.text:
            matched, tenants = self.tree.match(request.text)
            rate = matched / len(request.text)
            if rate > self.cache_threshold and tenants:
                node_tenants = [t for t in tenants if t in {c.replica for c in candidates}]
                if node_tenants:
                    pick = max(node_tenants, key=lambda t: self._last_access(request.text, t))
        ranked = [pick] + [c.replica for c in candidates if c.replica != pick]
        return Decision(ranked, "cache" if pick != candidates[min_c].replica else "load",
                        self._predicted(request, candidates))

    def _last_access(self, text: str, tenant: str) -> float:
        node, i = self.tree.root, 0
        t = node.tenants.get(tenant, 0.0)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or tenant not in child.tenants:
                break
            t = child.tenants[tenant]
            i += _common(child.text, text, i)
            node = child
        return t

    def on_routed(self, request: RouteRequest, replica: str, now: float) -> None:
        self.now = now
        self.processed[replica] = self.processed.get(replica, 0) + 1
        if request.text:
            self.tree.insert(request.text, replica, now)
        if now - self._last_eviction >= self.eviction_interval_s:
            self._last_eviction = now
            for tenant in list(self.tree.char_count):
                self.tree.evict_tenant(tenant, self.max_tree_size)


# --- Ray Serve PrefixCacheAffinityRouter ----------------------------------------------------------
class RayPrefixCacheAffinity(Policy):
    """Ray Serve 2.60 ``PrefixCacheAffinityRouter`` with its defaults
    (``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py``).

    Queue lengths (Serve's in-flight count per replica); imbalanced if ``max - min >
    imbalanced_threshold`` (default infinite: never) → power of two. Otherwise match the
    prompt's characters in the shared tree restricted to the candidates: if
    ``matched / len(text) < match_rate_threshold`` (0.1), the tenants with the fewest
    characters in the whole tree; else the tenants of the node reached. Serve then takes the
    lowest queue length among them (ties: list order). The prompt text is inserted for the
    replica the request was routed to. No eviction by default.
    """

    name = "ray_prefix_affinity"
    uses_text = True

    def __init__(self, rng: random.Random | None = None, imbalanced_threshold: float = math.inf,
                 match_rate_threshold: float = 0.1):
        super().__init__(rng)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = CharRadixTree()

    def _pow2(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        pair = self.rng.sample(list(candidates), min(2, len(candidates)))
        return sorted(pair, key=lambda c: c.load.inflight)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        by_id = {c.replica: c for c in candidates}
        for c in candidates:
            self.tree.char_count.setdefault(c.replica, 0)
        loads = [c.load.inflight for c in candidates]
        chosen: list[Candidate] = []
        if max(loads) - min(loads) <= self.imbalanced_threshold and request.text:
            matched, tenants = self.tree.match(request.text, set(by_id))
            if matched / len(request.text) < self.match_rate_threshold:
                counts = {t: n for t, n in self.tree.char_count.items()}
                smallest = min(counts.values())
                chosen = [by_id[t] for t in counts if counts[t] == smallest and t in by_id]
            else:
                chosen = [by_id[t] for t in tenants if t in by_id]
        if not chosen:
            chosen = self._pow2(candidates)
        best = min(chosen, key=lambda c: c.load.inflight)  # Serve: lowest queue, list order
        ranked = [best.replica] + [c.replica for c in candidates if c.replica != best.replica]
        return Decision(ranked, "cache", self._predicted(request, candidates))

    def on_routed(self, request: RouteRequest, replica: str, now: float) -> None:
        if request.text:
            self.tree.insert(request.text, replica, now)


# --- NVIDIA Dynamo KV router cost ------------------------------------------------------------------
class DynamoKVCost(Policy):
    """NVIDIA Dynamo's KV router cost with its defaults (ai-dynamo/dynamo
    ``lib/kv-router/src/scheduling/selector/default.rs`` ``worker_logit``, commit 07a6c9c;
    ``config.rs`` defaults).

    ``cost_w = prefill_load_scale * max((active_prefill_tokens_w + L) / B - overlap_w, 0)
    + decode_blocks_w``, overlap from the exact (event-fed) index in blocks, decode blocks =
    the KV blocks of w's active requests plus the new request's; temperature 0: the minimum
    cost, exact ties broken uniformly at random.
    """

    name = "dynamo_kv"
    uses_index = True

    def __init__(self, rng: random.Random | None = None, overlap_score_credit: float = 1.0,
                 prefill_load_scale: float = 1.0):
        super().__init__(rng)
        self.credit = overlap_score_credit
        self.prefill_load_scale = prefill_load_scale

    def cost(self, request: RouteRequest, c: Candidate) -> float:
        bs = request.block_size
        raw = (c.load.prefill_tokens + request.prompt_tokens) / bs
        adjusted = max(raw - self.credit * c.matched_blocks, 0.0)
        decode_blocks = c.active_blocks + math.ceil(request.prompt_tokens / bs)
        return self.prefill_load_scale * adjusted + decode_blocks

    def choose(self, request, candidates):
        costs = {c.replica: self.cost(request, c) for c in candidates}
        best = min(costs.values())
        ties = [c.replica for c in candidates if costs[c.replica] == best]
        pick = self.rng.choice(ties)
        rest = sorted((c for c in candidates if c.replica != pick), key=lambda c: costs[c.replica])
        predicted = self._predicted(request, candidates)
        return Decision([pick] + [c.replica for c in rest],
                        "cache" if predicted[pick] else "load", predicted)


# --- llm-d weighted scorers ------------------------------------------------------------------------
class LlmdWeightedScorers(Policy):
    """llm-d inference scheduler's default profile (llm-d/llm-d-inference-scheduler @520af47,
    ``pkg/epp/config/loader/defaults.go``; scorers under ``pkg/epp/framework/plugins``), with
    the precise prefix scorer (exact index: ``matched_blocks / total_blocks``).

    ``S(e) = 3 * prefix + 2 * queue + 2 * kv``: queue = ``(max_q - q_e) / (max_q - min_q)``
    over the engines' waiting queues (1 for all when equal), kv = ``1 - kv_usage_e``. The
    max-score picker shuffles the candidates and stable-sorts by score: ties at random.
    """

    name = "llmd_weighted"
    uses_index = True

    def __init__(self, rng: random.Random | None = None, prefix_weight: float = 3.0,
                 queue_weight: float = 2.0, kv_weight: float = 2.0):
        super().__init__(rng)
        self.weights = (prefix_weight, queue_weight, kv_weight)

    def scores(self, request: RouteRequest, candidates: Sequence[Candidate]) -> dict[str, float]:
        qs = [c.waiting for c in candidates]
        lo, hi = min(qs), max(qs)
        wp, wq, wk = self.weights
        out = {}
        for c in candidates:
            prefix = c.matched_blocks / request.num_blocks if request.num_blocks else 0.0
            queue = 1.0 if hi == lo else (hi - c.waiting) / (hi - lo)
            kv = 1.0 - (c.kv_usage_frac or 0.0)
            out[c.replica] = (wp * min(max(prefix, 0), 1) + wq * min(max(queue, 0), 1)
                              + wk * min(max(kv, 0), 1))
        return out

    def choose(self, request, candidates):
        s = self.scores(request, candidates)
        order = list(candidates)
        self.rng.shuffle(order)
        order.sort(key=lambda c: -s[c.replica])  # stable: shuffled ties
        predicted = self._predicted(request, candidates)
        return Decision([c.replica for c in order],
                        "cache" if predicted[order[0].replica] else "load", predicted)


# --- KubeAI PrefixHash: consistent hashing with bounded load -----------------------------------------
class KubeAIPrefixHash(Policy):
    """KubeAI ``PrefixHash`` load balancing (substratusai/kubeai @2f32ef4,
    ``internal/loadbalancer/balance_chwbl.go``).

    Key = adapter name + the first ``prefix_char_length`` (100) runes of the first user
    message (completions: of the prompt). Ring: ``replication`` (256) points
    ``xxhash64(name + str(i))`` per endpoint. From the first point >= ``xxhash64(key)``
    clockwise, accept the first endpoint with ``inflight <= (total_inflight + 1) / n *
    mean_load_factor / 100`` (always when nothing is in flight); none → the first seen.
    """

    name = "kubeai_prefix_hash"
    uses_text = True

    def __init__(self, rng: random.Random | None = None, mean_load_factor: int = 125,
                 replication: int = 256, prefix_char_length: int = 100):
        super().__init__(rng)
        self.mean_load_factor = mean_load_factor
        self.replication = replication
        self.prefix_char_length = prefix_char_length
        self._ring_for: tuple = ()
        self._points: list[tuple[int, str]] = []

    def _ring(self, names: Sequence[str]) -> list[tuple[int, str]]:
        key = tuple(sorted(names))
        if key != self._ring_for:
            self._points = sorted((xxhash.xxh64_intdigest(f"{n}{i}".encode()), n)
                                  for n in key for i in range(self.replication))
            self._ring_for = key
        return self._points

    def choose(self, request, candidates):
        by_id = {c.replica: c for c in candidates}
        points = self._ring(list(by_id))
        key = (request.lora or "") + request.first_user_text[:self.prefix_char_length]
        h = xxhash.xxh64_intdigest(key.encode())
        start = bisect.bisect_left(points, (h, ""))
        total = sum(c.load.inflight for c in candidates)
        bound = (total + 1) / len(candidates) * self.mean_load_factor / 100
        default = None
        pick = None
        for k in range(len(points)):
            name = points[(start + k) % len(points)][1]
            default = default or name
            if total == 0 or by_id[name].load.inflight <= bound:
                pick = name
                break
        pick = pick or default
        ranked = [pick] + [c.replica for c in candidates if c.replica != pick]
        return Decision(ranked, "cache", self._predicted(request, candidates))


ANCHORS: tuple[type[Policy], ...] = (SGLangCacheAware, RayPrefixCacheAffinity, DynamoKVCost,
                                     LlmdWeightedScorers, KubeAIPrefixHash)
"""The anchors' policies (registered in ``router.policy``)."""
