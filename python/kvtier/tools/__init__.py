"""kvtier.tools: the tools and benchmarks around the engine API, not part of it.

    python -m kvtier.tools.export_hf --out DIR      the shipped model as a transformers checkpoint
    python -m kvtier.tools.infinitebench ...        kvtier infinite's tasks through a checkpoint
    python -m kvtier.tools.decode_bench ...         transformers + kvtier against the C++ forward
    python -m kvtier.tools.plot REPORT.json ...     pictures of the CLI's JSON reports

CppLlama is the shipped model's C++ forward pass (the store `kvtier infinite` gives it);
make_samples(task, context, samples, seed) generates `kvtier infinite`'s prompts.
"""
from .._kvtier import CppLlama, make_samples  # noqa: F401

__all__ = ["CppLlama", "make_samples"]
