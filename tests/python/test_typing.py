"""kvtier is typed: the stubs of the extension (python/kvtier/_kvtier.pyi) match the built
module (mypy's stubtest), typed code using the API passes mypy --strict while misuse is reported,
and the pure-Python modules type-check."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("mypy")
HERE = os.path.join(ROOT, "tests", "python", "typing")
# The cache lives in the venv (one per environment), so a second run checks only what changed.
CACHE = os.path.join(sys.prefix, ".mypy_cache")


def run(*args):
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def mypy(*args):
    return run("mypy", "--cache-dir", CACHE, *args)


def test_installed_package_is_typed():
    import kvtier

    pkg = os.path.dirname(kvtier.__file__)
    assert os.path.isfile(os.path.join(pkg, "py.typed"))
    assert os.path.isfile(os.path.join(pkg, "_kvtier.pyi"))


def test_stubs_match_the_extension():
    rc, out = run("mypy.stubtest", "--allowlist", os.path.join(HERE, "stubtest_allowlist.txt"), "kvtier._kvtier")
    assert rc == 0, out


def test_typed_usage_passes_strict_mypy():
    rc, out = mypy("--strict", os.path.join(HERE, "usage_ok.py"))
    assert rc == 0, out


def test_misuse_is_reported():
    rc, out = mypy("--strict", os.path.join(HERE, "usage_bad.py"))
    want = [i + 1 for i, line in enumerate(open(os.path.join(HERE, "usage_bad.py"))) if line.rstrip().endswith("# error")]
    got = sorted({int(m) for m in re.findall(r"usage_bad\.py:(\d+): error", out)})
    assert rc == 1 and got == want, out


def test_pure_python_modules_type_check():
    # torch and transformers are not analysed (pyproject.toml, [tool.mypy]): their types are Any.
    rc, out = mypy(os.path.join(ROOT, "python", "kvtier"))
    assert rc == 0, out
