// A TCP proxy on loopback between the S3 client and the server, for faults that only a real
// socket shows: a connection reset in the middle of a request body, a server that stops
// answering (the client's stall timeout). It also counts the bytes each way (what the server
// sent is what a benchmark of ranged reads wants to know).
//
// Faults are one-shot and keyed on the bytes the client has sent through the proxy, over all
// connections: "reset the connection that carries client byte N".
//
// Thread safety: the setters and counters may be called from any thread.
#ifndef TESSERA_STORAGE_S3_TESTING_FAULT_PROXY_H_
#define TESSERA_STORAGE_S3_TESTING_FAULT_PROXY_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/status.h"

namespace tessera::s3::testing {

class FaultProxy {
 public:
  // Listens on a free loopback port and forwards to 127.0.0.1:upstream_port.
  static Result<std::unique_ptr<FaultProxy>> Start(int upstream_port);
  ~FaultProxy();

  int port() const { return port_; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Once the client has sent `n` more bytes (from now), resets that connection (RST to the
  // client, close to the server).
  void ResetAfterClientBytes(uint64_t n);
  // Once the client has sent `n` more bytes, stops forwarding on that connection (both ways)
  // for `stall`, then resets it.
  void StallAfterClientBytes(uint64_t n, std::chrono::milliseconds stall);

  uint64_t client_bytes() const { return client_bytes_.load(); }  // client -> server
  uint64_t server_bytes() const { return server_bytes_.load(); }  // server -> client
  int faults_fired() const { return faults_fired_.load(); }
  void ResetCounters();

 private:
  struct Connection;
  FaultProxy() = default;
  void AcceptLoop();
  void Pump(std::shared_ptr<Connection> c, bool from_client);

  int listen_fd_ = -1;
  int port_ = 0;
  int upstream_port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::weak_ptr<Connection>> connections_;
  std::vector<std::thread> pumps_;
  // The planned fault: at client byte `fault_at_` (absolute), of kind `fault_kind_`.
  std::atomic<uint64_t> fault_at_{~uint64_t{0}};
  std::atomic<int> fault_kind_{0};  // 1 reset, 2 stall
  std::chrono::milliseconds stall_{0};
  std::atomic<uint64_t> client_bytes_{0}, server_bytes_{0};
  std::atomic<int> faults_fired_{0};
};

}  // namespace tessera::s3::testing

#endif  // TESSERA_STORAGE_S3_TESTING_FAULT_PROXY_H_
