#!/usr/bin/env bash
# The folders are layers and every quoted include points down or sideways, never up:
#   include/kvtier (the public vocabulary) <- store <- offload <- retrieval <- engine
#   <- integration (tools, CLI), and kernels/ depends on nothing of ours.
# Fails naming each file whose include reaches a folder its layer may not use.
#   tests/layering_test.sh SOURCE_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
cd "$src"
# layer: the top folders of quoted includes it may use (besides its own).
declare -A allowed=(
  [kernels]="kernels"
  [include]="kvtier"
  [store]="kvtier kernels store"
  [offload]="kvtier kernels store offload"
  [retrieval]="kvtier kernels store offload retrieval"
  [engine]="kvtier kernels store offload retrieval engine"
)
bad=0
for layer in kernels include store offload retrieval engine; do
  while IFS= read -r hit; do
    file=${hit%%:*}
    target=$(echo "$hit" | sed -E 's/.*#include "([^/"]+)\/.*/\1/')
    case " ${allowed[$layer]} " in
      *" $target "*) ;;
      *) echo "$hit: $layer/ may not include $target/" >&2; bad=1 ;;
    esac
  done < <(grep -rnE '^#include "[^/"]+/' "$layer" --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh' || true)
done
# The public headers include only each other (kvtier/...), checked above as include -> kvtier.
[ "$bad" = 0 ] && echo "layering holds: kernels, include/kvtier <- store <- offload <- retrieval <- engine <- integration"
exit "$bad"
