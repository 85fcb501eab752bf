"""The README's Python example runs verbatim (the block after <!-- python-example -->)."""
import os
import re

from conftest import ROOT


def readme_block(marker):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", text, re.S)
    assert m, f"README.md has no python block after {marker}"
    return m.group(1)


def test_readme_python_example_runs(capsys):
    code = readme_block("<!-- python-example -->")
    exec(compile(code, "README.md:python-example", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "chunks attended" in out
    assert "InvalidArgument" in out  # the example's bad append raised, with its code
