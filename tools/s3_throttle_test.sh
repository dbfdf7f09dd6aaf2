#!/usr/bin/env bash
# 64 processes read one CheckpointManager root on S3 at once while the store throttles them
# (issue 34; mlcommons/dlio #347: 512 ranks listing at once were throttled and resumed from "0
# checkpoints"). moto on loopback (tessera_moto_server, signing enforced) holds steps 1-3; 64
# `tessera latest` processes reach it through an HTTP proxy (bench/peers/s3_proxy.py) that
# answers 503 SlowDown in its place:
#   1. to a quarter of the listings (seeded): every process names step 3, and the proxy did
#      throttle some;
#   2. to every request that names step 3: every process fails with the store's HTTP 503
#      naming step 3, and none names step 2 (a failed listing is not "no checkpoint there").
# Usage: s3_throttle_test.sh PATH_TO_TESSERA (TESSERA_MOTO_SERVER names the server's starter,
# TESSERA_TEST_PYTHON the Python with the proxy's needs; CMake sets both). A server or proxy
# that cannot start fails the test; it never passes by skipping.
set -uo pipefail
tessera="$1"
moto="${TESSERA_MOTO_SERVER:-$(dirname "$tessera")/tessera_moto_server}"
processes=64
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-s3-throttle-XXXXXX")"
. "$(dirname "$0")/s3_test_lib.sh"

start_moto "$moto"
server="$AWS_ENDPOINT_URL"
root="s3://$TESSERA_TEST_BUCKET/throttle-$$"
for step in 1 2 3; do
  "$tessera" demo --out "$root/$(printf 'iter_%07d' $step)" --size 1MiB --save-layout tp2,dp1 \
    --load-layout tp2,dp1 --no-sync > "$work/demo.$step" 2>&1 || {
    echo "FAILED: saving step $step:"
    cat "$work/demo.$step"
    exit 1
  }
done
[ "$("$tessera" latest "$root")" = "$root/iter_0000003" ]
check "without throttling, latest names step 3" $?

# All at once, each through the proxy; $1: the run's name.
latest_everywhere() {
  local pids=()
  for i in $(seq $processes); do
    AWS_ENDPOINT_URL="$PROXY_URL" "$tessera" latest "$root" > "$work/$1.out.$i" \
      2> "$work/$1.err.$i" &
    pids+=($!)
  done
  for i in $(seq $processes); do
    wait "${pids[$((i - 1))]}"
    echo $? > "$work/$1.rc.$i"
  done
}

throttled() {  # the proxy's count of requests it answered 503 SlowDown
  "$s3_test_python" -c "import json, sys, urllib.request
print(json.load(urllib.request.urlopen(sys.argv[1] + '/counters'))['throttled'])" \
    "$PROXY_CONTROL_URL"
}

start_proxy "$server" "GET:list-type=2:0.25" quarter
latest_everywhere quarter
ok=0
for i in $(seq $processes); do
  [ "$(cat "$work/quarter.rc.$i")" = 0 ] && [ "$(cat "$work/quarter.out.$i")" = "$root/iter_0000003" ] &&
    ok=$((ok + 1))
done
count="$(throttled)"
echo "quarter of listings throttled: $ok of $processes processes named step 3; $count requests answered 503"
[ "$ok" -eq "$processes" ]
check "with a quarter of the listings throttled, all $processes processes name step 3" $?
[ "$count" -gt 0 ]
check "the proxy answered SlowDown to some listings ($count)" $?
stop_proxy

start_proxy "$server" ":iter_0000003:1.0" step3
latest_everywhere step3
failed=0
older=0
for i in $(seq $processes); do
  if [ "$(cat "$work/step3.rc.$i")" != 0 ] && grep -q "iter_0000003.*HTTP 503" "$work/step3.err.$i"; then
    failed=$((failed + 1))
  fi
  grep -q "iter_0000002" "$work/step3.out.$i" && older=$((older + 1))
done
echo "step 3 throttled: $failed of $processes failed naming step 3 and HTTP 503; $older named step 2"
sed -n 1,3p "$work/step3.err.1"
[ "$failed" -eq "$processes" ]
check "with step 3 throttled past the retries, every process fails naming step 3 and HTTP 503" $?
[ "$older" -eq 0 ]
check "no process takes step 2 for the latest" $?
stop_proxy

finish
