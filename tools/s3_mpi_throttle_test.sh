#!/usr/bin/env bash
# A collective save on S3 by 4 MPI processes while the store throttles one of them (issue 34;
# marin-community/marin #9209: one rank's throttling error left the others waiting until a
# watchdog killed the job). moto on loopback (tessera_moto_server, signing enforced) holds step
# 1; the 4 processes save step 2 through an HTTP proxy (bench/peers/s3_proxy.py) that answers
# 503 SlowDown to every request naming rank 2's data file. Every process must fail within a
# minute with the same error naming rank 2, the object and HTTP 503, and step 1 must stay the
# latest.
# Usage: s3_mpi_throttle_test.sh PATH_TO_TESSERA (CMake sets TESSERA_MOTO_SERVER,
# TESSERA_TEST_PYTHON and TESSERA_MPIEXEC; registered only when tessera is built with MPI). A
# server or proxy that cannot start fails the test; it never passes by skipping.
set -uo pipefail
tessera="$1"
moto="${TESSERA_MOTO_SERVER:-$(dirname "$tessera")/tessera_moto_server}"
mpiexec="${TESSERA_MPIEXEC:-mpirun}"
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-s3-mpi-XXXXXX")"
. "$(dirname "$0")/s3_test_lib.sh"

start_moto "$moto"
root="s3://$TESSERA_TEST_BUCKET/mpi-throttle-$$"
"$tessera" demo --out "$root/iter_0000001" --size 4MiB --save-layout tp2,dp2 \
  --load-layout tp2,dp2 --no-sync > "$work/step1" 2>&1 || {
  echo "FAILED: saving step 1:"
  cat "$work/step1"
  exit 1
}

start_proxy "$AWS_ENDPOINT_URL" ":-r00002-:1.0" rank2

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s)
AWS_ENDPOINT_URL="$PROXY_URL" timeout 300 "$mpiexec" --oversubscribe -np 4 \
  -x AWS_ENDPOINT_URL -x AWS_ACCESS_KEY_ID -x AWS_SECRET_ACCESS_KEY -x AWS_REGION \
  -x AWS_CONFIG_FILE -x AWS_SHARED_CREDENTIALS_FILE \
  bash -c '"$0" demo --comm mpi --out "$1" --size 4MiB --save-layout tp2,dp2 \
             --load-layout tp2,dp2 --no-sync > "$2/out.$OMPI_COMM_WORLD_RANK" 2>&1
           echo $? > "$2/rc.$OMPI_COMM_WORLD_RANK"' \
  "$tessera" "$root/iter_0000002" "$work"
seconds=$(($(date +%s) - start))
echo "the save of 4 processes, rank 2 throttled, ended after $seconds s"
[ "$seconds" -lt 60 ]
check "every process returned within a minute (no hang)" $?
first=""
same=0
for r in 0 1 2 3; do
  error="$(grep -m1 "error" "$work/out.$r")"
  echo "rank $r (exit $(cat "$work/rc.$r" 2> /dev/null)): $error"
  [ "$(cat "$work/rc.$r" 2> /dev/null)" != 0 ] &&
    echo "$error" | grep -q "rank 2: .*iter_0000002/.*-r00002-.*HTTP 503" || continue
  [ -z "$first" ] && first="$error"
  [ "$error" = "$first" ] && same=$((same + 1))
done
[ "$same" -eq 4 ]
check "every process fails with the same error naming rank 2, its object and HTTP 503" $?
[ "$("$tessera" latest "$root")" = "$root/iter_0000001" ]
check "step 1 stays the latest" $?

finish
