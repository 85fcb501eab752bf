#include "kvtier/store.h"

#include "offload/tiered_store.h"

namespace kvtier {

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<TieredStore> store, TieredStore::Open(options));
  return std::unique_ptr<Store>(std::move(store));
}

}  // namespace kvtier
