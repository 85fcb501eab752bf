// `kvtier check`: is a store's data directory whole?
//
//   kvtier check --data-dir DIR [--verify] [--accept-lost]
//
// check opens the cold tier in DIR read-only (offload/cold_tier.h, ColdTierOptions::
// read_only): nothing in DIR is written, created or deleted. It checks that every chunk the
// cold tier acknowledged (and every sequence record) came back ("What was acknowledged"); a
// missing one fails with Corruption naming each (sequence, layer, index) range. Then it
// rebuilds the store's state from the records as an embedding program's open would
// (offload/store_recovery.h, on a host hot tier of its own) and prints each sequence's state
// and its acknowledged chunk ranges. --verify also reads every acknowledged chunk back and
// checks its checksums.
//
// --accept-lost is the one writing form: it first lists, read-only, what it is about to
// forget, then opens the store read-write accepting the loss for good. It refuses, changing
// nothing, when the directory cannot be opened read-only (nothing to list) or holds no store
// record (nothing to go on with).
//
// Exit code 0 when the store is whole (or the loss was accepted, 1 otherwise, 2 for bad flags.
//
// `kvtier repair`: RocksDB's repair of a damaged store, with the user's consent.
//
//   kvtier repair --data-dir DIR (--into NEW | --in-place)
//
// Lists what a read-only open of DIR finds missing (or why it does not open), then runs
// ColdTier::Repair on a copy of DIR made in NEW (DIR is left as it was) or, with --in-place,
// on DIR itself, then the read-only check on the result: it prints how many acknowledged
// chunks were missing before, how many the repair salvaged and which are still missing.
// Nothing is forgotten here: `check --accept-lost` on the repaired directory goes on without
// what is still missing, and lists it first.
//
// Exit code 0 when the repaired store is whole, 1 when chunks are still missing or the
// repair failed, 2 for bad flags.
#pragma once

namespace kvtier {

/// The subcommand; argv holds the flags after "check". Returns the exit code.
int RunCheck(int argc, char** argv);

/// The subcommand; argv holds the flags after "repair". Returns the exit code.
int RunRepair(int argc, char** argv);

}  // namespace kvtier
