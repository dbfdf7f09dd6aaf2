#!/usr/bin/env bash
# The CLI on S3 through s3:// URIs, against moto's server on loopback (started here by
# tessera_moto_server, signing enforced): demo --out s3://..., inspect, verify, ls, diff, convert
# from S3 to local files and back, rm-keys, a rank-local save and finalize, bench io --storage.
# Usage: s3_test.sh PATH_TO_TESSERA (TESSERA_MOTO_SERVER names the server's starter; CMake sets
# it). A server that cannot start fails the test; it never passes by skipping.
set -uo pipefail
tessera="$1"
moto="${TESSERA_MOTO_SERVER:-$(dirname "$tessera")/tessera_moto_server}"
python=/usr/bin/python3
# The project's environment (boto3, a writer of other S3 clients' requests); CMake sets it.
test_python="${TESSERA_TEST_PYTHON:-$(dirname "$0")/../.venv/bin/python}"
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-s3-cli-XXXXXX")"
moto_pid=
cleanup() {
  if [ -n "$moto_pid" ]; then kill "$moto_pid" 2> /dev/null; wait "$moto_pid" 2> /dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
failures=0
check() {  # check NAME CONDITION-EXIT-CODE
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}

"$moto" "$work/env" 2> "$work/moto.log" &
moto_pid=$!
for _ in $(seq 1200); do
  [ -f "$work/env" ] && break
  kill -0 "$moto_pid" 2> /dev/null || break
  sleep 0.1
done
if [ ! -f "$work/env" ]; then
  echo "FAILED: the S3 test server (moto, through $moto) did not start:"
  cat "$work/moto.log"
  exit 1
fi
# As a user sets them: endpoint, keys, region; nothing of this machine's own AWS settings.
set -a
. "$work/env"
set +a
export AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null
unset AWS_PROFILE AWS_SESSION_TOKEN AWS_ENDPOINT_URL_S3 AWS_DEFAULT_PROFILE
s3="s3://$TESSERA_TEST_BUCKET/cli-$$"

out="$("$tessera" demo --out "$s3/ck" --size 2MiB --save-layout tp2,dp2 --load-layout tp4,dp1)"
rc=$?
echo "$out"
[ $rc -eq 0 ] && echo "$out" | grep -q "verified: every element"
check "demo saves on 4 ranks to s3:// and loads resharded on 4 others" $?

"$tessera" inspect "$s3/ck" > "$work/inspect.txt"
check "inspect reads the checkpoint on S3" $?
grep -q "tessera" "$work/inspect.txt"
check "inspect names the format" $?
"$tessera" inspect --json "$s3/ck" > "$work/inspect.json" &&
  $python -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['tensors'], d" \
    "$work/inspect.json"
check "inspect --json on S3" $?

msg="$("$tessera" verify "$s3/ck")"
check "verify checks every byte on S3" $?
echo "$msg"

"$tessera" ls --json "s3://$TESSERA_TEST_BUCKET/cli-$$" > "$work/ls.json"
check "ls lists a prefix of the bucket" $?
$python - "$work/ls.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
found = {c["path"]: c for c in d["checkpoints"]}
assert "ck" in found, d
assert found["ck"]["committed"] and found["ck"]["format"] == "tessera", d
PY
check "ls finds the committed checkpoint by its relative path" $?
"$tessera" ls "$s3" | grep -q "^ck "
check "ls prints the table" $?

# S3 -> local files, and back.
"$tessera" convert "$s3/ck" "$work/local" --to tessera --quiet
check "convert from S3 to a local directory" $?
"$tessera" verify "$work/local" > /dev/null
check "the local copy verifies" $?
"$tessera" convert "$work/local" "$s3/back" --to tessera --quiet
check "convert from a local directory to S3" $?
"$tessera" verify "$s3/back" > /dev/null
check "the copy on S3 verifies" $?
"$tessera" diff --values "$s3/ck" "$s3/back" > "$work/diff.txt"
check "diff of the two S3 checkpoints finds no difference" $?
"$tessera" convert "$s3/ck" "$s3/hf" --to safetensors --quiet &&
  "$tessera" verify "$s3/hf" > /dev/null
check "convert from S3 to safetensors on S3" $?
"$tessera" convert "$work/local" "$s3/back" --to tessera --quiet 2> "$work/again.txt"
[ $? -ne 0 ] && grep -q "not empty" "$work/again.txt"
check "convert into a non-empty S3 prefix is refused" $?

# rm-keys on S3: the key is gone, the rest verifies.
key="$($python -c "import json,sys; print(json.load(open(sys.argv[1]))['tensors'][0]['key'])" \
  "$work/inspect.json")"
"$tessera" rm-keys "$s3/back" --prefix "$key" > /dev/null
check "rm-keys on S3" $?
"$tessera" inspect --json "$s3/back" > "$work/after.json" &&
  $python - "$work/after.json" "$key" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert all(not t["key"].startswith(sys.argv[2]) for t in d["tensors"]), sys.argv[2]
PY
check "rm-keys removed the key" $?
"$tessera" verify "$s3/back" > /dev/null
check "the rest verifies after rm-keys" $?

# A rank-local save on S3, then finalize.
"$tessera" demo --out "$s3/local" --size 1MiB --save-layout tp2,dp1 --load-layout tp1,dp1 \
  --rank-local > /dev/null
check "demo --rank-local on S3" $?
"$tessera" finalize "$s3/local" > /dev/null
check "finalize on S3" $?
"$tessera" verify "$s3/local" > /dev/null
check "the finalized checkpoint verifies" $?

# A saver that died mid-upload leaves a multipart upload that no listing shows: ls lists it,
# prune --abort-uploads-older-than aborts it (moto dates every upload 2010-11-10, so any age
# takes it; the C++ S3 tests check ages against an older bound). boto3 starts it as a writer
# that died after one part would have.
mgr="cli-$$-mgr"
"$test_python" - "$mgr/iter_0000002/__0_0.distcp" <<'PY'
import os, sys, boto3
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
bucket = os.environ["TESSERA_TEST_BUCKET"]
upload = s3.create_multipart_upload(Bucket=bucket, Key=sys.argv[1])
s3.upload_part(Bucket=bucket, Key=sys.argv[1], UploadId=upload["UploadId"], PartNumber=1,
               Body=b"x" * (5 << 20))
PY
check "boto3 leaves an incomplete multipart upload" $?
"$tessera" ls --json "s3://$TESSERA_TEST_BUCKET/$mgr" > "$work/uploads.json" &&
  $python - "$work/uploads.json" "s3://$TESSERA_TEST_BUCKET/$mgr/iter_0000002/__0_0.distcp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["checkpoints"] == [], d
assert [u["uri"] for u in d["incomplete_uploads"]] == [sys.argv[2]], d
assert d["incomplete_uploads"][0]["upload_id"] and d["incomplete_uploads"][0]["age_seconds"] >= 0
PY
check "ls --json lists the incomplete upload under the prefix" $?
"$tessera" ls "s3://$TESSERA_TEST_BUCKET/$mgr" | grep -q "1 incomplete multipart upload under"
check "ls says an incomplete upload is there" $?
"$tessera" prune "s3://$TESSERA_TEST_BUCKET/$mgr" --keep-last 1 --abort-uploads-older-than 24h \
  --dry-run | grep -q "would abort 1 of 1 incomplete multipart uploads"
check "prune --dry-run says it would abort the upload" $?
"$tessera" prune "s3://$TESSERA_TEST_BUCKET/$mgr" --keep-last 1 --abort-uploads-older-than 24h \
  --json > "$work/prune.json" &&
  $python -c "import json,sys; d=json.load(open(sys.argv[1])); u=d['incomplete_uploads']; \
assert u['aborted'] == 1 and u['older_than_seconds'] == 86400, d" "$work/prune.json"
check "prune --abort-uploads-older-than aborts it" $?
"$tessera" ls --json "s3://$TESSERA_TEST_BUCKET/$mgr" > "$work/uploads.json" &&
  $python -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['incomplete_uploads'] == [], d" \
    "$work/uploads.json"
check "no incomplete upload is left" $?
"$tessera" prune "s3://$TESSERA_TEST_BUCKET/$mgr" --keep-last 1 --abort-uploads-older-than 3x \
  2> "$work/bad_age.txt"
[ $? -ne 0 ] && grep -q "abort-uploads-older-than '3x' is not a duration" "$work/bad_age.txt"
check "a bad age is refused naming the option" $?

# bench io on S3: save, raw write, load, raw read and resharded load of the same bytes, the
# loads checked element by element; the run's prefix is empty afterwards.
"$tessera" bench io --storage "$s3/bench" --size 16MiB --ranks 2 --repeat 1 --warmup 0 \
  > "$work/bench.json" &&
  $python -c "import json,sys; d=json.load(open(sys.argv[1])); \
assert d['checked'] and d['storage'].endswith('/bench'), d; \
s=d['samples_seconds']; \
assert all(len(s[p]) == 1 for p in ('save','raw_write','load','raw_read','reshard_load')), s" \
    "$work/bench.json"
check "bench io --storage s3:// runs every phase and checks the loads" $?
"$test_python" - "$s3/bench" << 'PY'
import os, sys
import boto3
bucket, _, prefix = sys.argv[1][len("s3://"):].partition("/")
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
left = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("KeyCount", 0)
assert left == 0, f"{left} objects left under {prefix}/"
PY
check "bench io --storage leaves nothing under its prefix" $?
"$tessera" bench io --storage "$s3/bench" --sync --size 1MiB 2> "$work/bench_sync.txt"
[ $? -ne 0 ] && grep -q "\-\-sync and \-\-drop-caches apply to a local \-\-dir" "$work/bench_sync.txt"
check "bench io --storage refuses --sync naming it" $?

# Errors name what is wrong.
"$tessera" inspect "s3://$TESSERA_TEST_BUCKET/cli-$$/absent" 2> "$work/absent.txt"
[ $? -ne 0 ] && grep -q "absent" "$work/absent.txt"
check "inspect of a missing prefix fails naming it" $?

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all S3 CLI checks passed"
