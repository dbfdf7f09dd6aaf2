#include "storage/s3/testing/moto_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <pugixml.hpp>
#include <sstream>
#include <thread>
#include <vector>

#ifndef TESSERA_TEST_PYTHON
#define TESSERA_TEST_PYTHON ".venv/bin/python"
#endif

namespace tessera::s3::testing {
namespace {

// The action count moto lets through unauthenticated: CreateUser, PutUserPolicy,
// CreateAccessKey, CreateBucket.
constexpr int kNoAuthActions = 4;

Result<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IOErrorFromErrno("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int e = errno;
    ::close(fd);
    return IOErrorFromErrno("binding a loopback port", e);
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

bool Accepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

std::string Tail(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  return s.size() > 2000 ? "..." + s.substr(s.size() - 2000) : s;
}

// One IAM query-protocol call (form-encoded POST, signed for service "iam").
Result<std::string> Iam(S3Client& client, const std::string& params) {
  const std::string body = params + "&Version=2010-05-08";
  S3Call call{.op = S3Op::kOther,
              .method = "POST",
              .body = std::as_bytes(std::span<const char>(body.data(), body.size()))};
  call.service = "iam";
  call.headers = {{"Content-Type", "application/x-www-form-urlencoded; charset=utf-8"}};
  S3CallResult r = client.Execute(call);
  if (!r.status.ok()) return r.status.WithContext("IAM " + params);
  return r.response.body;
}

}  // namespace

std::string TestPython() { return TESSERA_TEST_PYTHON; }

std::string UniquePrefix() {
  static std::atomic<int> counter{0};
  return "t" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
}

Result<std::unique_ptr<MotoServer>> MotoServer::Start() {
  const std::string python = TestPython();
  if (::access(python.c_str(), X_OK) != 0) {
    return FailedPrecondition("the S3 tests need moto's server, run by " + python +
                              ", which is missing: run scripts/setup (it creates .venv with "
                              "moto), or configure with -DTESSERA_TEST_PYTHON=<python with moto>");
  }
  std::unique_ptr<MotoServer> server(new MotoServer());
  Status launched;
  for (int attempt = 0; attempt < 3; ++attempt) {  // another process may take the free port
    launched = server->Launch();
    if (launched.ok()) break;
  }
  TESSERA_RETURN_IF_ERROR(launched);
  TESSERA_RETURN_IF_ERROR_CTX(server->Provision(),
                              "setting up moto's server (log " + server->log_path_ + ")");
  return server;
}

Status MotoServer::Launch() {
  TESSERA_ASSIGN_OR_RETURN(port_, FreePort());
  log_path_ =
      "/tmp/tessera_moto_" + std::to_string(::getpid()) + "_" + std::to_string(port_) + ".log";
  // Everything the child needs is built before fork: after it only async-signal-safe calls.
  const std::string python = TestPython();
  const std::string port = std::to_string(port_);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "INITIAL_NO_AUTH_ACTION_COUNT=", 29) != 0) env_strings.push_back(*e);
  }
  env_strings.push_back("INITIAL_NO_AUTH_ACTION_COUNT=" + std::to_string(kNoAuthActions));
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  const char* argv[] = {python.c_str(), "-m", "moto.server", "-H",
                        "127.0.0.1",    "-p", port.c_str(),  nullptr};
  const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0) return IOErrorFromErrno("creating " + log_path_, errno);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) {
    ::close(log);
    return IOErrorFromErrno("fork", errno);
  }
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    ::execve(argv[0], const_cast<char* const*>(argv), envp.data());
    ::_exit(127);
  }
  ::close(log);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!Accepts(port_)) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return FailedPrecondition("moto's server (" + python + " -m moto.server -p " + port +
                                ") exited before listening; its log:\n" + Tail(log_path_));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return DeadlineExceeded("moto's server did not listen on port " + port +
                              " within 60 s; its log:\n" + Tail(log_path_));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return Status::Ok();
}

Status MotoServer::Provision() {
  S3ClientOptions options = ClientOptions();
  options.config.credentials = Credentials{"AKIDSETUP", "setup-secret", ""};  // not checked yet
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<S3Client> client, S3Client::Create(options));
  TESSERA_RETURN_IF_ERROR(Iam(*client, "Action=CreateUser&UserName=tessera").status());
  // An inline allow-all policy (moto loads AWS's managed policies, AdministratorAccess among
  // them, only with MOTO_IAM_LOAD_MANAGED_POLICIES=true).
  const std::string policy =
      R"({"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]})";
  TESSERA_RETURN_IF_ERROR(Iam(*client,
                              "Action=PutUserPolicy&UserName=tessera&PolicyName=all"
                              "&PolicyDocument=" +
                                  UriEncode(policy, false))
                              .status());
  TESSERA_ASSIGN_OR_RETURN(std::string reply,
                           Iam(*client, "Action=CreateAccessKey&UserName=tessera"));
  pugi::xml_document doc;
  doc.load_buffer(reply.data(), reply.size());
  const pugi::xml_node key =
      doc.child("CreateAccessKeyResponse").child("CreateAccessKeyResult").child("AccessKey");
  credentials_.access_key_id = key.child("AccessKeyId").text().get();
  credentials_.secret_access_key = key.child("SecretAccessKey").text().get();
  if (credentials_.access_key_id.empty() || credentials_.secret_access_key.empty()) {
    return DataLoss("moto's CreateAccessKey reply has no key: " + reply.substr(0, 500));
  }
  return client->CreateBucket(bucket_);
}

S3ClientOptions MotoServer::ClientOptions() const {
  S3ClientOptions options;
  options.config.credentials = credentials_;
  options.config.credentials_source = "moto's IAM user";
  options.config.region = "us-east-1";
  options.config.endpoint_url = endpoint();
  options.config.addressing_style = AddressingStyle::kPath;
  options.part_bytes = kMinPartBytes;
  options.max_concurrency = 4;
  options.max_inflight_bytes = 64u << 20;
  options.read_chunk_bytes = 4u << 20;
  options.retry.base_delay = std::chrono::milliseconds(5);
  options.retry.max_delay = std::chrono::milliseconds(100);
  options.retry.max_total = std::chrono::milliseconds(30'000);
  return options;
}

MotoServer::~MotoServer() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
      ::unlink(log_path_.c_str());
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  ::unlink(log_path_.c_str());
}

Result<MotoServer*> SharedMotoServer() {
  static std::mutex mu;
  static std::unique_ptr<MotoServer> server;  // destroyed (stopped) at exit
  static Status failed;
  std::lock_guard<std::mutex> lock(mu);
  if (server) return server.get();
  if (!failed.ok()) return failed;
  Result<std::unique_ptr<MotoServer>> started = MotoServer::Start();
  if (!started.ok()) {
    failed = started.status();
    return failed;
  }
  server = std::move(*started);
  return server.get();
}

}  // namespace tessera::s3::testing
