"""The keyword arguments of Store and Session.open/attach in the stubs (python/kvtier/_kvtier.pyi)
against the engine's option table (engine/option_table.h, exported as kvtier._kvtier.option_table()):
the same names in the same order, with the table's types and defaults; and the binding refuses a
value outside a row's range with the row's message."""
import ast
import os

import pytest

import kvtier
from conftest import ROOT

STUB = os.path.join(ROOT, "python", "kvtier", "_kvtier.pyi")
PY_TYPE = {"int": "int", "bytes": "int", "bool": "bool", "double": "float", "string": "str", "choice": "str"}


def stub_kwonly(cls, method):
    tree = ast.parse(open(STUB).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    return [(a.arg, ast.unparse(a.annotation), d) for a, d in zip(f.args.kwonlyargs, f.args.kw_defaults)]
    raise AssertionError(f"{cls}.{method} not in {STUB}")


def rows(struct):
    return [r for r in kvtier._kvtier.option_table() if r["struct"] == struct]


def check(args, table):
    assert [a[0] for a in args] == [r["name"] for r in table]
    for (name, annotation, default), r in zip(args, table):
        assert annotation == PY_TYPE[r["type"]], name
        value = ast.literal_eval(default)
        assert type(value) is type(r["default"]) and value == r["default"], (name, value, r["default"])


def test_store_stub_is_the_table():
    check(stub_kwonly("Store", "__init__"), rows("StoreOptions"))


@pytest.mark.parametrize("method", ["open", "attach"])
def test_session_stub_is_the_table(method):
    args = stub_kwonly("Session", method)
    assert [a[0] for a in args[:2]] == ["preset", "retrieval"]  # no rows: a preset name, a whole spec
    check(args[2:], rows("SessionOptions"))


def test_store_options_dict_has_every_row():
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16, dtype="f32") as store:
        o = store.options
        for r in rows("StoreOptions"):
            if r["name"] not in ("layers", "q_heads", "kv_heads", "head_dim", "dtype"):
                assert o[r["name"]] == r["default"], r["name"]


def test_range_errors_come_from_the_table():
    n_local = next(r for r in rows("StoreOptions") if r["name"] == "n_local")
    with pytest.raises(kvtier.InvalidArgument, match=rf"option 'n_local': 0 is outside \[{n_local['lo']}, {n_local['hi']}\]"):
        kvtier.Store(n_local=0)
    with pytest.raises(kvtier.InvalidArgument, match=r"option 'compression': expected none\|lz4\|zstd \(got 'gzip'\)"):
        kvtier.Store(compression="gzip")
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16) as store:
        with pytest.raises(kvtier.InvalidArgument, match="option 'rope_theta': expected a number"):
            kvtier.Session.open(store, rope_theta=True)


SPELLINGS = {"f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16", "bf16": "bf16", "bfloat16": "bf16",
             "f32": "f32", "fp32": "f32", "float32": "f32"}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_option_dtype_takes_the_usual_spellings(spelling):
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16, dtype=spelling) as store:
        assert store.options["dtype"] == SPELLINGS[spelling]


def test_option_dtype_error_lists_the_spellings():
    with pytest.raises(kvtier.InvalidArgument, match=r"option 'dtype': expected "
                       r"f16\|fp16\|float16\|half\|bf16\|bfloat16\|f32\|fp32\|float32 \(got 'fp8'\)"):
        kvtier.Store(dtype="fp8")


def test_option_defaults_are_the_structs():
    # One retrieval default: Session.open's options are the table's, alloc and index included.
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16) as store:
        with kvtier.Session.open(store) as s:
            for r in rows("SessionOptions"):
                assert s.options[r["name"]] == r["default"], r["name"]
    alloc = next(r for r in rows("SessionOptions") if r["name"] == "alloc")
    assert alloc["default"] == "entropy:rank=logit"


def test_option_budget_zero_opens_a_session():
    budget = next(r for r in rows("SessionOptions") if r["name"] == "budget_tokens")
    assert budget["lo"] == 0
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16) as store:
        with kvtier.Session.open(store, budget_tokens=0) as s:
            assert s.options["budget_tokens"] == 0
        with pytest.raises(kvtier.InvalidArgument, match=r"option 'budget_tokens': -1 is outside \[0, "):
            kvtier.Session.open(store, budget_tokens=-1)


def test_option_double_ranges_come_from_the_table():
    reuse = next(r for r in rows("SessionOptions") if r["name"] == "reuse_cosine")
    assert (reuse["dlo"], reuse["dhi"], reuse["dlo_open"]) == (0.0, 1.0, False)
    with kvtier.Store(layers=2, q_heads=4, kv_heads=2, head_dim=16) as store:
        with pytest.raises(kvtier.InvalidArgument, match=r"option 'reuse_cosine': 1.5 is outside \[0, 1\]"):
            kvtier.Session.open(store, reuse_cosine=1.5)
        with pytest.raises(kvtier.InvalidArgument, match=r"option 'rope_theta': 0 is outside \(0, inf\]"):
            kvtier.Session.open(store, rope_theta=0.0)


def test_option_size_store_is_the_library_sizing():
    geometry = dict(layers=4, q_heads=8, kv_heads=2, head_dim=16, dtype="fp32", chunk_size=16)
    cb = 16 * 2 * 2 * 16 * 4  # chunk_size * kv_heads * head_dim * (K and V) * 4 bytes
    size = kvtier.size_store(4096, 128, **geometry)
    assert size == {"hot_bytes": 33 * cb, "warm_bytes": 4 * 258 * cb}
    assert kvtier.size_store(4096, 128, False, **geometry)["hot_bytes"] == 258 * cb
    half = kvtier.size_store(4096, 128, **dict(geometry, dtype="half"))
    assert half == {"hot_bytes": 33 * cb // 2, "warm_bytes": 4 * 258 * cb // 2}
    with pytest.raises(kvtier.InvalidArgument, match="option 'chunk_size'"):
        kvtier.size_store(4096, 128, chunk_size=0)
