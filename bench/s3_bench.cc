// tessera's S3 client against boto3's transfer manager: the same bytes uploaded and downloaded
// with the same part size and concurrency, to and from the same server, in the same run; then
// a set of ranged reads through a counting proxy (bytes the server sent against bytes needed).
// Prints one JSON object.
//
//   build/tessera_bench_s3 [--size-mib 256] [--part-mib 8] [--concurrency 8] [--repeat 3]
//                          [--ranges 64] [--range-kib 1024]
//
// By default it starts moto's server (as the tests do; signatures enforced). moto is one Python
// process: its own CPU (hashing, copying into its in-memory store) bounds what both clients can
// do, so the throughput figures say how the clients compare under one slow server, not what
// they do against S3. Requests per GB and bytes per read are properties of the clients and
// carry over.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "storage/s3/s3_client.h"
#include "storage/s3/testing/fault_proxy.h"
#include "storage/s3/testing/moto_server.h"
#include "storage/s3/testing/s3_test_util.h"
#include "tessera/s3_storage.h"

namespace {

using Clock = std::chrono::steady_clock;
using tessera::Status;
using tessera::s3::S3Op;
namespace s3 = tessera::s3;

struct Options {
  uint64_t size = 256u << 20;
  uint64_t part = 8u << 20;
  size_t concurrency = 8;
  int repeat = 3;
  int ranges = 64;
  uint64_t range_bytes = 1u << 20;
};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

[[noreturn]] void Die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "tessera_bench_s3: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

std::shared_ptr<tessera::S3Storage> NewStorage(const s3::testing::MotoServer& server,
                                               const std::string& endpoint, const Options& o) {
  s3::S3ClientOptions options = server.ClientOptions();
  options.config.endpoint_url = endpoint;
  options.part_bytes = o.part;
  options.read_chunk_bytes = o.part;
  options.max_concurrency = o.concurrency;
  options.max_inflight_bytes = 2 * o.concurrency * o.part;
  options.retry = s3::RetryPolicy{};
  auto client = s3::S3Client::Create(options);
  if (!client.ok()) Die("client", client.status());
  return std::make_shared<tessera::S3Storage>(*client, server.bucket());
}

// Ranges of the object: `count` at pseudo-random offsets, as a resharded load reads them.
std::vector<std::pair<uint64_t, uint64_t>> Ranges(const Options& o) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t x = 12345;
  for (int i = 0; i < o.ranges; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    out.emplace_back((x >> 11) % (o.size - o.range_bytes), o.range_bytes);
  }
  return out;
}

const char* kBoto3Script = R"PY(
import io, json, os, sys, time
import boto3, botocore
from boto3.s3.transfer import TransferConfig
cfg = json.load(sys.stdin)
def client(endpoint):
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=cfg["key"], aws_secret_access_key=cfg["secret"],
                     config=botocore.config.Config(s3={"addressing_style": "path"},
                                                   max_pool_connections=cfg["concurrency"] + 2))
    counts = {"n": 0}
    def count(**kwargs): counts["n"] += 1
    c.meta.events.register("before-send.s3", count)
    return c, counts
s3, counts = client(cfg["endpoint"])
tc = TransferConfig(multipart_threshold=cfg["part"], multipart_chunksize=cfg["part"],
                    max_concurrency=cfg["concurrency"], use_threads=True)
data = os.urandom(cfg["size"])
out = {"upload_seconds": [], "download_seconds": [], "boto3": boto3.__version__,
       "botocore": botocore.__version__}
for r in range(cfg["repeat"]):
    key = cfg["key_prefix"] + "/boto3-" + str(r)
    counts["n"] = 0
    t = time.perf_counter()
    s3.upload_fileobj(io.BytesIO(data), cfg["bucket"], key, Config=tc)
    out["upload_seconds"].append(time.perf_counter() - t)
    out["upload_requests"] = counts["n"]
    counts["n"] = 0
    sink = io.BytesIO()
    t = time.perf_counter()
    s3.download_fileobj(cfg["bucket"], key, sink, Config=tc)
    out["download_seconds"].append(time.perf_counter() - t)
    out["download_requests"] = counts["n"]
    assert sink.getvalue() == data, "boto3 downloaded other bytes"
    s3.delete_object(Bucket=cfg["bucket"], Key=key)
