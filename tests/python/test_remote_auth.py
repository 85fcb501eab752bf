"""The remote tier from Python against real redis-server processes that want credentials: a
password (requirepass) and an ACL user, one server and a 3-master cluster. A store whose chunks
live in Redis attends as one without it would; a wrong password raises kvtier.PermissionDenied at
once; no message, and not Store.options, holds the password."""
import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

import kvtier

SECRET = "Py7-s3cret-pw"
USER = "kvt-py"
GEOM = dict(layers=2, q_heads=4, kv_heads=2, head_dim=16, dtype="f32", n_sink=4, n_local=32, chunk_size=8)

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server/redis-cli not installed (scripts/deps.sh installs them)")


def free_port():
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


class Servers:
    """redis-server processes in a temporary directory wanting `user` (or, empty, requirepass)."""

    def __init__(self, user):
        self.user = user
        self.dir = tempfile.mkdtemp(prefix="kvtier-py-redis-")
        self.procs, self.ports = [], []

    def cli(self, *args):
        env = dict(os.environ, REDISCLI_AUTH=SECRET)
        words = ["redis-cli"] + (["--user", self.user] if self.user else []) + list(args)
        return subprocess.run(words, env=env, capture_output=True, text=True, timeout=60)

    def start(self, *extra):
        port = free_port()
        auth = (["--requirepass", SECRET, "--masterauth", SECRET] if not self.user else
                ["--user", "default", "off", "--user", self.user, "on", ">" + SECRET, "~*", "&*", "+@all",
                 "--masteruser", self.user, "--masterauth", SECRET])
        self.procs.append(subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--appendonly", "no", "--logfile", f"{self.dir}/redis-{port}.log"] + auth + list(extra),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.ports.append(port)
        for _ in range(200):
            if self.cli("-p", str(port), "PING").stdout.strip() == "PONG":
                return port
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not start")

    def cluster(self):
        for i in range(3):
            self.start("--cluster-enabled", "yes", "--cluster-config-file", f"{self.dir}/nodes-{i}.conf",
                       "--cluster-node-timeout", "1000")
        hosts = [f"127.0.0.1:{p}" for p in self.ports]
        r = self.cli("--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes")
        assert r.returncode == 0, r.stdout + r.stderr
        for _ in range(100):
            if all("cluster_state:ok" in self.cli("-p", str(p), "CLUSTER", "INFO").stdout for p in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def spec(self, userinfo, query="ns=py"):
        return f"redis://{userinfo}@" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + "?" + query

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=["requirepass-single", "acl-single", "requirepass-cluster", "acl-cluster"])
def servers(request):
    mode, shape = request.param.split("-")
    s = Servers(USER if mode == "acl" else "")
    try:
        if shape == "cluster":
            s.cluster()
        else:
            s.start()
        yield s
    finally:
        s.close()


def test_store_over_redis_with_credentials_attends_and_never_shows_the_password(servers):
    rng = np.random.default_rng(3)
    spec = servers.spec(f"{servers.user}:{SECRET}")
    # A warm tier of 4 chunks: the rest of the 100 tokens' chunks live only in Redis.
    with kvtier.Store(**GEOM, warm_bytes=4 * 8 * 2 * 2 * 16 * 4, remote=spec) as store:
        assert SECRET not in repr(store.options) and ":***@" in store.options["remote"]
        s = kvtier.Session.open(store, retrieve=False)
        n = 100
        ks = [rng.standard_normal((n, 2, 16), dtype=np.float32) for _ in range(2)]
        vs = [rng.standard_normal((n, 2, 16), dtype=np.float32) for _ in range(2)]
        for layer in range(2):
            s.append(layer, ks[layer], vs[layer])
        q = rng.standard_normal((1, 4, 16), dtype=np.float32)
        s.begin_step("decode")
        out = np.zeros_like(q)
        s.attend(0, q, 99, out)
        kk, vv = ks[0].astype(np.float64), vs[0].astype(np.float64)
        for h in range(4):
            logits = kk[:, h // 2] @ q[0, h].astype(np.float64) / 4.0
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(out[0, h], (p / p.sum()) @ vv[:, h // 2], rtol=1e-4, atol=1e-4)
        c = store.counters()
        assert c["cold_writes"] > 0 and c["demotions"] > 0 and c["cold_chunks"] == 0, c
        s.drop()


def test_wrong_or_missing_password_is_permission_denied_at_once(servers):
    for userinfo in (f"{servers.user}:wrong-{SECRET}", ""):
        spec = servers.spec(userinfo, "ns=py&retry_ms=5000") if userinfo else servers.spec(
            "", "ns=py&retry_ms=5000").replace("redis://@", "redis://")
        t0 = time.monotonic()
        with pytest.raises(kvtier.PermissionDenied) as e:
            kvtier.Store(**GEOM, remote=spec)
        assert time.monotonic() - t0 < 1.0, "a refusal is not retried for retry_ms"
        assert e.value.code == "PermissionDenied"
        assert SECRET not in str(e.value) and ("WRONGPASS" in e.value.message or "NOAUTH" in e.value.message)
    # A malformed spec holding the password: InvalidArgument, quoted redacted.
    with pytest.raises(kvtier.InvalidArgument) as e:
        kvtier.Store(**GEOM, remote=servers.spec(f"{servers.user}:{SECRET}", "ns=py&pool=0"))
    assert SECRET not in str(e.value) and ":***@" in str(e.value) and "option 'pool' is 0" in str(e.value)


def test_password_from_the_environment_and_a_file(servers, tmp_path, monkeypatch):
    hosts_only = servers.spec("", "ns=py").replace("redis://@", "redis://")
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", SECRET)
    if servers.user:
        monkeypatch.setenv("KVTIER_REDIS_USER", servers.user)
    with kvtier.Store(**GEOM, remote=hosts_only) as store:
        assert store.options["remote"] == hosts_only
    monkeypatch.delenv("KVTIER_REDIS_PASSWORD")
    pw = tmp_path / "pw"
    pw.write_text(SECRET + "\n")
    with kvtier.Store(**GEOM, remote=hosts_only + f"&password_file={pw}") as store:
        assert SECRET not in repr(store.options)
