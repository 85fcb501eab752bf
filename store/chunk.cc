#include "store/chunk.h"

namespace kvtier {

std::string ChunkKey::ToString() const {
  return "seq=" + std::to_string(seq) + "/layer=" + std::to_string(layer) + "/chunk=" + std::to_string(index);
}

}  // namespace kvtier
