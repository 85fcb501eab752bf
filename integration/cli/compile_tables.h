// `kvtier compile-tables`: the CompilerKV offline table compiler (offload/policy/compilerkv.h).
//
//   kvtier compile-tables --traces FILE --out TABLES [--alpha-cql X --steps N --lr X]
//       fits W_head and T_gate from recorded traces by conservative Q-learning (Eq. 4);
//   kvtier compile-tables --record-synthetic N --out-traces FILE [--out TABLES] [workload flags]
//       records traces from N synthetic sequences of integration/workload.h (exact attention of
//       the last --window queries over the whole context, every layer), and fits tables from
//       them too when --out is given.
// The tables load with the policy spec "compilerkv:tables=TABLES".
#pragma once

namespace kvtier {

/// The subcommand; argv holds the flags after "compile-tables". Returns the exit code (0 ok,
/// 2 bad flags, 1 other errors).
int RunCompileTables(int argc, char** argv);

}  // namespace kvtier
