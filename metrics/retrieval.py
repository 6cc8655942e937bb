"""Retrieval against the expected documents: hit rate and mean reciprocal rank (MRR), per record.

The LlamaIndex seed's retrieval evaluation ("did the retriever find the source chunk, and how high"),
keyed by `doc_uri` as `document_recall` (`tracejudge.metrics.computed`) is: a retrieved chunk is a hit
when its `doc_uri` is one of the record's `expected_retrieved_context` URIs.

- `retrieval_hit_rate`: 1 when at least one retrieved chunk is a hit, else 0 (its mean over a dataset
  is the hit rate);
- `retrieval_mrr`: 1 / the rank of the first hit in retrieval order (1 for the first chunk), 0 when
  none is a hit (its mean over a dataset is the MRR).

The rank is the chunk's position in `retrieved_context` as retrieved: chunks without a `doc_uri`, and
other chunks of a document already seen, take a place too (they are what the app put above the hit).
Neither metric is computed when no expected chunk states a `doc_uri`; a record that retrieved nothing
scores 0 on both (the retriever found nothing that was expected).
"""

from __future__ import annotations

from tracejudge.schemas.record import EvalRecord

__all__ = ["RETRIEVAL_RANK_METRICS", "first_hit_rank", "retrieval_ranks"]

RETRIEVAL_RANK_METRICS = frozenset({"retrieval_hit_rate", "retrieval_mrr"})


def first_hit_rank(record: EvalRecord) -> int | None:
    """The 1-based position of the first retrieved chunk whose `doc_uri` is expected; 0 when none is;
    None when no expected chunk states a `doc_uri` (nothing to look for)."""
    expected = {d.doc_uri for d in record.expected_retrieved_context or () if d.doc_uri}
    if not expected:
        return None
    for rank, doc in enumerate(record.retrieved_context or (), start=1):
        if doc.doc_uri in expected:
            return rank
    return 0


def retrieval_ranks(record: EvalRecord) -> dict[str, float]:
    """`retrieval_hit_rate` and `retrieval_mrr` of one record; empty without expected URIs."""
    rank = first_hit_rank(record)
    if rank is None:
        return {}
    return {"retrieval_hit_rate": float(rank > 0), "retrieval_mrr": 1.0 / rank if rank else 0.0}
