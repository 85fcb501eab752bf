#!/usr/bin/env python3
"""Splits a perf profile of `kvtier run`'s decode steps into the parts of a step.

    perf script -i perf.data -F tid,ip,sym | scripts/profile_step.py

Each sample's call stack (innermost first) is assigned to the first part whose pattern one of
its frames matches, searching the frames innermost to outermost, so a sample inside the
attention kernel that the store called counts as attention. Samples of oneTBB worker threads
carry only their own frames; the patterns name the kernels they run. Samples outside
`Session::Attend` and outside every pattern (prefill leftovers, the end of the run, the job's
own bookkeeping) are "outside the step" and not part of the shares.
"""
import collections
import re
import sys

# (part, pattern over a frame's symbol); the first part with a matching frame wins, frames
# searched innermost first.
PARTS = [
    ("attention", r"kernels::Attention|SlotAttention|MainItem|AttentionPlan|AttendAndObserve|CpuAttentionBackend"),
    ("search: int8 screen", r"ExactChunkIndex::QuantizedScores|ExactChunkIndex::Screen|DotI8Blocks"),
    ("search: rerank", r"ExactChunkIndex::ScoresOf|ExactChunkIndex::Best|TopRowsAscending|TakeBest"),
    ("search: other", r"ExactChunkIndex::|ChunkIndex::|FaissChunkIndex"),
    ("index sync", r"Retriever::Sync|ChunkUpdatesSince"),
    ("budget allocation", r"BudgetAllocator|EntropyBudget|TopkBudget|SoftmaxEntropy"),
    ("probe", r"ProbeBuilder|MeanPoolProbe"),
    ("fetch: copies and cold reads", r"TransferEngine::CopyLoads|UploadBatch|CopyWithin|LowerTier|ColdTier::Get"),
    ("fetch: bookkeeping", r"TieredStore::FetchChunks|TieredStore::RunFetch|FetchHandle::Wait|AcquireHotSlot|HotRoomLocked"),
    ("release", r"FetchHandle::Release|ReleasePins|LayerParts::Release"),
    ("hot view", r"kvtier::GetHotView"),
    ("select: other", r"Retriever::Select"),
    ("attend: other", r"Session::Attend|Session::GatherFor"),
]
COMPILED = [(p, re.compile(rx)) for p, rx in PARTS]
IDLE = re.compile(r"sched_yield|do_sched_yield|futex|__schedule|tbb::detail::r1::")


def samples(lines):
    stack = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if stack:
                yield stack
            stack = []
            continue
        if line[0] not in " \t":
            if stack:
                yield stack
            stack = []
            continue
        parts = line.strip().split(None, 1)
        stack.append(parts[1] if len(parts) > 1 else "")
    if stack:
        yield stack


def main():
    counts = collections.Counter()
    total = 0
    for stack in samples(sys.stdin):
        total += 1
        part = None
        for frame in stack:
            for name, rx in COMPILED:
                if rx.search(frame):
                    part = name
                    break
            if part:
                break
        if part is None:
            part = "workers waiting (oneTBB)" if stack and IDLE.search(stack[0]) else "outside the step"
        counts[part] += 1
    inside = total - counts["outside the step"]
    print(f"{total} samples, {inside} in decode steps")
    print("| part | samples | share of the step |")
    print("|---|---|---|")
    order = [p for p, _ in PARTS] + ["workers waiting (oneTBB)"]
    for p in order:
        if counts[p]:
            print(f"| {p} | {counts[p]} | {100.0 * counts[p] / max(1, inside):.1f}% |")
    print(f"| (outside the step) | {counts['outside the step']} | - |")


if __name__ == "__main__":
    main()
