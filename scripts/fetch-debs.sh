#!/usr/bin/env bash
# Downloads the Debian packages kvtier builds against into DIR (default .deps), so they can
# travel to a GPU machine that has CUDA but no package registry (scripts/gpu_check.sh unpacks
# them with scripts/unpack-debs.sh). ../shared/gpu/fetch-debs.sh's list plus what kvtier has
# needed since: hiredis (the Redis remote tier, found through pkg-config) and pkg-config, and
# the header-only nlohmann-json and CLI11 (the build needs their headers, binaries nothing).
# Run on a machine with the registry, in the project root:
#   echo /.deps/ >> .git/info/exclude; bash scripts/fetch-debs.sh .deps
set -euo pipefail
dir=${1:-.deps}
mkdir -p "$dir"
cd "$dir"
apt-get update -qq >/dev/null 2>&1 || true
pkgs="libfaiss-dev librocksdb-dev librocksdb7.8 libtbb-dev libtbb12 libtbbmalloc2
libgtest-dev libbenchmark-dev libbenchmark1debian libopenblas-dev libopenblas0
libopenblas0-pthread libblas3 liblapack3 libgomp1 libgfortran5 libsnappy1v5 libgflags2.2
libzstd1 liblz4-1 libbz2-1.0 libjemalloc2 liburing2
libhiredis-dev libhiredis0.14 pkgconf pkgconf-bin libpkgconf3 pkg-config
nlohmann-json3-dev libcli11-dev"
for p in $pkgs; do apt-get download "$p" >/dev/null 2>&1 || echo "could not download $p" >&2; done
ls *.deb | wc -l
