"""Session.append and Session.attend with CUDA arrays (issue 44), on a store with device="cuda":
kvtier.DeviceArray inputs through DLPack and through __cuda_array_interface__, and a plain object
that exposes only __cuda_array_interface__, give the host-array calls' outputs and chunks bit for
bit on a twin session; every refusal names its argument. Runs where the module has a device
runtime (a CUDA build with a GPU, or the emulated device: `make test-gpu-emulated` runs this file
against the module it builds there and sets KVTIER_EXPECT_DEVICE_RUNTIME, so that it cannot skip);
skips elsewhere, saying why."""
import os

import numpy as np
import pytest

import kvtier
from kvtier import DeviceArray, device_runtime

RUNTIME = device_runtime()
EXPECTED = os.environ.get("KVTIER_EXPECT_DEVICE_RUNTIME")
GEOM = dict(layers=2, q_heads=4, kv_heads=2, head_dim=16)


def _device_reason():
    """Why the device tests cannot run here (None when they can)."""
    if RUNTIME == "none":
        return "this build of kvtier has no CUDA (make test-gpu-emulated runs these tests on the emulated device)"
    try:
        DeviceArray((1,))
    except kvtier.Error as e:
        return f"no CUDA device: {e.message}"
    return None


REASON = _device_reason()
if EXPECTED and (RUNTIME != EXPECTED or REASON):
    raise RuntimeError(f"expected the device runtime {EXPECTED!r}, got {RUNTIME!r} ({REASON})")
needs_device = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def cuda_store(**kw):
    opts = dict(GEOM, dtype="f16", n_sink=4, n_local=16, chunk_size=8, device="cuda")
    opts.update(kw)
    return kvtier.Store(**opts)


class CaiOnly:
    """A plain object with only __cuda_array_interface__ (v3), over a DeviceArray's memory."""

    def __init__(self, base, **fields):
        self.base = base  # keeps the memory alive
        self.__cuda_array_interface__ = dict(base.__cuda_array_interface__, **fields)


class DlpackOnly:
    """A plain object with only __dlpack__ and __dlpack_device__; records the streams it was asked for."""

    def __init__(self, base, device=None):
        self.base = base
        self.device = device
        self.streams = []

    def __dlpack_device__(self):
        return self.device or self.base.__dlpack_device__()

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.base.__dlpack__(stream=stream)


WRAPS = {
    "DeviceArray": lambda a: a,  # both protocols: the binding takes DLPack
    "dlpack": DlpackOnly,
    "cuda_array_interface": CaiOnly,
}


@pytest.mark.skipif(RUNTIME != "none", reason="this build has a device runtime")
def test_device_array_needs_a_build_with_cuda():
    with pytest.raises(kvtier.Unavailable, match="DeviceArray: this build of kvtier has no CUDA"):
        DeviceArray((2, 3))


@needs_device
def test_device_array_round_trip_and_protocols():
    host = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    a = DeviceArray.from_host(host)
    assert a.shape == (2, 3, 4) and a.dtype == np.float16 and a.nbytes == 48
    assert np.array_equal(a.to_host(), host) and a.to_host().dtype == np.float16
    assert a.__dlpack_device__() == (2, a.device)
    cai = a.__cuda_array_interface__
    assert cai == {"shape": (2, 3, 4), "typestr": "<f2", "data": (a.ptr, False), "version": 3, "strides": None,
                   "stream": None}
    assert DeviceArray((0, 4), "int64").to_host().shape == (0, 4)
    with pytest.raises(kvtier.InvalidArgument, match="DeviceArray: dtype must be float32, float16 or int64"):
        DeviceArray((2,), "float64")
    with pytest.raises(kvtier.InvalidArgument, match="negative dimension"):
        DeviceArray((2, -1))


