// Reading a whole input file (a model, a trace, policy tables) into memory, with the one set of
// refusals every reader shares: a missing path is NotFound; a directory, a FIFO or a device is
// InvalidArgument naming what it is (a directory opens as a stream on Linux and reports a size
// of 2^63, which used to surface as "out of memory"); any other OS error (EACCES, ENAMETOOLONG,
// ...) is IOError naming the path and the error; a file too large for memory is
// ResourceExhausted. `what` starts every message ("trace file", "--weights", ...).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/status.h"

namespace kvtier {

Result<std::string> ReadFileBytes(const std::string& path, const std::string& what);
Result<std::vector<uint8_t>> ReadFileBytesU8(const std::string& path, const std::string& what);

}  // namespace kvtier
