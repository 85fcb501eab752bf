"""The engine API from Python: values against a numpy reference, arrays read and written in
place, every Status code raised as its kvtier.Error subclass, and bad input raising."""
import numpy as np
import pytest
import torch

import kvtier
import kvtier.tools

GEOM = dict(layers=2, q_heads=4, kv_heads=2, head_dim=16)


def small_store(dtype="f32", **kw):
    opts = dict(GEOM, dtype=dtype, n_sink=4, n_local=32, chunk_size=8)
    opts.update(kw)
    return kvtier.Store(**opts)


def reference_attention(q, k, v, q_pos):
    """Causal full attention in float64: q [m, Hq, D] at positions q_pos; k, v [n, Hkv, D] at 0..n-1."""
    m, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros((m, hq, d))
    for i in range(m):
        for h in range(hq):
            kk = k[: q_pos[i] + 1, h // group].astype(np.float64)
            vv = v[: q_pos[i] + 1, h // group].astype(np.float64)
            s = kk @ q[i, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vv
    return out


def test_the_package_is_the_engine_api_and_tools_are_apart():
    engine = {"Store", "Session", "Error", "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition",
              "ResourceExhausted", "Corruption", "IOError", "TimedOut", "Unavailable", "Internal",
              "PermissionDenied", "preset", "preset_names", "size_store", "version", "DeviceArray",
              "device_runtime"}
    assert set(kvtier.__all__) == engine
    for name in engine:
        assert hasattr(kvtier, name), name
    assert not hasattr(kvtier, "CppLlama") and not hasattr(kvtier, "make_samples")
    assert kvtier.tools.CppLlama is kvtier._kvtier.CppLlama
    assert kvtier.tools.make_samples is kvtier._kvtier.make_samples
    import importlib.util
    for mod in ("plot", "export_hf", "infinitebench", "decode_bench"):
        assert importlib.util.find_spec("kvtier.tools." + mod) is not None, mod
        assert importlib.util.find_spec("kvtier." + mod) is None, mod


def test_roundtrip_matches_reference_attention():
    rng = np.random.default_rng(0)
    store = small_store()
    # retrieve=False: every sealed chunk (full attention through the store), keys after RoPE.
    s = kvtier.Session.open(store, retrieve=False)
    n = 100  # sinks, 11 sealed chunks, a local window
    ks = [rng.standard_normal((n, 2, 16), dtype=np.float32) for _ in range(2)]
    vs = [rng.standard_normal((n, 2, 16), dtype=np.float32) for _ in range(2)]
    for layer in range(2):
        s.append(layer, ks[layer], vs[layer])
    q = rng.standard_normal((3, 4, 16), dtype=np.float32)
    pos = np.array([97, 98, 99], dtype=np.int64)
    s.begin_step("prefill")
    for layer in range(2):
        out = np.full_like(q, np.nan)
        stats = s.attend(layer, q, pos, out)
        np.testing.assert_allclose(out, reference_attention(q, ks[layer], vs[layer], pos), rtol=1e-5, atol=1e-5)
        # Every chunk sealed in this layer (the local ring keeps the newest tokens unsealed).
        assert stats["chunks"] == store.counters()["chunks_sealed"] // 2 > 0
        assert stats["chunks_clipped"] == 0  # the budget fits the hot slot pool
        assert set(stats) == {"probe_ms", "search_ms", "alloc_ms", "fetch_ms", "attention_ms", "entropy", "chunks", "chunks_clipped", "reused", "sliced", "first_stage_bytes", "rescoring_bytes", "attention_bytes"}
        # retrieve=False searches nothing; the attention reads K/V (2 heads x 16 x 2 tensors x 4 B) of every token.
        assert stats["first_stage_bytes"] == 0 and stats["rescoring_bytes"] == 0
        assert stats["attention_bytes"] == n * 2 * 16 * 2 * 4
    c = s.counters()
    assert c["steps"] == 1 and c["attends"] == 2 and c["tokens_appended"] == 2 * n
    assert c["selections_reused"] == 0 and c["selections_sliced"] == 0  # retrieve=False searches nothing
    assert c["host_syncs"] == 0 and c["worker_host_syncs"] == 0  # a cpu tier never waits on a device
    assert stats["reused"] is False and stats["sliced"] is False
    sc = store.counters()
    assert sc["chunks_sealed"] == 2 * stats["chunks"] and sc["warm_chunks"] == sc["chunks_sealed"]
    assert store.sequence_length(s.sequence, 0) == n
    # Attach: a second session over the same sequence sees the same tokens.
    other = kvtier.Session.attach(store, s.sequence, retrieve=False)
    other.begin_step("decode")
    out2 = np.zeros((1, 4, 16), np.float32)
    other.attend(0, q[2:3], 99, out2)  # an int is the first position
    np.testing.assert_allclose(out2[0], reference_attention(q[2:3], ks[0], vs[0], [99])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scrambled", [False, True])
def test_gather_copies_the_appended_bytes(scrambled):
    # gather copies each pinned span out of the hot tier. The scrambled store's tier keeps its bytes
    # XOR-scrambled at rest (offload/scrambled_hot_tier.h, XorScrambledHotTier), as device memory is unreadable in
    # place: only a copy through the tier's Download gives back the appended K/V, so a host
    # memcpy of the spans (what a "cuda" tier's device pointers cannot take) fails here.
    rng = np.random.default_rng(3)
    if scrambled:
        store = kvtier._kvtier._scrambled_store(**dict(GEOM, dtype="f16", n_sink=4, n_local=32, chunk_size=8))
    else:
        store = small_store("f16")
    s = kvtier.Session.open(store, retrieve=False)
    n = 100
    ks = [rng.standard_normal((n, 2, 16)).astype(np.float16) for _ in range(2)]
    vs = [rng.standard_normal((n, 2, 16)).astype(np.float16) for _ in range(2)]
    for layer in range(2):
        s.append(layer, ks[layer], vs[layer])
    s.begin_step("decode")
    q = rng.standard_normal((1, 4, 16), dtype=np.float32)
    for layer in range(2):
        g = s.gather(layer, q, n - 1)
        kinds = [p["kind"] for p in g["parts"]]
        assert kinds[0] == "sinks" and "chunk" in kinds and kinds[-1] == "local"
        covered = 0
        for p in g["parts"]:
            a, b = p["first_position"], p["first_position"] + p["k"].shape[0]
            assert p["k"].dtype == np.float16 and p["k"].shape[1:] == (2, 16)
            np.testing.assert_array_equal(p["k"], ks[layer][a:b])
            np.testing.assert_array_equal(p["v"], vs[layer][a:b])
            covered += b - a
        assert covered == n  # retrieve=False: sinks + every sealed chunk + the local window


@pytest.mark.parametrize("dtype,tdtype", [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_torch_tensors_every_dtype(dtype, tdtype):
    torch.manual_seed(0)
    store = small_store(dtype)
    s = kvtier.Session.open(store, retrieve=False)
    k = torch.randn(40, 2, 16).to(tdtype)
    v = torch.randn(40, 2, 16).to(tdtype)
    for layer in range(2):
        s.append(layer, k, v)
    s.begin_step("prefill")
    q = torch.randn(2, 4, 16)
    out = torch.zeros(2, 4, 16)
    ptr = out.data_ptr()
    s.attend(0, q, torch.tensor([38, 39]), out)
    assert out.data_ptr() == ptr  # written in place
    ref = reference_attention(q.numpy(), k.float().numpy(), v.float().numpy(), [38, 39])
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_arrays_are_read_and_written_in_place():
    rng = np.random.default_rng(1)
    store = small_store()
    s = kvtier.Session.open(store, retrieve=False)
    k = rng.standard_normal((20, 2, 16), dtype=np.float32)
    for layer in range(2):
        s.append(layer, k, k)
    s.begin_step("prefill")
    # q is a view into a bigger buffer at an offset (numpy) and a storage offset (torch): the
    # kernel reads that memory, not a copy taken somewhere else.
    big = rng.standard_normal((5, 4, 16), dtype=np.float32)
    out = np.zeros((1, 4, 16), np.float32)
    s.attend(0, big[3:4], 19, out)
    np.testing.assert_allclose(out, reference_attention(big[3:4], k, k, [19]), rtol=1e-5, atol=1e-5)
    # The output is the caller's buffer: a view into a bigger array gets the rows, the rest stays.
    target = np.full((3, 4, 16), 7.0, np.float32)
    s.attend(1, big[3:4], 19, target[1:2])
    np.testing.assert_array_equal(target[1:2], out)
    assert (target[0] == 7).all() and (target[2] == 7).all()
    tbig = torch.from_numpy(big.copy())
    tout = torch.zeros(3, 4, 16)
    s.begin_step("prefill")
    s.attend(0, big[3:4], 19, out)
    s.attend(1, tbig[3:4], torch.tensor([19]), tout[2:3])
    np.testing.assert_array_equal(tout[2:3].numpy(), out)
    # No silent copy path exists: a non-contiguous array is refused, a read-only output too.
    with pytest.raises(kvtier.InvalidArgument, match="contiguous"):
        s.attend(0, big[::2][:1].transpose(0, 2, 1).copy().transpose(0, 2, 1), 19, out)
    with pytest.raises(kvtier.InvalidArgument, match="contiguous"):
        s.attend(0, torch.randn(16, 4, 1).permute(2, 1, 0), torch.tensor([19]), torch.zeros(1, 4, 16))
    ro = np.zeros((1, 4, 16), np.float32)
    ro.flags.writeable = False
    with pytest.raises(kvtier.InvalidArgument, match="read-only"):
        s.attend(0, big[3:4], 19, ro)


def test_status_codes_raise_their_classes():
    store = small_store()
    s = kvtier.Session.open(store)
    q = np.ones((1, 4, 16), np.float32)
    out = np.zeros_like(q)
    with pytest.raises(kvtier.FailedPrecondition) as e:  # no BeginStep
        s.attend(0, q, 0, out)
    assert e.value.code == "FailedPrecondition" and "BeginStep" in e.value.message
    assert isinstance(e.value, kvtier.Error)
    with pytest.raises(kvtier.NotFound) as e:
        kvtier.Session.attach(store, 12345)
    assert e.value.code == "NotFound" and "12345" in e.value.message
    with pytest.raises(kvtier.InvalidArgument) as e:
        kvtier.Session.open(store, preset="nope")
    assert isinstance(e.value, ValueError) and "nope" in e.value.message
    k = np.ones((4, 2, 16), np.float32)
    s.append(0, k, k)
    s.append(1, k, k)
    s.close()
    with pytest.raises(kvtier.FailedPrecondition, match="read-only"):
        s.append(0, k, k)
    s.drop()
    with pytest.raises(kvtier.FailedPrecondition, match="dropped"):
        s.counters()
    # Every code has its class, each an Error, and the names are StatusCodeName's.
    names = ["InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition", "ResourceExhausted",
             "Corruption", "IOError", "TimedOut", "Unavailable", "Internal", "PermissionDenied"]
    for n in names:
        assert issubclass(getattr(kvtier, n), kvtier.Error)
    # Unavailable: the CUDA hot tier is not built.
    with pytest.raises(kvtier.Unavailable):
        small_store(device="cuda")


def test_store_and_session_are_context_managers(tmp_path):
    k = np.ones((12, 2, 16), np.float32)
    with small_store(data_dir=str(tmp_path / "cold")) as store:
        assert not store.closed
        with kvtier.Session.open(store) as s:
            s.append(0, k, k)
            s.append(1, k, k)
            seq = s.sequence
        # The block's end closed the sequence: it is read-only now.
        with pytest.raises(kvtier.FailedPrecondition, match="read-only"):
            s.append(0, k, k)
        assert store.sequence_length(seq, 0) == 12
        # A session closed by hand is not closed again by the block's end, nor is a dropped one.
        with kvtier.Session.open(store) as closed_by_hand:
            closed_by_hand.close()
        with kvtier.Session.open(store) as dropped:
            dropped.drop()
        live = kvtier.Session.open(store)  # left open: the store's close ends it
        live.append(0, k, k)
    assert store.closed
    calls = [
        lambda: store.counters(), lambda: store.options, lambda: store.sequences(),
        lambda: store.sequence_length(seq, 0), lambda: store.wait_for_durable(),
        lambda: kvtier.Session.open(store), lambda: kvtier.Session.attach(store, seq),
        lambda: live.append(0, k, k), lambda: live.begin_step("decode"), lambda: live.counters(),
        lambda: live.close(), lambda: live.gather(0, np.ones((1, 4, 16), np.float32), 0),
    ]
    for call in calls:
        with pytest.raises(kvtier.FailedPrecondition, match="store was closed"):
            call()
    store.close()  # a second close does nothing
    live.__exit__(None, None, None)  # nor does a session's exit after its store closed
    # An exception in the block still closes the store, and propagates.
    with pytest.raises(RuntimeError, match="boom"):
        with small_store() as store2:
            raise RuntimeError("boom")
    assert store2.closed
    # The data outlives the closed store: a new one over the same directory recovers the sequence.
    with small_store(data_dir=str(tmp_path / "cold")) as reopened:
        assert seq in reopened.sequences()


def test_close_waits_for_a_session_call_in_another_thread():
    import threading

    store = small_store(layers=1)
    s = kvtier.Session.open(store, retrieve=False)
    k = np.ones((64, 2, 16), np.float32)
    started = threading.Event()
    errors = []

    def appender():
        try:
            for _ in range(100000):  # until the store closes under it
                s.append(0, k, k)
                started.set()
        except kvtier.Error as e:
            errors.append(e)
        started.set()

    t = threading.Thread(target=appender)
    t.start()
    started.wait()
    store.close()  # waits for the append in flight; the next one raises
    t.join()
    assert store.closed
    assert len(errors) == 1 and isinstance(errors[0], kvtier.FailedPrecondition), errors
    assert "store was closed" in errors[0].message


def test_unreadable_tensors_say_why():
    store = small_store()
    s = kvtier.Session.open(store)
    k = torch.zeros(8, 2, 16)
    cases = [
        (torch.zeros(8, 2, 16, requires_grad=True), "requires grad; pass tensor.detach"),
        (torch.zeros(8, 2, 16, device="meta"), "meta device"),
        (np.zeros((8, 2, 16), np.float64), "dtype must be float32, got float64"),
        (torch.zeros(8, 2, 16, dtype=torch.float64), "dtype must be float32, got float64"),
        (np.zeros((8, 2, 16), np.int32), "got int32"),
        (torch.zeros(8, 2, 16, dtype=torch.uint8), "got uint8"),
        (np.zeros((8, 2, 16), np.complex64), "got complex64"),
    ]
    for arr, match in cases:
        with pytest.raises(kvtier.InvalidArgument, match=match):
            s.append(0, arr, k)
    s.append(0, k, k)  # and the session still works

    class FakeCudaTensor:  # what a CUDA tensor shows the binding, without a GPU
        device = torch.device("cuda", 0)
        requires_grad = False

        def __dlpack__(self, stream=None):
            raise AssertionError("the device is checked before DLPack is asked")

    with pytest.raises(kvtier.InvalidArgument, match=r"on cuda:0; .*\.cpu\(\)"):
        s.append(0, FakeCudaTensor(), k)

    class BrokenDlpack:
        def __dlpack__(self, stream=None):
            raise TypeError("no export for you")

    with pytest.raises(kvtier.InvalidArgument, match="cannot be read in place through DLPack: no export for you"):
        s.append(0, BrokenDlpack(), k)


@pytest.mark.parametrize("opts,match", [
    (dict(layerz=2), "unknown option 'layerz'"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(dtype="f64"), "dtype"),
    (dict(compression="gzip"), "compression"),
    (dict(n_sink=True), "expected an int"),
    (dict(write_through=1), "expected a bool"),
    (dict(hot_bytes=-1), "hot_bytes"),
    (dict(layers="2"), "expected an int"),
    (dict(q_heads=5), "kv_heads"),
])
def test_bad_store_options_raise(opts, match):
    with pytest.raises(kvtier.InvalidArgument, match=match):
        small_store(**opts)


def test_bad_input_raises_never_crashes():
    store = small_store("f16")
    s = kvtier.Session.open(store)
    k = np.zeros((8, 2, 16), np.float16)
    bad_kv = [
        (np.zeros((8, 2, 16), np.float32), "dtype must be float16"),
        (np.zeros((8, 3, 16), np.float16), "kv_heads"),
        (np.zeros((8, 2, 8), np.float16), "head_dim"),
        (np.zeros((8, 32), np.float16), "3 dimensions"),
        (np.zeros((2, 8, 16), np.float16).transpose(1, 0, 2), "contiguous"),
        ([[0.0]], "expected a numpy array or a torch tensor"),
        (None, "expected a numpy array or a torch tensor"),
        (torch.zeros(8, 2, 16, dtype=torch.bfloat16), "dtype must be float16"),
    ]
    for arr, match in bad_kv:
        with pytest.raises(kvtier.InvalidArgument, match=match):
            s.append(0, arr, k)
    with pytest.raises(kvtier.InvalidArgument, match="same number of tokens"):
        s.append(0, k, k[:4])
    with pytest.raises(kvtier.InvalidArgument, match="layer 2 out of range"):
        s.append(2, k, k)
    with pytest.raises(kvtier.InvalidArgument, match="layer -1 out of range"):
        s.append(-1, k, k)
    s.append(0, k, k)
    s.append(1, k, k)
    s.begin_step("prefill")
    q = np.zeros((1, 4, 16), np.float32)
    out = np.zeros_like(q)
    bad_attend = [
        ((q.astype(np.float16), 7, out), "q: dtype must be float32"),
        ((q, np.array([7], np.int32), out), "positions: dtype must be int64"),
        ((q, np.array([6, 7], np.int64), out), "one per query"),
        ((q, 7, np.zeros((2, 4, 16), np.float32)), "out: dimension 0"),
        ((q, 7, q), "overlap"),
        ((q, -1, out), "first position"),
        ((q, 7, out.astype(np.float64)), "out: dtype must be float32"),
    ]
    for args, match in bad_attend:
        with pytest.raises(kvtier.InvalidArgument, match=match):
            s.attend(0, *args)
    with pytest.raises(kvtier.InvalidArgument):
        kvtier.Session.open(store, positions="relative")
    with pytest.raises(kvtier.InvalidArgument, match="unknown option"):
        kvtier.Session.open(store, budget=5)
    with pytest.raises(kvtier.InvalidArgument):
        kvtier.tools.make_samples("passkey", 10, 1)  # too short for the task
    # The session is still usable after all of that.
    s.attend(0, q, 7, out)


def test_presets_and_options():
    assert kvtier.preset_names()[0] == "kvtier"
    p = kvtier.preset("infllm")
    assert p["probe"] == "mean" and p["repr_topk"] == 4
    store = small_store()
    s = kvtier.Session.open(store, preset="infllm", budget_tokens=64, positions="infllm", rope_theta=1e6)
    o = s.options
    assert o["positions"] == "infllm" and o["budget_tokens"] == 64 and o["rope_theta"] == 1e6
    assert "probe=mean" in o["retrieval"]
    assert store.options["chunk_size"] == 8 and store.options["dtype"] == "f32"


def test_session_input_rules_hold_in_python():
    """The Session's rules (include/kvtier/session.h) reach Python unchanged: non-finite K/V and
    queries, negative positions and a second drop are refused, each naming the call made."""
    store = small_store()
    s = kvtier.Session.open(store)
    k = np.full((4, 2, 16), 0.25, np.float32)
    for layer in (0, 1):
        s.append(layer, k, k)
    bad = k.copy()
    bad[2, 1, 5] = np.nan
    with pytest.raises(kvtier.InvalidArgument, match=r"v\[2\]\[1\]\[5\].*not finite"):
        s.append(0, k, bad)
    bad[2, 1, 5] = np.inf
    with pytest.raises(kvtier.InvalidArgument, match=r"k\[2\]\[1\]\[5\].*not finite"):
        s.append(0, bad, k)
    s.begin_step("decode")
    s.append(0, k[:1], k[:1])
    q = np.full((1, 4, 16), 0.5, np.float32)
    out = np.zeros_like(q)
    with pytest.raises(kvtier.InvalidArgument) as e:
        s.attend(0, q, np.array([-3], np.int64), out)
    assert "Session::Attend" in e.value.message and "positions[0] = -3" in e.value.message
    assert "Gather" not in e.value.message
    q[0, 2, 7] = np.nan
    with pytest.raises(kvtier.InvalidArgument, match=r"q\[0\]\[2\]\[7\].*not finite"):
        s.attend(0, q, 4, out)
    q[0, 2, 7] = 0.5
    s.attend(0, q, 4, out)
    assert np.isfinite(out).all()
    s.drop()
    with pytest.raises(kvtier.FailedPrecondition, match="dropped"):
        s.drop()


def test_attend_positions_are_the_layers_last_appended_tokens():
    """Positions are the layer's last m appended tokens (include/kvtier/session.h): a layer
    holding none, and positions past or before them, raise naming what the layer holds; out is
    not written."""
    store = small_store()
    s = kvtier.Session.open(store)
    q = np.full((48, 4, 16), 0.5, np.float32)
    out = np.full_like(q, 7.0)
    s.begin_step("prefill")
    with pytest.raises(kvtier.FailedPrecondition, match="layer 0 holds no tokens"):
        s.attend(0, q, np.arange(48, dtype=np.int64), out)
    with pytest.raises(kvtier.FailedPrecondition, match="layer 0 holds no tokens"):
        s.gather(0, q, 0)
    with pytest.raises(kvtier.FailedPrecondition, match="layer 0 holds no tokens"):
        s.observe(0, q, 0)
    assert (out == 7.0).all()
    k = np.full((48, 2, 16), 0.25, np.float32)
    s.append(0, k, k)
    with pytest.raises(kvtier.InvalidArgument, match=r"layer 0 holds positions 0\.\.47.*got 1\.\.48"):
        s.attend(0, q, 1, out)
    s.attend(0, q, 0, out)
    assert np.isfinite(out).all()
    s.begin_step("decode")
    s.append(0, k[:1], k[:1])
    one = np.full((1, 4, 16), 0.5, np.float32)
    with pytest.raises(kvtier.InvalidArgument, match=r"layer 0 holds positions 0\.\.48.*9223372036854775807"):
        s.attend(0, one, np.array([2**63 - 1], np.int64), np.zeros_like(one))
    with pytest.raises(kvtier.InvalidArgument, match=r"48\.\.48 \(got 47\.\.47\)"):
        s.attend(0, one, 47, np.zeros_like(one))
    s.attend(0, one, 48, np.zeros_like(one))


def test_sliced_and_reused_selections_are_counted():
    # screen_period and reuse_cosine: decode steps with the same query reuse the last search
    # until a chunk lands, then screen a slice; each attend says which, and the session counts.
    rng = np.random.default_rng(5)
    store = small_store()
    s = kvtier.Session.open(store, budget_tokens=32, reuse_cosine=0.9, screen_period=4)
    n = 100
    for layer in range(2):
        s.append(layer, rng.standard_normal((n, 2, 16), dtype=np.float32),
                 rng.standard_normal((n, 2, 16), dtype=np.float32))
    q = rng.standard_normal((1, 4, 16), dtype=np.float32)
    reused = sliced = 0
    for step in range(24):
        if step:
            for layer in range(2):
                s.append(layer, rng.standard_normal((1, 2, 16), dtype=np.float32),
                         rng.standard_normal((1, 2, 16), dtype=np.float32))
        s.begin_step("decode")
        for layer in range(2):
            stats = s.attend(layer, q, n - 1 + step, np.zeros_like(q))
            assert not (stats["reused"] and stats["sliced"])
            reused += stats["reused"]
            sliced += stats["sliced"]
    c = s.counters()
    assert reused > 0 and sliced > 0
    assert c["selections_reused"] == reused and c["selections_sliced"] == sliced


def test_a_data_dir_the_os_refuses_is_an_io_error(tmp_path):
    """A path the OS will not stat (a component over 255 bytes, a file in the middle) raises
    kvtier.IOError naming the OS error; nothing aborts."""
    with pytest.raises(kvtier.IOError, match="File name too long"):
        small_store(data_dir=str(tmp_path / ("d" * 300) / "kv"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(kvtier.IOError, match="Not a directory"):
        small_store(data_dir=str(tmp_path / "file" / "kv"))
