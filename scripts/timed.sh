#!/usr/bin/env bash
# Runs a command and says how long it took:  scripts/timed.sh "stage name" cmd args...
# The exit status is the command's. `make test` prints one line per CI stage this way.
set -uo pipefail
name=$1; shift
start=$(date +%s)
"$@"
rc=$?
echo "== ${name}: $(( $(date +%s) - start )) s (exit ${rc})"
exit $rc
