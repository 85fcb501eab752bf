// Process A of the two-process share test: prefills a sequence into a store whose lower
// tier is Redis, closes it and publishes it. Usage: kvtier_child_remote_publisher SPEC NAME.
// Prints "PUBLISHED <name> <chunks per layer>" and exits 0, or the error and exits 1.
#include <cstdio>

#include "remote_share.h"

int main(int argc, char** argv) {
  using namespace kvtier;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s redis://host:port[,...] NAME\n", argv[0]);
    return 2;
  }
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "publisher: %s\n", st.ToString().c_str());
    return 1;
  };
  auto store = TieredStore::Open(remote_share::Options(argv[1]));
  if (!store.ok()) return fail(store.status());
  auto seq = (*store)->CreateSequence();
  if (!seq.ok()) return fail(seq.status());
  Status st = remote_share::Write(store->get(), *seq);
  if (st.ok()) st = (*store)->CloseSequence(*seq);
  if (st.ok()) st = (*store)->PublishSequence(*seq, argv[2]);
  if (!st.ok()) return fail(st);
  auto n = (*store)->ChunkCount(*seq, 0);
  std::printf("PUBLISHED %s %llu\n", argv[2], static_cast<unsigned long long>(n.ok() ? *n : 0));
  return 0;
}
