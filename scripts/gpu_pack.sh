#!/usr/bin/env bash
# Packs a CUDA build made here for a lent GPU machine, so that the device time goes to tests and
# measurements instead of a compile: the binaries scripts/gpu_check.sh runs, and the shared
# libraries they need that a bare CUDA image may lack (everything ldd names except glibc,
# libstdc++/libgcc and CUDA's own), into one gzip tarball.
#   bash scripts/gpu_pack.sh BUILD_DIR TARBALL
# On the device: KVTIER_GPU_PREBUILT=TARBALL bash scripts/gpu_check.sh OUT [--quick]
# The binaries carry absolute paths of this checkout (KVTIER_BINARY_DIR, __FILE__), so
# gpu_check.sh links this checkout's path to the device's copy when they differ.
set -euo pipefail
build=${1:?usage: scripts/gpu_pack.sh BUILD_DIR TARBALL}
tarball=${2:?usage: scripts/gpu_pack.sh BUILD_DIR TARBALL}
bins=(kvtier kvtier_tests kvtier_gpu_bench)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for b in "${bins[@]}"; do
  [ -x "$build/$b" ] || { echo "gpu_pack: $build/$b is missing (cmake --build $build --target kvtier_tests kvtier_cli kvtier_gpu_bench)" >&2; exit 1; }
  cp "$build/$b" "$stage/bin/"
done
for b in "${bins[@]}"; do ldd "$build/$b"; done | awk '$3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case $name in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcuda*|libcublas*) ;;
      *) cp -L "$path" "$stage/lib/$name" ;;
    esac
  done
# The source tree the binaries were compiled from (their __FILE__ and KVTIER_SOURCE_DIR paths).
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
[ -n "$src" ] || { echo "gpu_pack: no CMAKE_HOME_DIRECTORY in $build/CMakeCache.txt" >&2; exit 1; }
echo "$src" >"$stage/source_dir"
# The build folder relative to the source tree (KVTIER_BINARY_DIR, where tests look for the CLI):
# gpu_check.sh unpacks into its own BUILD and links this name to it when they differ.
realpath --relative-to="$src" "$build" >"$stage/binary_dir"
(cd "$src" && git rev-parse --short HEAD 2>/dev/null || echo unknown) >"$stage/commit"
mkdir -p "$(dirname "$tarball")"
tar -C "$stage" -czf "$tarball" .
echo "gpu_pack: $tarball ($(du -h "$tarball" | cut -f1)): $(ls "$stage/bin" | tr '\n' ' ')+ $(ls "$stage/lib" | wc -l) libraries"
