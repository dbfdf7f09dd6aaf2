#include "storage/s3/testing/fault_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace tessera::s3::testing {

// The two sockets of one proxied connection. Its pumps stop it with Shutdown, which wakes
// both and keeps the descriptors open; they are closed when the last pump lets go, so that no
// pump ever reads or writes a descriptor number the kernel has handed to a newer connection.
struct FaultProxy::Connection {
  int client = -1;
  int server = -1;
  std::atomic<bool> stopped{false};

  // With `reset`, the client's socket closes with RST (SO_LINGER 0), not an orderly FIN.
  void Shutdown(bool reset) {
    if (stopped.exchange(true)) return;
    if (reset) {
      linger l{1, 0};
      ::setsockopt(client, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    }
    ::shutdown(client, SHUT_RDWR);
    ::shutdown(server, SHUT_RDWR);
  }
  ~Connection() {
    ::close(client);
    ::close(server);
  }
};

Result<std::unique_ptr<FaultProxy>> FaultProxy::Start(int upstream_port) {
  std::unique_ptr<FaultProxy> proxy(new FaultProxy());
  proxy->upstream_port_ = upstream_port;
  proxy->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (proxy->listen_fd_ < 0) return IOErrorFromErrno("proxy socket", errno);
  const int one = 1;
  ::setsockopt(proxy->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(proxy->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(proxy->listen_fd_, 64) != 0 ||
      ::getsockname(proxy->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return IOErrorFromErrno("proxy bind/listen", errno);
  }
  proxy->port_ = ntohs(addr.sin_port);
  proxy->acceptor_ = std::thread([p = proxy.get()] { p->AcceptLoop(); });
  return proxy;
}

FaultProxy::~FaultProxy() {
  stopping_.store(true);
  ::shutdown(listen_fd_, SHUT_RDWR);
  acceptor_.join();
  ::close(listen_fd_);
  std::vector<std::thread> pumps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& weak : connections_) {
      if (auto c = weak.lock()) c->Shutdown(false);
    }
    pumps.swap(pumps_);
  }
  for (std::thread& t : pumps) t.join();
}

void FaultProxy::ResetAfterClientBytes(uint64_t n) {
  fault_kind_.store(1);
  fault_at_.store(client_bytes_.load() + n);
}

void FaultProxy::StallAfterClientBytes(uint64_t n, std::chrono::milliseconds stall) {
  stall_ = stall;
  fault_kind_.store(2);
  fault_at_.store(client_bytes_.load() + n);
}

void FaultProxy::ResetCounters() {
  client_bytes_.store(0);
  server_bytes_.store(0);
}

void FaultProxy::AcceptLoop() {
  while (!stopping_.load()) {
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      if (stopping_.load()) return;
      continue;
    }
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(client);
      if (server >= 0) ::close(server);
      continue;
    }
    const int one = 1;
    ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_shared<Connection>();
    c->client = client;
    c->server = server;
    std::lock_guard<std::mutex> lock(mu_);
    connections_.push_back(c);
    pumps_.emplace_back([this, c] { Pump(c, true); });
    pumps_.emplace_back([this, c] { Pump(c, false); });
  }
}

void FaultProxy::Pump(std::shared_ptr<Connection> c, bool from_client) {
  const int in = from_client ? c->client : c->server;
  const int out = from_client ? c->server : c->client;
  char buffer[64 * 1024];
  while (true) {
    size_t want = sizeof(buffer);
    if (from_client) {
      // Read no further than the planned fault, so that it fires inside this connection.
      const uint64_t at = fault_at_.load();
      const uint64_t sent = client_bytes_.load();
      if (at > sent && at - sent < want) want = static_cast<size_t>(at - sent);
    }
    const ssize_t n = ::recv(in, buffer, want, 0);
    if (n <= 0) break;
    size_t done = 0;
    while (done < static_cast<size_t>(n)) {
      const ssize_t w = ::send(out, buffer + done, static_cast<size_t>(n) - done, MSG_NOSIGNAL);
      if (w <= 0) {
        c->Shutdown(false);
        return;
      }
      done += static_cast<size_t>(w);
    }
    if (!from_client) {
      server_bytes_.fetch_add(static_cast<uint64_t>(n));
      continue;
    }
    const uint64_t total = client_bytes_.fetch_add(static_cast<uint64_t>(n)) + n;
    uint64_t at = fault_at_.load();
    if (total >= at && fault_at_.compare_exchange_strong(at, ~uint64_t{0})) {
      faults_fired_.fetch_add(1);
      if (fault_kind_.load() == 2) std::this_thread::sleep_for(stall_);
      c->Shutdown(true);
      return;
    }
  }
  c->Shutdown(false);
}

}  // namespace tessera::s3::testing
