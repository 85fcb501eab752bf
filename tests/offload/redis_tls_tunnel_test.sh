#!/usr/bin/env bash
# The TLS recipe of docs/cli.md ("Redis over TLS"), end to end: Debian's hiredis 0.14 has no
# TLS, so kvtier talks plain text to a local stunnel client on loopback, which carries the
# connection over TLS (the server's certificate checked against a CA) to a redis-server
# that listens on its TLS port only and wants a password. kvtier run must use Redis through
# the tunnel (the server counts SETs and GETs over TLS), and no output holds the password.
#   tests/offload/redis_tls_tunnel_test.sh PATH/TO/kvtier
# Exit 77 (ctest: skipped) with the reason when stunnel, openssl or redis-server is missing
# or the redis-server has no TLS support.
set -euo pipefail
KVTIER=${1:?usage: redis_tls_tunnel_test.sh PATH/TO/kvtier}
skip() { echo "SKIP: $*"; exit 77; }
STUNNEL=$(command -v stunnel4 || command -v stunnel || true)
[[ -n "$STUNNEL" ]] || skip "stunnel not installed (apt-get install stunnel4; scripts/deps.sh installs it)"
command -v openssl >/dev/null || skip "openssl not installed (scripts/deps.sh installs it)"
command -v redis-server >/dev/null || skip "redis-server not installed (scripts/deps.sh installs it)"
command -v redis-cli >/dev/null || skip "redis-cli not installed (scripts/deps.sh installs it)"

DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-tls.XXXXXX")
PIDS=()
cleanup() {
  exec 2>/dev/null
  for p in "${PIDS[@]}"; do kill -9 "$p" || true; done
  wait || true
  rm -rf "$DIR"
}
trap cleanup EXIT
SECRET="Tl5-s3cret-$$"
free_port() {
  local p
  while :; do
    p=$(( 10000 + RANDOM % 20000 ))  # below the usual ephemeral range (32768..)
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
}

# 1. A CA and a server certificate for localhost / 127.0.0.1, signed by it.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=kvtier test CA" \
  -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout "$DIR/redis.key" -out "$DIR/redis.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$DIR/san.ext"
openssl x509 -req -in "$DIR/redis.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial -days 2 \
  -extfile "$DIR/san.ext" -out "$DIR/redis.crt" 2>/dev/null
chmod 600 "$DIR"/*.key

# 2. redis-server on its TLS port only (--port 0: no plain-text port), with a password. A port
# taken between the check and the bind: another port.
tls_cli() { REDISCLI_AUTH="$SECRET" redis-cli --tls --cacert "$DIR/ca.crt" -h 127.0.0.1 -p "$TLS_PORT" "$@"; }
up=0
for attempt in 1 2 3 4 5; do
  TLS_PORT=$(free_port)
  rm -f "$DIR/redis.log"
  redis-server --port 0 --tls-port "$TLS_PORT" --bind 127.0.0.1 --dir "$DIR" --save '' --appendonly no \
    --tls-cert-file "$DIR/redis.crt" --tls-key-file "$DIR/redis.key" --tls-ca-cert-file "$DIR/ca.crt" \
    --tls-auth-clients no --requirepass "$SECRET" --logfile "$DIR/redis.log" > "$DIR/redis.out" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  for _ in $(seq 200); do
    if tls_cli PING 2>/dev/null | grep -q PONG; then up=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  [[ $up -eq 1 ]] && break
  kill -9 "$pid" 2>/dev/null || true
  grep -qi "address already in use" "$DIR/redis.log" "$DIR/redis.out" 2>/dev/null && continue
  cat "$DIR/redis.log" "$DIR/redis.out" 2>/dev/null || true
  skip "redis-server did not answer on a TLS port (built without TLS support?)"
done
[[ $up -eq 1 ]] || { echo "FAILED: no free port for redis-server in 5 attempts"; exit 1; }
# A plain-text client cannot talk to it: the tunnel is what makes it reachable.
if REDISCLI_AUTH="$SECRET" timeout 5 redis-cli -h 127.0.0.1 -p "$TLS_PORT" PING 2>/dev/null | grep -q PONG; then
  echo "FAILED: the TLS port answered plain text"
  exit 1
fi

# 3. The stunnel client: plain text on 127.0.0.1:LOCAL, TLS to the server, certificate checked.
LOCAL=$(free_port)
cat > "$DIR/stunnel.conf" <<EOF
foreground = yes
pid =
debug = warning
[redis]
client = yes
accept = 127.0.0.1:$LOCAL
connect = 127.0.0.1:$TLS_PORT
verifyChain = yes
CAfile = $DIR/ca.crt
checkHost = localhost
EOF
"$STUNNEL" "$DIR/stunnel.conf" > "$DIR/stunnel.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$LOCAL") 2>/dev/null && break
  sleep 0.05
done

# 4. kvtier through the tunnel: the chunks go to Redis over TLS and come back.
calls() { tls_cli INFO commandstats | tr -d '\r' | awk -F'[=,:]' '/^cmdstat_(set|get):/ {s += $3} END {print s + 0}'; }
before=$(calls)
set +e
"$KVTIER" run --quiet --context 8192 --warm-bytes 4M --decode-steps 4 --data-dir none \
  --remote "redis://:$SECRET@127.0.0.1:$LOCAL?ns=tls" --json "$DIR/run.json" > "$DIR/run.out" 2> "$DIR/run.err"
rc=$?
set -e
cat "$DIR/run.out" "$DIR/run.err"
[[ $rc -eq 0 ]] || { echo "FAILED: kvtier run exited $rc"; cat "$DIR/stunnel.log"; exit 1; }
grep -q "remote tier: " "$DIR/run.out" || { echo "FAILED: no remote tier line"; exit 1; }
grep -q " 0 errors" "$DIR/run.out" || { echo "FAILED: remote errors"; exit 1; }
after=$(calls)
echo "SET + GET over TLS: $(( after - before ))"
[[ $(( after - before )) -gt 0 ]] || { echo "FAILED: the server saw no SET/GET"; exit 1; }
grep -q '"remote": "redis://:\*\*\*@127.0.0.1:' "$DIR/run.json" || { echo "FAILED: report's remote not redacted"; exit 1; }
if grep -l -- "$SECRET" "$DIR/run.out" "$DIR/run.err" "$DIR/run.json" "$DIR/stunnel.log"; then
  echo "FAILED: the files above hold the password"
  exit 1
fi
echo "kvtier used Redis over TLS through stunnel; no output holds the password"