def run_twins(wrap, steps=40, prefill=20):
    """The same prefill window and decode stream through a host-array session and a device-array
    session on two cuda-tier stores; returns the device session and the wrappers it was given."""
    host_store, dev_store = cuda_store(), cuda_store()
    hs = kvtier.Session.open(host_store, budget_tokens=16)
    ds = kvtier.Session.open(dev_store, budget_tokens=16)
    rng = np.random.default_rng(44)
    wrapped = []

    def dev(x):
        wrapped.append(wrap(DeviceArray.from_host(x)))
        return wrapped[-1]

    def step(kind, first, n):
        hs.begin_step(kind)
        ds.begin_step(kind)
        for layer in range(GEOM["layers"]):
            k = rng.standard_normal((n, 2, 16)).astype(np.float16)
            v = rng.standard_normal((n, 2, 16)).astype(np.float16)
            q = rng.standard_normal((n, 4, 16)).astype(np.float32)
            positions = np.arange(first, first + n, dtype=np.int64)
            hs.append(layer, k, v)
            ds.append(layer, dev(k), dev(v))
            want = np.zeros_like(q)
            hs.attend(layer, q, positions, want)
            out = DeviceArray(q.shape)
            ds.attend(layer, dev(q), positions if n > 1 else first, wrap(out))
            got = out.to_host()
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (kind, first, layer)
        assert ds.last_chunks == hs.last_chunks, (kind, first)

    step("prefill", 0, prefill)
    for p in range(prefill, prefill + steps):
        step("decode", p, 1)
    assert ds.counters()["tokens_appended"] == hs.counters()["tokens_appended"] == 2 * (prefill + steps)
    assert max(len(c) for c in ds.last_chunks) > 0  # the decode steps attended sealed chunks
    return ds, wrapped


@needs_device
@pytest.mark.parametrize("protocol", sorted(WRAPS))
def test_device_arrays_match_the_host_calls_bit_for_bit(protocol):
    _, wrapped = run_twins(WRAPS[protocol])
    if protocol == "dlpack":
        # stream=None is the legacy default stream: DLPack's 1 (it reserves 0).
        assert all(w.streams == [1] for w in wrapped if isinstance(w, DlpackOnly))


@needs_device
def test_stream_keyword_reaches_the_producer_and_the_interface_stream_is_honoured():
    store = cuda_store()
    s = kvtier.Session.open(store, budget_tokens=16)
    k = DeviceArray.from_host(np.ones((3, 2, 16), np.float16))
    wrapped = DlpackOnly(k)
    s.append(0, wrapped, wrapped, stream=2)  # the per-thread default stream
    assert wrapped.streams == [2, 2]
    # The interface's stream: 1 (legacy default) and 2 (per-thread default) are ordered after.
    s.append(0, CaiOnly(k, stream=1), CaiOnly(k, stream=2))
    assert s.counters()["tokens_appended"] == 6


