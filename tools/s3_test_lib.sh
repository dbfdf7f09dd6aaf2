# Shared by the S3 shell tests that use the throttling proxy (s3_throttle_test.sh,
# s3_mpi_throttle_test.sh): source it after setting `work` (a fresh directory). It defines
#   check NAME STATUS        count and print a check ("ok: ..." / "FAILED: ...")
#   wait_for FILE PID WHAT LOG  wait until FILE exists; fail the test (naming WHAT, with LOG) if
#                            PID died or 120 s passed
#   start_moto MOTO          start tessera_moto_server and export its AWS_* variables, as a
#                            user sets them (nothing of this machine's own AWS settings)
#   start_proxy UPSTREAM RULE NAME  start bench/peers/s3_proxy.py throttling RULE; sets
#                            PROXY_URL and PROXY_CONTROL_URL
#   finish                   exit 1 with the count of failed checks, else 0
# and an EXIT trap that stops both and removes $work.
moto_pid=
proxy_pid=
failures=0
s3_test_python="${TESSERA_TEST_PYTHON:-$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/python}"
s3_proxy_py="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/bench/peers/s3_proxy.py"

stop_proxy() {
  if [ -n "$proxy_pid" ]; then kill "$proxy_pid" 2> /dev/null; wait "$proxy_pid" 2> /dev/null; fi
  proxy_pid=
}
s3_cleanup() {
  stop_proxy
  if [ -n "$moto_pid" ]; then kill "$moto_pid" 2> /dev/null; wait "$moto_pid" 2> /dev/null; fi
  rm -rf "$work"
}
trap s3_cleanup EXIT

check() {
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}

wait_for() {
  for _ in $(seq 1200); do
    [ -f "$1" ] && return 0
    kill -0 "$2" 2> /dev/null || break
    sleep 0.1
  done
  echo "FAILED: $3 did not start:"
  cat "$4"
  exit 1
}

start_moto() {
  "$1" "$work/env" 2> "$work/moto.log" &
  moto_pid=$!
  wait_for "$work/env" "$moto_pid" "the S3 test server (moto, through $1)" "$work/moto.log"
  set -a
  . "$work/env"
  set +a
  export AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null
  unset AWS_PROFILE AWS_SESSION_TOKEN AWS_ENDPOINT_URL_S3 AWS_DEFAULT_PROFILE
}

start_proxy() {
  "$s3_test_python" "$s3_proxy_py" --upstream "$1" --ready-file "$work/proxy.$3" \
    --throttle "$2" --seed 7 2> "$work/proxy.$3.log" &
  proxy_pid=$!
  wait_for "$work/proxy.$3" "$proxy_pid" "the throttling proxy ($s3_proxy_py)" \
    "$work/proxy.$3.log"
  . "$work/proxy.$3"
}

finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$failures check(s) failed"
    exit 1
  fi
  echo "all checks passed"
  exit 0
}
