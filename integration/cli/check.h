// `kvtier check`: is a store's data directory whole?
//
//   kvtier check --data-dir DIR [--verify] [--accept-lost]
//
// Opens the cold tier in DIR, which checks that every chunk it acknowledged (and
// every sequence record) came back (offload/cold_tier.h, "What was acknowledged");
// a missing one fails with Corruption naming each (sequence, layer, index) range.
// Then reads the layout from the store record, opens the whole store (recovery as
// a program embedding kvtier would), and prints each sequence's state and its
// acknowledged chunk ranges. --verify also reads every acknowledged chunk back and
// checks its checksums. --accept-lost opens a store with lost chunks anyway,
// removes them from the acknowledged list for good and prints them.
// Exit code 0 when the store is whole (or the loss was accepted), 1 otherwise.
#pragma once

namespace kvtier {

/// The subcommand; argv holds the flags after "check". Returns the exit code.
int RunCheck(int argc, char** argv);

}  // namespace kvtier
