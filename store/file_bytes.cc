#include "store/file_bytes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>

namespace kvtier {
namespace {

const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

Status OsError(const std::string& what, const std::string& path, int err) {
  if (err == ENOENT) return NotFound(what + " '" + path + "' does not exist");
  return IOError(what + " '" + path + "': " + std::strerror(err));
}

// Reads the regular file at `path` into `out` (resized to its size). O_NONBLOCK keeps the open
// of a FIFO from waiting for a writer; it changes nothing for a regular file.
template <typename Bytes>
Status ReadInto(const std::string& path, const std::string& what, Bytes* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return OsError(what, path, errno);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return OsError(what, path, errno);
  if (!S_ISREG(st.st_mode))
    return InvalidArgument(what + " '" + path + "' is " + KindOf(st.st_mode) + ", not a file");
  const auto size = static_cast<uint64_t>(st.st_size);
  try {
    out->resize(static_cast<size_t>(size));
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(what + " '" + path + "': out of memory for its " + std::to_string(size) +
                             " bytes");
  } catch (const std::length_error&) {
    return ResourceExhausted(what + " '" + path + "': " + std::to_string(size) +
                             " bytes do not fit in memory");
  }
  size_t done = 0;
  while (done < out->size()) {
    const ssize_t n = ::read(fd, reinterpret_cast<char*>(out->data()) + done, out->size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(what, path, errno);
    }
    if (n == 0)
      return IOError(what + " '" + path + "' shrank while being read (" + std::to_string(done) + " of " +
                     std::to_string(size) + " bytes)");
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> ReadFileBytes(const std::string& path, const std::string& what) {
  std::string bytes;
  KVTIER_RETURN_IF_ERROR(ReadInto(path, what, &bytes));
  return bytes;
}

Result<std::vector<uint8_t>> ReadFileBytesU8(const std::string& path, const std::string& what) {
  std::vector<uint8_t> bytes;
  KVTIER_RETURN_IF_ERROR(ReadInto(path, what, &bytes));
  return bytes;
}

}  // namespace kvtier
