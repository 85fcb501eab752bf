"""Typed use of kvtier's API: tests/python/test_typing.py runs mypy --strict over it."""
from typing import Any, Dict, List

import numpy as np

import kvtier


def run() -> Dict[str, Any]:
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16, dtype="f32") as store:
        with kvtier.Session.open(store, retrieve=False, positions="absolute") as session:
            k = np.zeros((8, 2, 16), np.float32)
            session.append(0, k, k)
            session.begin_step("prefill")
            q = np.zeros((1, 4, 16), np.float32)
            out = np.empty_like(q)
            stats: Dict[str, Any] = session.attend(0, q, 7, out)
            seq: int = session.sequence
            chunks: List[List[int]] = session.last_chunks
        n: int = store.sequence_length(seq, 0)
        closed: bool = store.closed
    try:
        kvtier.Session.open(store)
    except kvtier.FailedPrecondition as e:
        code: str = e.code
        message: str = e.message
        assert isinstance(e, kvtier.Error)
    names: List[str] = kvtier.preset_names()
    version: str = kvtier.__version__
    return {"stats": stats, "n": n, "closed": closed, "chunks": chunks, "names": names, "version": version,
            "error": (code, message)}
