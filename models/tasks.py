"""Infinity-Bench-style sample generators for kvtier-tiny (byte level, deterministic).

    make_sample(task, length_bytes, rng) -> (prompt_bytes, answer_bytes)

`rng` is a `random.Random`; the same seed gives the same samples. The byte
formats are documented in models/README.md ("Task formats") so the C++
evaluator can either re-implement them or read dumped samples:

    /usr/bin/python3 models/tasks.py --task passkey --length 1024 --samples 100 --seed 1 \
        --out /tmp/passkey_1024.jsonl

writes one JSON object per line: {"task", "length", "prompt", "answer"} with the
bytes as ISO-8859-1 (latin-1) strings (retrieval tasks are plain ASCII).

Tasks: passkey, number_string, kv_retrieval (retrieval; `len(prompt) + len(answer)
<= length_bytes`), text (ordinary Debian text, answer empty, prompt exactly
`length_bytes` bytes) and copy (training-only induction warm-up).
"""
import argparse
import glob
import json
import os
import random
import zlib

INTRO = (b"There is an important info hidden inside a lot of irrelevant text. "
         b"Find it and memorize it. I will quiz you about the important information there.\n")
FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
KV_INTRO = b"Below is a list of keys and values. Find the value of the key I will ask about.\n"

RETRIEVAL_TASKS = ("passkey", "number_string", "kv_retrieval")
TASKS = RETRIEVAL_TASKS + ("text", "copy")


def _digits(rng, n):
    return "".join(rng.choice("0123456789") for _ in range(n)).encode("ascii")


def _hex(rng, n):
    return "".join(rng.choice("0123456789abcdef") for _ in range(n)).encode("ascii")


def _haystack(needle, question, answer, length, rng):
    """INTRO + k filler lines + needle + (n - k) filler lines + question, where n is the
    largest number of whole filler lines that keeps prompt + answer within `length`
    and k is uniform in 0..n (needle depth)."""
    fixed = len(INTRO) + len(needle) + len(question) + len(answer)
    if fixed > length:
        raise ValueError("length %d is too short for the task (needs >= %d bytes)" % (length, fixed))
    n = (length - fixed) // len(FILLER)
    k = rng.randint(0, n)
    prompt = INTRO + FILLER * k + needle + FILLER * (n - k) + question
    return prompt, answer


def passkey(length, rng):
    key = _digits(rng, 5)
    needle = b"The pass key is " + key + b". Remember it. " + key + b" is the pass key.\n"
    return _haystack(needle, b"What is the pass key? The pass key is ", key, length, rng)


def number_string(length, rng):
    seq = _digits(rng, 10)
    needle = b"The sequence of digits is " + seq + b". Remember it. " + seq + b" is the sequence.\n"
    return _haystack(needle, b"What is the sequence of digits? The sequence of digits is ", seq, length, rng)


def kv_retrieval(length, rng):
    """KV_INTRO + N lines b"KEY: VALUE\\n" (distinct random 8-char lowercase hex keys, random
    8-char hex values; N as large as fits, at least 1) + question about one uniformly
    chosen key."""
    line_len = 8 + 2 + 8 + 1
    q_len = len(b"What is the value of key ") + 8 + len(b"? The value is ") + 8
    n = (length - len(KV_INTRO) - q_len) // line_len
    if n < 1:
        raise ValueError("length %d is too short for kv_retrieval" % length)
    keys, seen = [], set()
    while len(keys) < n:
        k = _hex(rng, 8)
        if k not in seen:
            seen.add(k)
            keys.append(k)
    values = [_hex(rng, 8) for _ in range(n)]
    i = rng.randrange(n)
    body = b"".join(k + b": " + v + b"\n" for k, v in zip(keys, values))
    prompt = KV_INTRO + body + b"What is the value of key " + keys[i] + b"? The value is "
    return prompt, values[i]


_CORPUS = {}


def text_files():
    """Debian text files used for ordinary next-byte prediction (sorted paths)."""
    paths = sorted(glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/*/copyright"))
    return [p for p in paths if os.path.isfile(p)]


def corpus(split):
    """Concatenation of the text files of a split: a file is in "test" when
    crc32(path) % 10 == 0, else in "train"."""
    if split not in _CORPUS:
        parts = []
        for p in text_files():
            if (zlib.crc32(p.encode()) % 10 == 0) == (split == "test"):
                with open(p, "rb") as f:
                    parts.append(f.read())
        _CORPUS[split] = b"\n".join(parts)
    return _CORPUS[split]


def text(length, rng, split="train"):
    data = corpus(split)
    start = rng.randrange(len(data) - length)
    return data[start:start + length], b""


def copy(length, rng):
    """Training-only induction warm-up: random strings of 8-40 chars (digits, lowercase,
    mixed) each written twice, b"S = S\\n", until `length` would be exceeded; the answer
    is the second copy of the last string."""
    out = b""
    while True:
        n = rng.randint(8, 40)
        if not out:
            n = min(n, (length - 4) // 2)  # the first string always fits (length >= 20)
        alphabet = rng.choice(["0123456789", "abcdefghijklmnopqrstuvwxyz", "0123456789abcdef"])
        s = "".join(rng.choice(alphabet) for _ in range(n)).encode("ascii")
        line = s + b" = " + s + b"\n"
        if len(out) + len(line) > length:
            break
        out += line
        last = s
    if not out:
        raise ValueError("length too short for copy")
    return out[:len(out) - len(last) - 1], last + b"\n"


def make_sample(task, length_bytes, rng, split="train"):
    """(prompt_bytes, answer_bytes) for `task` with len(prompt + answer) <= length_bytes."""
    if task == "passkey":
        return passkey(length_bytes, rng)
    if task == "number_string":
        return number_string(length_bytes, rng)
    if task == "kv_retrieval":
        return kv_retrieval(length_bytes, rng)
    if task == "text":
        return text(length_bytes, rng, split)
    if task == "copy":
        return copy(length_bytes, rng)
    raise ValueError("unknown task " + task)


def eval_samples(task, length, n, seed=1):
    """Held-out samples: rng = random.Random(1_000_003 * seed + length) (training uses
    other seeds), text from the "test" split."""
    rng = random.Random(1_000_003 * seed + length)
    return [make_sample(task, length, rng, split="test") for _ in range(n)]


def main():
    ap = argparse.ArgumentParser(description="dump task samples as JSONL (latin-1 strings)")
    ap.add_argument("--task", required=True, choices=TASKS)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.out, "w") as f:
        for p, ans in eval_samples(a.task, a.length, a.samples, a.seed):
            f.write(json.dumps({"task": a.task, "length": a.length, "prompt": p.decode("latin-1"),
                                "answer": ans.decode("latin-1")}) + "\n")


if __name__ == "__main__":
    main()
