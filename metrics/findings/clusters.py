"""Request clusters without a model: similar requests get the same cluster id, labelled by the words
that set the cluster apart.

`RequestClusterer` is incremental leader clustering, deterministic for a given order of requests: a
request's words (letters only, lower-cased, stop words dropped, digits never kept, at most
`max_request_chars` of text and `max_words` distinct words) are compared by Jaccard similarity with
each cluster's leader (the words of the request that opened it) that shares a word with it, found
through an inverted index; the request joins the most similar leader at or above `threshold` (the
earliest on a tie) or opens a new cluster. At `max_clusters` the least recently joined cluster is
forgotten (counted in `evicted`); its id may still be named by counts made before.

A cluster's id is "c" + 8 hex digits of a hash of its leader's words, so the same leader gets the same
id in every process. Its label (`label`) is its `label_words` most characteristic words: frequent in
the cluster (each word's document count is kept, at most `WORDS_PER_CLUSTER` per cluster) and rare in
the other clusters (TF-IDF across clusters). A word must occur in at least `LABEL_MIN_REQUESTS`
requests of the cluster, so a name or an id typed once never becomes a label.

`embed` is the hook for an embeddings endpoint (`models.ClusterModels.vector`): a function from a
request's text to its vector, or None when there is none (the endpoint failed, its budget was spent:
the request is then clustered by its words, as without an endpoint). A request with a vector is
compared by cosine similarity (`embedding_threshold`) with the leaders that have one and joins the
most similar (on a tie the first in the clusters' order, so it is deterministic for an input order);
one without is compared with the word leaders. Labels always come from the words. With `examples`,
each cluster keeps its first few request texts (cut to `EXAMPLE_CHARS`) for naming it
(`models.ClusterModels`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

__all__ = ["EXAMPLE_CHARS", "LABEL_MIN_REQUESTS", "STOP_WORDS", "WORDS_PER_CLUSTER", "ClusterOptions",
           "RequestClusterer", "words_of"]

# Characters of each example request a cluster keeps for naming it.
EXAMPLE_CHARS = 400
# Words kept per cluster for its label; past it the rarest half is forgotten.
WORDS_PER_CLUSTER = 64
# A label word occurs in at least this many of the cluster's requests.
LABEL_MIN_REQUESTS = 2
_WORD = re.compile(r"[^\W\d_]{2,30}")
STOP_WORDS = frozenset("""a an and are as at be but by can could did do does for from had has have how i if in
into is it its me my no not of on or our please so than that the their them then there these they this to
was we were what when where which who why will with would you your yours""".split())  # noqa: SIM905


def words_of(text: str, max_chars: int, max_words: int) -> frozenset[str]:
    """The distinct words of `text[:max_chars]` that can characterise a request, at most `max_words`
    (the first ones)."""
    out: dict[str, None] = {}
    for w in _WORD.findall(text[:max_chars].lower()):
        if w not in STOP_WORDS:
            out[w] = None
            if len(out) >= max_words:
                break
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """How requests are clustered (the `findings.clustering` keys)."""

    threshold: float = 0.5
    max_clusters: int = 1000
    max_request_chars: int = 2000
    max_words: int = 64
    label_words: int = 3
    embedding_threshold: float = 0.85
    # Example request texts kept per cluster (for naming it; 0: none).
    examples: int = 0


@dataclass(slots=True)
class _Cluster:
    id: str
    leader: frozenset[str]
    vector: Sequence[float] | None = None
    requests: int = 0
    words: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)


class RequestClusterer:
    """Assigns requests to clusters (`assign`) and names them (`label`); bounded by `max_clusters`."""

    def __init__(self, options: ClusterOptions | None = None,
                 embed: Callable[[str], Sequence[float] | None] | None = None) -> None:
        self.options = options or ClusterOptions()
        self.embed = embed
        self.clusters: OrderedDict[str, _Cluster] = OrderedDict()
        self._index: dict[str, set[str]] = {}
        self.evicted = 0

    def assign(self, text: str | None) -> str | None:
        """The cluster id of a request's text; None when it has no characteristic word."""
        if not text:
            return None
        o = self.options
        words = words_of(text, o.max_request_chars, o.max_words)
        if not words:
            return None
        vector = self.embed(text[:o.max_request_chars]) if self.embed is not None else None
        cluster = self._nearest(words) if vector is None else self._nearest_vector(vector, words)
        cluster.requests += 1
        if len(cluster.examples) < o.examples:
            cluster.examples.append(text[:EXAMPLE_CHARS])
        self.clusters.move_to_end(cluster.id)
        counts = cluster.words
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        if len(counts) > WORDS_PER_CLUSTER:
            keep = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:WORDS_PER_CLUSTER // 2]
            cluster.words = dict(keep)
        return cluster.id

    def _nearest(self, words: frozenset[str]) -> _Cluster:
        index, clusters, threshold = self._index, self.clusters, self.options.threshold
        # Prefix filter: a leader with Jaccard >= t shares at least t * |words| of the words, so it
        # shares one of any |words| - ceil(t * |words|) + 1 of them; probing with the rarest ones (the
        # shortest postings) finds every such leader without walking the postings of common words.
        postings = sorted((index[w] for w in words if w in index), key=len)
        # Words no leader has are the rarest of all: they take places in the probe and add no one.
        probe = len(words) - math.ceil(threshold * len(words) - 1e-9) + 1 - (len(words) - len(postings))
        candidates = set(chain.from_iterable(postings[:probe])) if probe > 0 else ()
        best, best_sim = None, threshold
        size = len(words)
        for cid in candidates:
            leader = clusters[cid].leader
            n = len(words & leader)
            sim = n / (size + len(leader) - n)
            if sim > best_sim or (sim == best_sim and (best is None or cid < best)):
                best, best_sim = cid, sim
        if best is not None:
            return self.clusters[best]
        return self._open(words, None)

    def _nearest_vector(self, vector: Sequence[float], words: frozenset[str]) -> _Cluster:
        vector = list(vector)
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
        best, best_sim = None, self.options.embedding_threshold
        for cid, cluster in self.clusters.items():
            if cluster.vector is None or len(cluster.vector) != len(vector):
                continue
            sim = sum(x * y for x, y in zip(vector, cluster.vector, strict=True))
            if sim > best_sim or (sim == best_sim and best is None):
                best, best_sim = cid, sim
        if best is not None:
            return self.clusters[best]
        return self._open(words, vector)

    def _open(self, words: frozenset[str], vector: Sequence[float] | None) -> _Cluster:
        digest = hashlib.blake2b(" ".join(sorted(words)).encode(), digest_size=4).hexdigest()
        cid = "c" + digest
        existing = self.clusters.get(cid)
        if existing is not None:  # the same leader words again (only after an eviction or with vectors)
            return existing
        while len(self.clusters) >= self.options.max_clusters:
            self._forget(next(iter(self.clusters)))
        cluster = self.clusters[cid] = _Cluster(cid, words, vector)
        if vector is None:
            for w in words:
                self._index.setdefault(w, set()).add(cid)
        return cluster

    def _forget(self, cid: str) -> None:
        cluster = self.clusters.pop(cid)
        for w in cluster.leader:
            ids = self._index.get(w)
            if ids is not None:
                ids.discard(cid)
                if not ids:
                    del self._index[w]
        self.evicted += 1

    def examples(self, cid: str) -> list[str]:
        """The first request texts of a cluster (`ClusterOptions.examples` of them at most)."""
        cluster = self.clusters.get(cid)
        return list(cluster.examples) if cluster is not None else []

    def label(self, cid: str) -> str | None:
        """The cluster's most characteristic words, comma-separated; None for a forgotten cluster or
        one without a word shared by `LABEL_MIN_REQUESTS` of its requests."""
        cluster = self.clusters.get(cid)
        if cluster is None or not cluster.requests:
            return None
        total = len(self.clusters)
        scored = []
        for w, n in cluster.words.items():
            if n < LABEL_MIN_REQUESTS:
                continue
            others = sum(1 for c in self.clusters.values() if w in c.words)
            scored.append((-(n / cluster.requests) * math.log(1.0 + total / others), w))
        scored.sort()
        return ", ".join(w for _, w in scored[:self.options.label_words]) or None
