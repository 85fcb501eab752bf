#!/usr/bin/env bash
# The C API's remote tier against real redis-server processes that want credentials: a
# password (requirepass) and an ACL user, one server and a 3-master cluster. For each,
# kvtier_c_api_test --remote drives a session whose chunks live in Redis, a wrong
# password is KVTIER_PERMISSION_DENIED, and neither its output nor anything it wrote
# holds the secret.
#   tests/engine/c_api_remote_test.sh PATH/TO/kvtier_c_api_test
# Exit 77 (ctest: skipped) when redis-server or redis-cli is missing.
set -euo pipefail
BIN=${1:?usage: c_api_remote_test.sh PATH/TO/kvtier_c_api_test}
for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not installed (scripts/deps.sh installs it)"; exit 77; }
done
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-c-remote.XXXXXX")
PIDS=()
cleanup() {
  exec 2>/dev/null  # no "Killed" notices for the servers
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
SECRET="Cq4-s3cret-$$"

# A loopback port nobody listens on, whose cluster bus port (+10000) is free too; below the
# usual ephemeral range (32768..), so that no outgoing connection holds it meanwhile.
free_port() {
  local p
  while :; do
    p=$(( 10000 + RANDOM % 12000 ))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && ! (exec 3<>"/dev/tcp/127.0.0.1/$((p + 10000))") 2>/dev/null; then
      echo "$p"
      return
    fi
  done
}

# start USER EXTRA...: one server wanting the password (USER empty) or the ACL user; sets PORT.
# A port taken between the check and the bind (another test's server): another port.
start() {
  local user=$1
  shift
  local auth attempt pid
  if [[ -z "$user" ]]; then
    auth=(--requirepass "$SECRET" --masterauth "$SECRET")
  else
    auth=(--user default off --user "$user" on ">$SECRET" '~*' '&*' +@all --masteruser "$user" --masterauth "$SECRET")
  fi
  for attempt in 1 2 3 4 5; do
    PORT=$(free_port)
    redis-server --port "$PORT" --bind 127.0.0.1 --dir "$DIR" --save '' --appendonly no \
      --logfile "$DIR/redis-$PORT.log" "${auth[@]}" "$@" > /dev/null 2>&1 &
    pid=$!
    PIDS+=("$pid")
    for _ in $(seq 200); do
      if cli "$user" -p "$PORT" PING 2>/dev/null | grep -q PONG; then return; fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
    echo "redis-server on $PORT did not start (attempt $attempt):" >&2
    tail -3 "$DIR/redis-$PORT.log" >&2 || true
    kill -9 "$pid" 2>/dev/null || true
  done
  exit 1
}

cli() {
  local user=$1
  shift
  if [[ -z "$user" ]]; then
    REDISCLI_AUTH="$SECRET" redis-cli "$@"
  else
    REDISCLI_AUTH="$SECRET" redis-cli --user "$user" "$@"
  fi
}

# run NAME USER SPEC_HOSTS: the C program against the hosts, credentials in the userinfo.
run() {
  local name=$1 user=$2 hosts=$3
  echo "== $name"
  local out="$DIR/$name.out"
  local t0 t1
  t0=$(date +%s%N)
  "$BIN" --remote "redis://$user:$SECRET@$hosts?ns=c-$name" "redis://$user:wrong-$SECRET@$hosts" "$SECRET" \
    > "$out" 2>&1 || { cat "$out"; echo "FAILED: $name"; exit 1; }
  t1=$(date +%s%N)
  cat "$out"
  echo "   ($(( (t1 - t0) / 1000000 )) ms)"
}

start ""
run single-requirepass "" "127.0.0.1:$PORT"
start kvt-c
run single-acl kvt-c "127.0.0.1:$PORT"
for mode in requirepass acl; do
  user=""
  [[ $mode == acl ]] && user=kvt-c
  hosts=""
  for i in 0 1 2; do
    start "$user" --cluster-enabled yes --cluster-config-file "$DIR/nodes-$mode-$i.conf" --cluster-node-timeout 1000
    hosts+="${hosts:+,}127.0.0.1:$PORT"
  done
  cli "$user" --cluster create ${hosts//,/ } --cluster-replicas 0 --cluster-yes > "$DIR/create-$mode.log" 2>&1
  first=${hosts%%,*}
  for _ in $(seq 100); do
    cli "$user" -p "${first#*:}" CLUSTER INFO | grep -q cluster_state:ok && break
    sleep 0.1
  done
  run "cluster-$mode" "$user" "$hosts"
done

if grep -rl -- "$SECRET" "$DIR" | grep -v '^$'; then
  echo "FAILED: the files above hold the secret"
  exit 1
fi
echo "no output or file holds the secret"