# Ranged reads through the counting proxy, of an object written there first.
ranged, _ = client(cfg["proxy"])
s3.put_object(Bucket=cfg["bucket"], Key=cfg["ranged_key"], Body=data[: cfg["ranged_size"]])
for off, n in cfg["ranges"]:
    body = ranged.get_object(Bucket=cfg["bucket"], Key=cfg["ranged_key"],
                             Range="bytes=%d-%d" % (off, off + n - 1))["Body"].read()
    assert len(body) == n
print(json.dumps(out))
)PY";

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> uint64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::strtoull(argv[++i], nullptr, 10);
    };
    if (a == "--size-mib")
      o.size = next() << 20;
    else if (a == "--part-mib")
      o.part = next() << 20;
    else if (a == "--concurrency")
      o.concurrency = next();
    else if (a == "--repeat")
      o.repeat = static_cast<int>(next());
    else if (a == "--ranges")
      o.ranges = static_cast<int>(next());
    else if (a == "--range-kib")
      o.range_bytes = next() << 10;
    else {
      std::fprintf(stderr,
                   "usage: %s [--size-mib N] [--part-mib N] [--concurrency N] [--repeat N] "
                   "[--ranges N] [--range-kib N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (o.size < 2 * o.range_bytes || o.repeat < 1 || o.concurrency < 1) {
    std::fprintf(stderr, "--size-mib must hold two ranges; --repeat, --concurrency >= 1\n");
    return 2;
  }
  auto server = s3::testing::MotoServer::Start();
  if (!server.ok()) Die("starting moto's server", server.status());
  const std::string prefix = s3::testing::UniquePrefix();
  const std::vector<std::byte> data = s3::testing::Pattern(o.size, 1);
  auto storage = NewStorage(**server, (*server)->endpoint(), o);
  s3::S3Client& client = storage->client();

  std::vector<double> up, down;
  uint64_t up_requests = 0, down_requests = 0;
  std::vector<std::byte> back(o.size);
  for (int r = 0; r < o.repeat; ++r) {
    const std::string key = prefix + "/tessera-" + std::to_string(r);
    client.ResetStats();
    Clock::time_point t = Clock::now();
    {
      auto w = storage->NewWritableFile(key);
      if (!w.ok()) Die("open", w.status());
      for (uint64_t done = 0; done < o.size;) {  // the pieces a data-file writer hands over
        const uint64_t n = std::min<uint64_t>(4u << 20, o.size - done);
        Status s = (*w)->WriteAt(done, data.data() + done, n);
        if (!s.ok()) Die("write", s);
        done += n;
      }
      Status s = (*w)->Close();
      if (!s.ok()) Die("close", s);
    }
    up.push_back(Seconds(Clock::now() - t));
    up_requests = client.stats().total_requests();
    client.ResetStats();
    t = Clock::now();
    auto rf = storage->NewReadableFile(key);
    if (!rf.ok()) Die("open for reading", rf.status());
    Status s = (*rf)->ReadAt(0, back.data(), back.size());
    if (!s.ok()) Die("read", s);
    down.push_back(Seconds(Clock::now() - t));
    down_requests = client.stats().total_requests();
    if (std::memcmp(back.data(), data.data(), o.size) != 0) {
      Die("check", tessera::DataLoss("tessera read other bytes back"));
    }
    if (Status d = client.DeleteObject(storage->bucket(), key); !d.ok()) Die("delete", d);
  }

  // Ranged reads through the proxy: what the server sends for what a load needs.
  auto proxy = s3::testing::FaultProxy::Start((*server)->port());
  if (!proxy.ok()) Die("proxy", proxy.status());
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = Ranges(o);
  uint64_t needed = 0;
  for (const auto& r : ranges) needed += r.second;
  const std::string ranged_key = prefix + "/ranged";
  if (Status s = client.PutObject(storage->bucket(), ranged_key, data, false); !s.ok()) {
    Die("put ranged", s);
  }
  auto via_proxy = NewStorage(**server, (*proxy)->endpoint(), o);
  (*proxy)->ResetCounters();
  via_proxy->client().ResetStats();
  {
    auto rf = via_proxy->NewReadableFile(ranged_key);
    if (!rf.ok()) Die("open ranged", rf.status());
    std::vector<std::byte> buf(o.range_bytes);
    for (const auto& [offset, n] : ranges) {
      Status s = (*rf)->ReadAt(offset, buf.data(), n);
      if (!s.ok()) Die("ranged read", s);
      if (std::memcmp(buf.data(), data.data() + offset, n) != 0) {
        Die("check", tessera::DataLoss("ranged read returned other bytes"));
      }
    }
  }
  const uint64_t tessera_wire = (*proxy)->server_bytes();
  const uint64_t tessera_body = via_proxy->client().stats().bytes_received;
  const uint64_t tessera_ranged_requests = via_proxy->client().stats().total_requests();

  // boto3, same server, same sizes; its ranged reads through the same proxy.
  nlohmann::json cfg = {{"endpoint", (*server)->endpoint()},
                        {"proxy", (*proxy)->endpoint()},
                        {"key", (*server)->credentials().access_key_id},
                        {"secret", (*server)->credentials().secret_access_key},
                        {"bucket", (*server)->bucket()},
                        {"key_prefix", prefix},
                        {"size", o.size},
                        {"part", o.part},
                        {"concurrency", o.concurrency},
                        {"repeat", o.repeat},
                        {"ranged_key", prefix + "/ranged-boto3"},
                        {"ranged_size", o.size},
                        {"ranges", ranges}};
  // The proxy counts from the moment boto3 starts its ranged reads: the PUT before them goes
  // to the server directly, so only the GETs pass through.
  (*proxy)->ResetCounters();
  auto boto = s3::testing::RunPython(kBoto3Script, cfg.dump());
  if (!boto.ok()) Die("boto3", boto.status());
  const std::string& text = *boto;
  const size_t json_at = text.rfind('{');
  nlohmann::json b = nlohmann::json::parse(text.substr(json_at), nullptr, false);
  if (b.is_discarded()) Die("boto3 output", tessera::DataLoss(text));
  const uint64_t boto_wire = (*proxy)->server_bytes();

  const double gb = static_cast<double>(o.size) / 1e9;
  const double t_up = Median(up), t_down = Median(down);
  const double b_up = Median(b["upload_seconds"].get<std::vector<double>>());
  const double b_down = Median(b["download_seconds"].get<std::vector<double>>());
  nlohmann::json out = {
      {"server", "moto (one Python process, in-memory, signatures enforced)"},
      {"size_bytes", o.size},
      {"part_bytes", o.part},
      {"concurrency", o.concurrency},
      {"repeat", o.repeat},
      {"boto3", b["boto3"]},
      {"tessera_upload_seconds", t_up},
      {"boto3_upload_seconds", b_up},
      {"tessera_upload_mb_per_s", o.size / 1e6 / t_up},
      {"boto3_upload_mb_per_s", o.size / 1e6 / b_up},
      {"upload_boto3_over_tessera", b_up / t_up},
      {"tessera_download_seconds", t_down},
      {"boto3_download_seconds", b_down},
      {"tessera_download_mb_per_s", o.size / 1e6 / t_down},
      {"boto3_download_mb_per_s", o.size / 1e6 / b_down},
      {"download_boto3_over_tessera", b_down / t_down},
      {"tessera_upload_requests_per_gb", up_requests / gb},
      {"boto3_upload_requests_per_gb", b["upload_requests"].get<double>() / gb},
      {"tessera_download_requests_per_gb", down_requests / gb},
      {"boto3_download_requests_per_gb", b["download_requests"].get<double>() / gb},
      {"ranged_reads", o.ranges},
      {"range_bytes", o.range_bytes},
      {"ranged_bytes_needed", needed},
      {"tessera_ranged_requests", tessera_ranged_requests},
      {"tessera_ranged_body_bytes", tessera_body},
      {"tessera_ranged_server_bytes", tessera_wire},
      {"tessera_ranged_server_over_needed", static_cast<double>(tessera_wire) / needed},
      {"boto3_ranged_server_bytes", boto_wire},
      {"boto3_ranged_server_over_needed", static_cast<double>(boto_wire) / needed},
  };
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
