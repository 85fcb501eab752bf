"""Misuse mypy must report through the stubs (tests/python/test_typing.py): each line below
marked `# error` is one error; without the stubs kvtier would be Any and they would pass."""
import numpy as np

import kvtier

store = kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16)
session = kvtier.Session.open(store)
k = np.zeros((8, 2, 16), np.float32)
session.append("0", k, k)  # error
length: str = store.sequence_length(session.sequence, 0)  # error
store.clse()  # error
kvtier.Session.open(store).drop(1)  # error
