"""kvtier: a CPU-GPU tiered KV-cache store with retrieval, for long-context LLM inference.

The engine API of include/kvtier/session.h, from Python:

    store = kvtier.Store(layers=..., q_heads=..., kv_heads=..., head_dim=..., dtype="f16")
    session = kvtier.Session.open(store, positions="absolute")
    session.append(layer, k, v)             # [n, kv_heads, head_dim], read in place
    session.begin_step("prefill")
    stats = session.attend(layer, q, positions, out)   # writes out in place

Both are context managers: `with kvtier.Store(...) as store:` closes the store at the end of
the block (later calls raise kvtier.FailedPrecondition), `with kvtier.Session.open(store) as s:`
closes the sequence. The package is typed (py.typed; the extension's stubs are _kvtier.pyi).

Arrays are numpy arrays or CPU torch tensors (buffer protocol or DLPack), never copied. On a
store with device="cuda", Session.append and Session.attend also take CUDA arrays (DLPack on a
CUDA device, or __cuda_array_interface__), ordered on the caller's stream (stream=, a
cudaStream_t's value as an int); kvtier.DeviceArray is such an array that kvtier allocates.
A Status that is not OK raises kvtier.Error's subclass named by its code (kvtier.InvalidArgument,
kvtier.NotFound, ...), with .code and .message. kvtier.hf plugs the store into Hugging Face
transformers. The tools and benchmarks (the shipped model's C++ forward, the task generator,
export_hf, infinitebench, decode_bench, plot) are kvtier.tools, not the engine API.
"""
from ._kvtier import (  # noqa: F401
    AlreadyExists,
    Corruption,
    DeviceArray,
    Error,
    FailedPrecondition,
    IOError,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Session,
    Store,
    TimedOut,
    Unavailable,
    device_runtime,
    preset,
    preset_names,
    size_store,
    version,
)

__version__: str = version()

__all__ = [
    "Store", "Session", "Error", "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition",
    "ResourceExhausted", "Corruption", "IOError", "TimedOut", "Unavailable", "Internal",
    "PermissionDenied", "preset", "preset_names", "size_store", "version", "DeviceArray", "device_runtime",
]
