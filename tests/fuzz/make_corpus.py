#!/usr/bin/env python3
"""Writes the committed seed corpora of the libFuzzer targets (tests/fuzz/corpus/<target>/).

Each seed is a small, valid (or nearly valid) input in the byte layout the target expects,
so that fuzzing starts from inputs that reach deep into the parser instead of from noise.
The formats are the ones documented in the headers named below. Run it from anywhere:
    python3 tests/fuzz/make_corpus.py
Seeds of compilerkv_tables are real table files written by `kvtier compile-tables`
(see corpus/compilerkv_tables/README) and are not regenerated here.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def crc32c(data: bytes, crc: int = 0) -> int:
    # store/checksum.h: reflected 0x82F63B78, init and final xor 0xFFFFFFFF.
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


def write(target: str, name: str, data: bytes) -> None:
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- safetensors (integration/model/safetensors.h) ------------------------------------------
def safetensors(tensors, metadata=None) -> bytes:
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + data


write("safetensors", "f32-2x2", safetensors([("a", "F32", [2, 2], struct.pack("<4f", 1, -2, 0.5, 3))]))
write("safetensors", "mixed-with-metadata",
      safetensors([("embed", "F16", [2, 3], bytes(range(12))), ("norm", "BF16", [3], b"\x80\x3f" * 3),
                   ("empty", "F32", [0, 4], b"")],
                  {"model": "kvtier-llama", "n_layers": "2", "rope_theta": "10000.0"}))
write("safetensors", "escapes", safetensors([("l.0\\u0041\"q", "F32", [1], struct.pack("<f", 7))]))

# ---- KV traces (integration/kv_trace.h) ---------------------------------------------------------
# The target's first byte: even -> it rewrites file_bytes and the CRC itself (the seed
# carries the body without the CRC); odd -> the bytes are taken as they are.


def trace_body(layers=1, q_heads=2, kv_heads=1, head_dim=4, n=6, context=4, qbegin=2, needles=((0, 1),)) -> bytes:
    b = b"KVTTRACE" + struct.pack("<IIQ", 1, 0, 0)
    b += struct.pack("<4I", layers, q_heads, kv_heads, head_dim)
    b += struct.pack("<qqqI", n, context, qbegin, len(needles))
    for lo, hi in needles:
        b += struct.pack("<qq", lo, hi)
    b += struct.pack(f"<{n}i", *range(65, 65 + n))
    for text in (b"model=tiny task=passkey", b"42"):
        b += struct.pack("<I", len(text)) + text
    for _ in range(layers):
        for heads in (q_heads, kv_heads, kv_heads):
            b += struct.pack(f"<{n * heads * head_dim}f", *[(i % 7) - 3.0 for i in range(n * heads * head_dim)])
    return b


def trace_file(body: bytes) -> bytes:
    b = bytearray(body)
    struct.pack_into("<Q", b, 16, len(b) + 4)
    return bytes(b) + struct.pack("<I", crc32c(bytes(b)))


write("trace", "fixed-up-small", b"\x00" + trace_body())
write("trace", "fixed-up-two-layers", b"\x02" + trace_body(layers=2, q_heads=4, kv_heads=2, head_dim=2, n=5,
                                                            context=3, qbegin=1, needles=((0, 1), (1, 3))))
write("trace", "fixed-up-zero-tokens", b"\x04" + trace_body(n=0, context=0, qbegin=0, needles=()))
write("trace", "as-is-valid", b"\x01" + trace_file(trace_body()))

# ---- cold tier values (offload/cold_tier.h) and store records (offload/store_records.h) -------------
# First byte: bits 0-1 kind - 1 (0 sequence, 1 meta, 2 payload, 3 blob), bit 2 frame (the target
# adds a valid header), bits 3-7 aux. Second byte: bits 0-3 layers - 1, bits 4-7 repr bytes / 8.
KIND_SEQ, KIND_META, KIND_PAYLOAD, KIND_BLOB = 0, 1, 2, 3


def value(kind: int, body: bytes, aux: int = 0) -> bytes:
    h = struct.pack("<IBBHQQ", 0x5443564B, 1, kind + 1, 0, len(body), aux)
    return h + struct.pack("<I", crc32c(body, crc32c(h))) + body


seq_record = struct.pack("<IIBI", 0x5153564B, 1, 1, 2) + struct.pack("<2q", 1000, 999)
meta = struct.pack("<IIqI", 0x4D43564B, 1, 80, 16) + bytes(range(16)) + struct.pack("<f", 0.25)
store = struct.pack("<II4iB4i", 0x5354564B, 1, 2, 4, 2, 32, 2, 16, 64, 16, 4)
write("cold_value", "framed-sequence-record", bytes([KIND_SEQ | 4, 1]) + seq_record)
write("cold_value", "framed-chunk-meta", bytes([KIND_META | 4, 2 << 4]) + meta)
write("cold_value", "framed-store-record", bytes([KIND_BLOB | 4, 0]) + store)
write("cold_value", "framed-payload", bytes([KIND_PAYLOAD | 4 | (5 << 3), 0]) + bytes(64))
write("cold_value", "raw-chunk-meta-value", bytes([KIND_META, 2 << 4]) + value(KIND_META, meta, 4096))
write("cold_value", "raw-sequence-value", bytes([KIND_SEQ, 1]) + value(KIND_SEQ, seq_record))

# ---- CompilerKV tables (offload/policy/compilerkv.h) ------------------------------------------------
# First byte even: the target appends the "crc32c <hex>" line itself.
tables = ("kvtier-compilerkv-tables v1\nlayers 1\nheads 2\nent_bins 1\nppl_bins 1\nbudget_bins 2\nnll_step 1\n"
          "w 0 1 0.5\ntau 0 0 0 -1 0.75\ntau 0 0 1 0.5 -1\n")
write("compilerkv_tables", "minimal-fixed-up", b"\x00" + tables.encode())

# ---- factory strings --------------------------------------------------------------------------
# First byte % 7: 0 scoring policy, 1 demotion policy, 2 probe, 3 budget allocator,
# 4 chunk index, 5 hot tier, 6 RetrieverOptions::Parse.
specs = {
    0: ["lru", "streaming", "h2o", "snapkv", "hitkv:k=4,theta=0.25", "hitkv:pyramid=4,window=5", "gkv", "structkv",
        "compilerkv"],
    1: ["lru", "h2o", "snapkv"],
    2: ["act", "act:eps=1e-06", "mean", "question:base=act,weight=0.5"],
    3: ["topk", "topk:rank=logit", "entropy", "entropy:min=1,rank=cosine"],
    4: ["Exact", "Exact:heads=max,rerank=4,rerank_min=256", "Exact:heads=max,rerank=1,rerank_min=0", "Flat", "HNSW32:ef=64", "IVF16,Flat:nprobe=4,train_min=0",
        # FAISS crashed (SIGFPE), leaked or allocated gigabytes on these before CheckFactoryDescription
        "HNSW1,PQ0x4fs", "IVF64,PQ7", "IVF64,PQ8x9", "IVF50000000,Flat",
        "HNSW00:ef=64",
        # the int4 first stage, the certified entropy, the per-chunk min/max bound
        "Exact:heads=max,screen=int4", "Exact:heads=max,theta=0.001", "Quest", "Quest:heads=max"],
    5: ["cpu", "cuda"],
    6: ["probe=act:eps=1e-06 alloc=entropy:min=1,rank=cosine index=Exact:heads=sum,rerank=4,rerank_min=256 budget=2048",
        "probe=mean alloc=topk index=Flat budget=512",
        # kvtier-fast's search reuse; the rolling screen
        "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,rerank_min=0 budget=2048 reuse=0.8",
        "probe=act alloc=entropy index=Exact:heads=max,screen=int4 budget=256 screen=8"],
}
for which, items in specs.items():
    for i, s in enumerate(items):
        write("factory_strings", f"{which}-{i}", bytes([which]) + s.encode())
