#!/usr/bin/env bash
# End-to-end test of `tessera latest` and `tessera prune` on a CheckpointManager root
# (docs/FORMAT.md, section 5), built by hand: step directories made with `tessera demo`, a
# user's mark and a reader's lease written as the format says. Usage: manager_test.sh TESSERA
set -uo pipefail
tessera="$1"
python=/usr/bin/python3
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-manager-XXXXXX")"
sleeper=""
trap '[ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
check() {  # check NAME CONDITION-EXIT-CODE
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}
root="$work/run"
mkdir "$root"

msg="$("$tessera" latest "$root" 2>&1)"; rc=$?
[ $rc -eq 1 ] && echo "$msg" | grep -q "no committed checkpoint under"
check "latest of an empty root fails (rc 1), saying there is none" $?
"$tessera" latest --json "$root" > "$work/none.json"; rc=$?
[ $rc -eq 1 ] && $python -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['latest_step'] is None and d['steps']==[]" "$work/none.json"
check "latest --json of an empty root: latest_step null, rc 1" $?

for step in 1 2 3 4 5 6; do
  "$tessera" demo --out "$root/$(printf 'iter_%07d' $step)" --size 1MiB --save-layout tp2,dp1 \
    --load-layout tp1,dp1 --no-sync --quiet > /dev/null || { echo "demo failed"; exit 1; }
done
# A save that died before its commit (step 7), and a name that is no step (iter_07).
mkdir "$root/iter_0000007" "$root/iter_07"
cp "$root/iter_0000006/"tsr-*r00000-f000.safetensors "$root/iter_0000007/"

[ "$("$tessera" latest "$root")" = "$root/iter_0000006" ]
check "latest prints the newest committed step directory" $?
[ "$("$tessera" latest --step "$root")" = "6" ]; check "latest --step prints the step" $?

# A damaged newest checkpoint (its manifest truncated): latest names the one before, and warns.
# The commit that holds step 6 (docs/FORMAT.md, section 4: the highest "tessera.manifest.<n>").
manifest6=$(ls "$root/iter_0000006" | grep -E '^tessera\.manifest\.[0-9]{20}$' | sort | tail -n 1)
cp "$root/iter_0000006/$manifest6" "$work/manifest6"
truncate -s 100 "$root/iter_0000006/$manifest6"
out="$("$tessera" latest "$root" 2>"$work/err")"; rc=$?
cat "$work/err"
[ $rc -eq 0 ] && [ "$out" = "$root/iter_0000005" ] && grep -q "warning: step 6 is damaged" "$work/err"
check "a damaged newest step: latest names step 5 and warns about step 6" $?
"$tessera" latest --json "$root" > "$work/latest.json"; check "latest --json exits 0" $?
$python - "$work/latest.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["latest_step"] == 5 and doc["path"].endswith("iter_0000005"), doc
states = {s["step"]: s["state"] for s in doc["steps"]}
assert states == {1: "committed", 2: "committed", 3: "committed", 4: "committed", 5: "committed",
                  6: "damaged", 7: "uncommitted"}, states
assert "tessera.manifest" in doc["steps"][5]["problem"]
PY
check "latest --json lists every step directory with its state" $?
cp "$work/manifest6" "$root/iter_0000006/$manifest6"

# A user's mark (step 1) and a live reader's lease (step 2): a running process of this host.
echo "note=the best eval loss" > "$root/iter_0000001/tessera.keep"
sleep 300 & sleeper=$!
start=$(awk '{ sub(/.*\) /, ""); print $20 }' /proc/$sleeper/stat)
printf 'tessera read lease\nstep=2\nhost=%s\nboot_id=%s\npid=%s\nprocess_start=%s\ncreated_unix_ms=%s\n' \
  "$(hostname)" "$(cat /proc/sys/kernel/random/boot_id)" "$sleeper" "$start" "$(date +%s000)" \
  > "$root/iter_0000002/tessera.reading.00000000000000aa"

msg="$("$tessera" prune "$root" 2>&1)"; rc=$?
[ $rc -ne 0 ] && echo "$msg" | grep -q "keep-last"; check "prune without --keep-last fails" $?
msg="$("$tessera" prune "$root" --keep-last 0 2>&1)"; rc=$?
[ $rc -ne 0 ]; check "prune --keep-last 0 fails" $?

