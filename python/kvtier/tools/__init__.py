"""kvtier.tools: the tools and benchmarks around the engine API, not part of it.

    python -m kvtier.tools.export_hf --out DIR      the shipped model as a transformers checkpoint
    python -m kvtier.tools.infinitebench ...        kvtier infinite's tasks through a checkpoint
    python -m kvtier.tools.decode_bench ...         transformers + kvtier against the C++ forward
    python -m kvtier.tools.plot REPORT.json ...     pictures of the CLI's JSON reports

CppLlama is the shipped model's C++ forward pass (the store `kvtier infinite` gives it);
make_samples(task, context, samples, seed) generates `kvtier infinite`'s prompts. The infbench_*
functions and InfBenchPredictions are ∞-Bench's task files, prompts, truncation, scoring and
resumable predictions, the code `kvtier infinite --data` runs.
"""
from .._kvtier import (  # noqa: F401
    CppLlama,
    InfBenchPredictions,
    infbench_ground_truth,
    infbench_max_new_tokens,
    infbench_prompt,
    infbench_read,
    infbench_rouge_lsum,
    infbench_score,
    infbench_truncate,
    make_samples,
)

__all__ = ["CppLlama", "make_samples", "InfBenchPredictions", "infbench_ground_truth", "infbench_max_new_tokens",
           "infbench_prompt", "infbench_read", "infbench_rouge_lsum", "infbench_score", "infbench_truncate"]
