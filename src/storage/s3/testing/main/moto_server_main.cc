// tessera_moto_server ENV_FILE: starts moto's S3 server on loopback (MotoServer: signing
// enforced, an IAM user and a bucket provisioned), writes the variables that reach it to
// ENV_FILE, one NAME=VALUE a line, then runs until SIGTERM, SIGINT or SIGHUP and stops the
// server. For the shell and Python tests (tools/s3_test.sh, python/tests/test_s3.py), which
// start it, read the file and use s3:// URIs as a user would. The file appears whole (written
// beside, then renamed), so a reader that sees it sees every line.
//
//   AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION   as the AWS CLI reads
//   TESSERA_TEST_BUCKET                                                      the bucket created
//
// Exit status 1, with the reason on stderr, when the server cannot start.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "storage/s3/testing/moto_server.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ENV_FILE\n", argv[0]);
    return 2;
  }
  tessera::Result<std::unique_ptr<tessera::s3::testing::MotoServer>> server =
      tessera::s3::testing::MotoServer::Start();
  if (!server.ok()) {
    std::fprintf(stderr, "tessera_moto_server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  // Blocked after the start (moto's process would inherit the mask and ignore the SIGTERM that
  // stops it); a signal that comes before kills this process, and moto with it (its
  // PR_SET_PDEATHSIG).
  sigset_t stop;
  sigemptyset(&stop);
  for (int s : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, s);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  const std::string path = argv[1];
  {
    std::ofstream out(path + ".tmp");
    out << "AWS_ENDPOINT_URL=" << (*server)->endpoint() << "\n"
        << "AWS_ACCESS_KEY_ID=" << (*server)->credentials().access_key_id << "\n"
        << "AWS_SECRET_ACCESS_KEY=" << (*server)->credentials().secret_access_key << "\n"
        << "AWS_REGION=us-east-1\n"
        << "TESSERA_TEST_BUCKET=" << (*server)->bucket() << "\n";
    if (!out.good()) {
      std::fprintf(stderr, "tessera_moto_server: cannot write %s.tmp\n", path.c_str());
      return 1;
    }
  }
  if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    std::perror("tessera_moto_server: rename");
    return 1;
  }
  int received = 0;
  sigwait(&stop, &received);
  return 0;  // ~MotoServer stops the server
}