before="$(ls -R "$root" | md5sum)"
"$tessera" prune "$root" --keep-last 2 --dry-run --json > "$work/dry.json"; check "prune --dry-run --json exits 0" $?
[ "$(ls -R "$root" | md5sum)" = "$before" ]; check "a dry run changes nothing" $?
"$tessera" prune "$root" --keep-last 2 --dry-run | tee "$work/dry.txt"
grep -q "would delete 2 of 7 step directories" "$work/dry.txt"; check "the dry run's text names the count" $?
"$tessera" prune "$root" --keep-last 2 --json > "$work/real.json"; check "prune --json exits 0" $?
$python - "$work/dry.json" "$work/real.json" <<'PY'
import json, sys
dry, real = (json.load(open(p)) for p in sys.argv[1:3])
assert dry["dry_run"] is True and real["dry_run"] is False
for doc in (dry, real):
    fate = {s["step"]: (s["deleted"], s["reason"]) for s in doc["steps"]}
    assert sorted(s for s, (d, _) in fate.items() if d) == [3, 4], fate
    assert fate[1][1] == "marked to be kept", fate[1]
    assert fate[2][1].startswith("being read by process"), fate[2]
    assert fate[6][1] == "the newest committed" and fate[5][1] == "one of the newest 2 committed"
    assert "not finished" in fate[7][1], fate[7]
    assert doc["deleted"] == 2
PY
check "dry run and real prune decide alike: marked and leased kept, 3 and 4 deleted" $?
[ ! -e "$root/iter_0000003" ] && [ ! -e "$root/iter_0000004" ] && [ -e "$root/iter_0000002" ] \
  && [ -e "$root/iter_0000007" ] && [ -e "$root/iter_07" ]
check "the deleted directories are gone; the others (and a name that is no step) stay" $?

# The reader goes away: its lease no longer protects step 2.
kill "$sleeper"; wait "$sleeper" 2>/dev/null; sleeper=""
"$tessera" prune "$root" --keep-last 2 > "$work/again.txt"; check "prune again exits 0" $?
[ ! -e "$root/iter_0000002" ] && [ -e "$root/iter_0000001" ]
check "a dead reader's lease protects nothing; the marked step stays" $?
"$tessera" ls "$root" > "$work/ls.txt"; check "ls of the root exits 0" $?
grep -q "iter_0000006" "$work/ls.txt"; check "ls lists the step directories" $?

# Other step names (issue 30, item 3): a torchtitan root (step-<N>), read with --step-naming.
titan="$work/titan"
mkdir "$titan" "$titan/logs"
for step in 10 20 30; do
  "$tessera" demo --out "$titan/step-$step" --size 1MiB --save-layout tp1,dp1 \
    --load-layout tp1,dp1 --no-sync --quiet > /dev/null || { echo "demo failed"; exit 1; }
done
msg="$("$tessera" latest "$titan" 2>&1)"; rc=$?
echo "$msg"
[ $rc -eq 1 ] && echo "$msg" | grep -q '"step-10", "step-20", "step-30"' \
  && echo "$msg" | grep -q 'pass the step naming "torchtitan"' \
  && ! echo "$msg" | grep -q "no committed checkpoint"
check "latest of a torchtitan root without --step-naming names what it found and the preset" $?
msg="$("$tessera" prune "$titan" --keep-last 1 2>&1)"; rc=$?
[ $rc -eq 1 ] && echo "$msg" | grep -q "torchtitan" && [ -e "$titan/step-10" ]
check "prune of that root without --step-naming fails and deletes nothing" $?
[ "$("$tessera" latest --step-naming torchtitan --step "$titan")" = "30" ]
check "latest --step-naming torchtitan names step 30" $?
[ "$("$tessera" latest --step-naming 'step-{step}' "$titan")" = "$titan/step-30" ]
check "a pattern works as the preset does" $?
"$tessera" prune "$titan" --step-naming torchtitan --keep-last 1 > "$work/titan.txt"
check "prune --step-naming torchtitan exits 0" $?
cat "$work/titan.txt"
grep -q "^step-10 *deleted" "$work/titan.txt" && grep -q "deleted 2 of 3 step directories" "$work/titan.txt" \
  && [ ! -e "$titan/step-20" ] && [ -e "$titan/step-30" ] && [ -e "$titan/logs" ]
check "it deletes step-10 and step-20, keeps step-30 and logs" $?
msg="$("$tessera" latest --step-naming 'ckpt/{step}' "$titan" 2>&1)"; rc=$?
[ $rc -ne 0 ] && echo "$msg" | grep -q "names one directory"
check "a bad --step-naming is refused, saying why" $?

if [ $failures -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all manager CLI checks passed"
