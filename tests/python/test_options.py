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
