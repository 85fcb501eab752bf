#!/usr/bin/env bash
# Installs the Debian packages kvtier builds against, only those missing.
# Works as root; uses sudo otherwise. Fast (one dpkg-query) when nothing is missing.
#   scripts/deps.sh          what `make build` / `make run` need (and the remote-tier tests:
#                            redis-server, redis-tools; stunnel4 and openssl for the TLS recipe)
#   scripts/deps.sh checks   that, plus clang for the sanitizer and fuzz jobs of `make test`
#                            (clang-14 with its compiler-rt: ASan, UBSan, TSan, libFuzzer;
#                            llvm-14 for llvm-symbolizer, so reports show file:line;
#                            clang-format-14 and clang-tidy-14 for scripts/lint.sh)
#   scripts/deps.sh python   that, plus what the Python package and its tests need
#                            (scripts/python_env.sh): Debian's interpreter headers, venv,
#                            numpy, torch 1.13 (CPU) and matplotlib 3.6 (python -m kvtier.tools.plot)
# Groups combine: scripts/deps.sh checks python.
set -euo pipefail
PKGS=(cmake ninja-build g++ make pkg-config ccache
      libfaiss-dev libopenblas-dev librocksdb-dev liblz4-dev libzstd-dev libsnappy-dev
      libtbb-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
      libhiredis-dev redis-server redis-tools stunnel4 openssl)
for group in "$@"; do
  case "$group" in
    checks) PKGS+=(clang-14 libclang-rt-14-dev llvm-14 clang-format-14 clang-tidy-14) ;;
    python) PKGS+=(python3-venv python3-dev python3-numpy python3-torch python3-matplotlib) ;;
    *) echo "deps: unknown group '$group' (none, 'checks' or 'python')" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${PKGS[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "deps: all ${#PKGS[@]} packages present"
  exit 0
fi
echo "deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
