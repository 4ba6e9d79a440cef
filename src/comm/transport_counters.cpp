// Interface-level byte counters: what this process has sent over TCP, from the kernel.
//
// Summing TCP_INFO tcpi_bytes_sent over the process's sockets counts every payload byte the
// kernel put on the wire for this process (retransmissions included), whichever library sent
// it. Open MPI run with `--mca btl self,tcp` sends all inter-rank traffic this way, so this is
// an independent check of the communicator's own accounting (shared-memory traffic is not seen).
#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdlib>

#include "treeattn/comm.hpp"

namespace treeattn {

std::optional<uint64_t> process_tcp_bytes_sent() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  uint64_t total = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    if (fd == dirfd(dir)) continue;
    tcp_info info{};
    socklen_t len = sizeof(info);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;
    if (len < offsetof(tcp_info, tcpi_bytes_sent) + sizeof(info.tcpi_bytes_sent)) {
      closedir(dir);
      return std::nullopt;  // kernel too old to report bytes sent
    }
    total += info.tcpi_bytes_sent;
  }
  closedir(dir);
  return total;
}

}  // namespace treeattn
