// A real S3 protocol server for the tests: moto's server (`python -m moto.server`) from the
// project's virtual environment, on a free loopback port, with request signing enforced.
//
// Start-up: moto runs with INITIAL_NO_AUTH_ACTION_COUNT=4; those four unauthenticated calls
// create an IAM user, give it an allow-all policy, create its access key and create the
// test bucket. From then on every request must carry a valid SigV4 signature of that key (a
// wrong secret gets 403 SignatureDoesNotMatch).
//
// If the server cannot be started (no venv, no moto, a port that never opens) Start returns an
// error saying what and how to fix it; the tests fail on it, they never skip.
//
// The child gets SIGKILL when the thread that started it exits (PR_SET_PDEATHSIG): start it
// from the test's main thread.
#ifndef TESSERA_STORAGE_S3_TESTING_MOTO_SERVER_H_
#define TESSERA_STORAGE_S3_TESTING_MOTO_SERVER_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "storage/s3/s3_client.h"
#include "tessera/status.h"

namespace tessera::s3::testing {

// The Python that runs moto: TESSERA_TEST_PYTHON from CMake (the venv scripts/setup creates).
std::string TestPython();

class MotoServer {
 public:
  static Result<std::unique_ptr<MotoServer>> Start();
  ~MotoServer();  // stops the server

  int port() const { return port_; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  const Credentials& credentials() const { return credentials_; }
  const std::string& bucket() const { return bucket_; }  // created at start-up
  const std::string& log_path() const { return log_path_; }

  // Client options for this server (path-style, region us-east-1, its credentials), with
  // short retry waits so that fault tests finish fast.
  S3ClientOptions ClientOptions() const;

 private:
  MotoServer() = default;
  Status Launch();
  Status Provision();

  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_path_;
  Credentials credentials_;
  std::string bucket_ = "tessera-test";
};

// One server per test process, started on first use and stopped at exit.
Result<MotoServer*> SharedMotoServer();

// A key prefix no other test of this process uses: "t<pid>-<n>".
std::string UniquePrefix();

}  // namespace tessera::s3::testing

#endif  // TESSERA_STORAGE_S3_TESTING_MOTO_SERVER_H_
