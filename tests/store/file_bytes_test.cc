// ReadFileBytes (store/file_bytes.h): the refusals every input reader shares. A directory, a
// FIFO, a missing path, an over-long name and an unreadable file each get their own Status
// naming the path, and a regular file reads back byte for byte.
#include "store/file_bytes.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <string>

#include "tests/test_util.h"

namespace kvtier {
namespace {

void ExpectRefused(const Result<std::string>& r, StatusCode code, const std::string& want) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().ToString();
  EXPECT_EQ(r.status().message().rfind("trace file '", 0), 0u) << r.status().ToString();
}

TEST(FileBytes, ARegularFileReadsBackByteForByte) {
  TempDir dir;
  std::string bytes(100000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + 3);
  std::ofstream(dir.path() + "/f", std::ios::binary) << bytes;
  auto r = ReadFileBytes(dir.path() + "/f", "trace file");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, bytes);
  std::ofstream(dir.path() + "/empty", std::ios::binary);
  auto e = ReadFileBytesU8(dir.path() + "/empty", "trace file");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_TRUE(e->empty());
}

TEST(FileBytes, EachKindOfWrongPathIsNamed) {
  TempDir dir;
  ExpectRefused(ReadFileBytes(dir.path() + "/missing", "trace file"), StatusCode::kNotFound,
                "does not exist");
  // A directory opens as a stream on Linux and reports a size of 2^63: refused before reading.
  ExpectRefused(ReadFileBytes(dir.path(), "trace file"), StatusCode::kInvalidArgument,
                "is a directory, not a file");
  const std::string fifo = dir.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ExpectRefused(ReadFileBytes(fifo, "trace file"), StatusCode::kInvalidArgument, "is a FIFO, not a file");
  ExpectRefused(ReadFileBytes("/dev/null", "trace file"), StatusCode::kInvalidArgument,
                "is a character device, not a file");
  ExpectRefused(ReadFileBytes(dir.path() + "/" + std::string(300, 'a'), "trace file"), StatusCode::kIOError,
                "File name too long");
  std::ofstream(dir.path() + "/f") << "x";
  ExpectRefused(ReadFileBytes(dir.path() + "/f/below", "trace file"), StatusCode::kIOError,
                "Not a directory");
}

TEST(FileBytes, AnUnreadableFileIsPermissionDenied) {
  TempDir dir;
  const std::string path = dir.path() + "/secret";
  std::ofstream(path) << "x";
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  // root reads any file: the read runs as nobody.
  const std::string got = InChildAsNobody([&] {
    auto r = ReadFileBytes(path, "trace file");
    return r.ok() ? std::string("OK") : r.status().ToString();
  });
  EXPECT_NE(got.find("IOError"), std::string::npos) << got;
  EXPECT_NE(got.find("'" + path + "': Permission denied"), std::string::npos) << got;
}

}  // namespace
}  // namespace kvtier