@needs_device
def test_refusals_name_the_argument():
    store = cuda_store()
    s = kvtier.Session.open(store, budget_tokens=16)
    kv = np.ones((1, 2, 16), np.float16)
    k = DeviceArray.from_host(kv)
    q = DeviceArray.from_host(np.ones((1, 4, 16), np.float32))
    out = DeviceArray((1, 4, 16))
    f32 = DeviceArray((1, 2, 16))
    s.begin_step("decode")
    append_cases = [
        ((DlpackOnly(k, device=(2, 1)), k), "k: on CUDA device 1; the store's hot tier is on device 0"),
        ((k, DlpackOnly(k, device=(3, 0))), r"v: pinned host memory \(DLPack device kDLCUDAHost\)"),
        ((DlpackOnly(k, device=(10, 0)), k), "k: on DLPack device type 10"),
        ((CaiOnly(k, strides=(64, 2, 4)), k), r"k: the array must be C-contiguous \(row-major\)"),
        ((CaiOnly(k, mask=k), k), "k: __cuda_array_interface__ has a mask"),
        ((CaiOnly(k, version=1), k), "k: __cuda_array_interface__ version 1"),
        ((CaiOnly(k, stream=0), k), "k: __cuda_array_interface__ stream 0 is not allowed"),
        ((f32, f32), "k: dtype must be float16, got float32"),
        ((DeviceArray((1, 3, 16), "float16"), k), r"k: dimension 1 \(kv_heads\) must be 2"),
        ((k, DeviceArray((2, 2, 16), "float16")), "k and v must hold the same number of tokens"),
        ((k, kv), "v: a host array beside the device array k"),
    ]
    for (a, b), match in append_cases:
        with pytest.raises(kvtier.InvalidArgument, match=match):
            s.append(0, a, b)
    with pytest.raises(kvtier.InvalidArgument, match="stream: must be an int"):
        s.append(0, k, k, stream="default")
    with pytest.raises(kvtier.InvalidArgument, match="stream: is for device arrays, and k and v are host arrays"):
        s.append(0, kv, kv, stream=0)
    assert s.counters()["tokens_appended"] == 0  # nothing of a refused call was appended
    s.append(0, k, k)
    attend_cases = [
        ((q, 0, CaiOnly(out, data=(out.ptr, True))), r"out: read-only \(__cuda_array_interface__ data\[1\] is True\)"),
        ((q, DeviceArray.from_host(np.zeros(1, np.int64)), out), "positions: a device array"),
        ((q, 0, np.zeros((1, 4, 16), np.float32)), "out: a host array beside the device array q"),
        ((q, 0, DeviceArray((1, 4, 16), "float16")), "out: dtype must be float32, got float16"),
        ((q, 0, q), "out must not overlap q"),
    ]
    for (qq, pos, o), match in attend_cases:
        with pytest.raises(kvtier.InvalidArgument, match=match):
            s.attend(0, qq, pos, o)
    # kvtier.InvalidArgument is a ValueError; and the session still works after every refusal.
    assert issubclass(kvtier.InvalidArgument, ValueError)
    s.attend(0, q, 0, out)
    assert np.isfinite(out.to_host()).all()
    # A host tier takes no device arrays.
    host_store = kvtier.Store(**dict(GEOM, dtype="f16", n_sink=4, n_local=16, chunk_size=8))
    hs = kvtier.Session.open(host_store)
    with pytest.raises(kvtier.InvalidArgument, match="k: a CUDA array, and this session's store has its hot tier on the host"):
        hs.append(0, k, k)
    with pytest.raises(kvtier.InvalidArgument, match="q: a CUDA array, and this session's store has its hot tier on the host"):
        hs.attend(0, q, 0, out)


@needs_device
def test_host_memory_behind_a_device_interface_is_refused():
    if RUNTIME == "emulated":
        pytest.skip("HIP-CPU has no hipPointerGetAttributes: the emulated device's memory is host memory, so "
                    "where a pointer points cannot be told there (only the protocols' own claims are checked)")
    s = kvtier.Session.open(cuda_store(), budget_tokens=16)
    host = np.ones((1, 2, 16), np.float16)
    k = DeviceArray.from_host(host)
    fake = CaiOnly(k, data=(host.ctypes.data, False))
    with pytest.raises(kvtier.InvalidArgument, match="k: host memory behind a device interface"):
        s.append(0, fake, k)


def test_a_host_tier_refuses_device_arrays_by_name():
    # Runs in every build: the refusal comes before anything reads the (fake) device pointer.
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (1, 2, 16), "typestr": "<f2", "data": (0x1000, False), "version": 3}

    s = kvtier.Session.open(kvtier.Store(**dict(GEOM, dtype="f16", n_sink=4, n_local=16, chunk_size=8)))
    kv = np.ones((1, 2, 16), np.float16)
    with pytest.raises(kvtier.InvalidArgument, match="k: a CUDA array, and this session's store has its hot tier on the host"):
        s.append(0, FakeCuda(), FakeCuda())
    with pytest.raises(kvtier.InvalidArgument, match="v: a host array beside the device array k"):
        s.append(0, FakeCuda(), kv)
    s.append(0, kv, kv)  # host arrays still go to Append
    assert s.counters()["tokens_appended"] == 1
