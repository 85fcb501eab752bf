"""Minimal reader/writer of the safetensors format (no third-party package).

Layout: an 8-byte little-endian unsigned header length N, then N bytes of JSON,
then the raw tensor data. The JSON maps each tensor name to
{"dtype": "F32"|"F16"|"BF16", "shape": [...], "data_offsets": [begin, end]}
(offsets relative to the start of the data section) and may hold a
"__metadata__" object whose values are all strings. Tensors are written in name
order, contiguous, little-endian; the header is padded with spaces to a
multiple of 8 bytes so the data section starts aligned.

Only the dtypes kvtier reads are supported: F32, F16 and BF16 (BF16 is stored
as the upper 16 bits of the fp32 value, rounded to nearest even).
"""
import json
import struct

import numpy as np

_NP = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2")}


def _to_bytes(array, dtype):
    a = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    if dtype == "BF16":
        u = a.view(np.uint32).astype(np.uint64)
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(a)
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded.astype("<u2").tobytes()
    return a.astype(_NP[dtype]).tobytes()


def save(path, tensors, metadata=None, dtype="F32"):
    """Writes {name: array-like} (converted to `dtype`) and string metadata."""
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError("unsupported dtype " + dtype)
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name].detach().cpu().numpy() if hasattr(tensors[name], "detach") else tensors[name])
        blob = _to_bytes(arr, dtype)
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load(path):
    """Returns ({name: float32 numpy array}, {metadata key: value})."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(path + ": file too short for the header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(path + ": header length %d goes past the end of the file" % n)
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        buf = data[begin:end]
        if info["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _NP:
            a = np.frombuffer(buf, dtype=_NP[info["dtype"]]).astype(np.float32)
        else:
            raise ValueError("%s: tensor %s has unsupported dtype %s" % (path, name, info["dtype"]))
        out[name] = a.reshape(info["shape"])
    return out, metadata
