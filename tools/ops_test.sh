#!/usr/bin/env bash
# End-to-end tests of the commands that operate checkpoints: ls, inspect, diff, rm-keys, and
# the progress output of demo, verify and rm-keys. Usage: ops_test.sh PATH_TO_TESSERA
set -uo pipefail
tessera="$1"
python=/usr/bin/python3
# The Python package of the same build, to make checkpoints with chosen contents.
export PYTHONPATH="$(cd "$(dirname "$tessera")" && pwd)/python${PYTHONPATH:+:$PYTHONPATH}"
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-ops-XXXXXX")"
trap 'rm -rf "$work"' EXIT
failures=0
# The newest commit of a tessera directory: tessera.manifest.<20 digits> (docs/FORMAT.md, 4).
commit() { ls "$1" | grep -E '^tessera\.manifest\.[0-9]{20}$' | tail -n 1; }
check() {  # check NAME CONDITION-EXIT-CODE
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}
longest() { awk '{ if (length($0) > m) m = length($0) } END { print m + 0 }' "$1"; }

# ---- progress ------------------------------------------------------------------------------
"$tessera" demo --out "$work/runs/a" --size 16MiB --no-sync --progress > "$work/demo.out" 2> "$work/demo.err"
check "demo --progress exits 0" $?
grep -q "^save: " "$work/demo.err" && grep -q "^load: " "$work/demo.err"
check "demo --progress prints save and load lines on stderr" $?
$python - "$work/demo.err" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
for phase in ("save", "load"):
    mine = [l for l in lines if l.startswith(phase + ": ")]
    assert len(mine) >= 2, (phase, mine)
    last = re.match(rf"{phase}: (\S+ \S+) / (\S+ \S+) \(100%\).*done in", mine[-1])
    assert last and last.group(1) == last.group(2), mine[-1]  # bytes reach the total
PY
check "demo's progress lines reach the total and end with 'done in'" $?
! grep -q "save:" "$work/demo.out"  || grep -q "^save: 4 ranks" "$work/demo.out"
check "progress stays off stdout" $?
# Issue 30: off a terminal a rate measured over a burst read as "537 GB/s": the lines give bytes,
# percent and the time taken, no rate and no estimate.
! grep -Eq "B/s| left" "$work/demo.err"; check "progress lines off a terminal print no rate" $?
"$tessera" demo --out "$work/quiet" --size 4MiB --no-sync 2> "$work/quiet.err" > /dev/null
[ ! -s "$work/quiet.err" ]; check "without a terminal and without --progress, no progress" $?
"$tessera" verify "$work/runs/a" --progress > /dev/null 2> "$work/verify.err"
check "verify --progress exits 0" $?
tail -n 1 "$work/verify.err" | grep -Eq "^verify: (\S+ \S+) / \1 \(100%\)"
check "verify --progress ends at the total" $?
"$tessera" verify "$work/runs/a" --quiet > /dev/null 2> "$work/verify_quiet.err"
[ ! -s "$work/verify_quiet.err" ]; check "verify --quiet prints no progress" $?
msg="$("$tessera" verify "$work/runs/a" --quiet --progress 2>&1)"; rc=$?
[ $rc -ne 0 ]; check "--quiet and --progress together are refused" $?

# ---- test checkpoints: from Python when this build has the package (steps, objects, a long
# structure, values that differ), else from the demo (the sanitizer build has no Python) ----
if $python -c "import tessera" 2> /dev/null; then have_python=1; else have_python=0; fi
if [ $have_python -eq 1 ]; then
$python - "$work" <<'PY'
import os, sys, time
import numpy as np
import tessera
work = sys.argv[1]
rng = np.random.default_rng(0)
state = {"model": {f"layers.{i}.w": rng.standard_normal((8, 8)).astype(np.float32)
                   for i in range(300)},
         "optimizer": {"exp_avg": np.ones((64, 64), np.float32), "step": 7},
         "note": "hello", "lr": 0.5}
state["model"]["a_rather_long_module_name." * 6 + "weight"] = np.zeros(3, np.float32)
tessera.save(state, os.path.join(work, "runs/step100"), user_metadata={"step": "100"},
             num_io_threads=1, sync=False)
time.sleep(0.01)
state["model"]["layers.3.w"][0, 0] += 0.25
tessera.save(state, os.path.join(work, "runs/nested/step200"), user_metadata={"step": "200"},
             num_io_threads=1, sync=False)
PY
  check "python saves the test checkpoints" $?
else
  echo "skip: the checks that need checkpoints saved from Python (no tessera package in this build)"
  "$tessera" demo --out "$work/runs/step100" --size 4MiB --no-sync > /dev/null \
    && "$tessera" demo --out "$work/runs/nested/step200" --size 4MiB --no-sync > /dev/null
  check "demo saves the test checkpoints" $?
fi

# ---- inspect -------------------------------------------------------------------------------
COLUMNS=100 "$tessera" inspect "$work/runs/step100" > "$work/inspect.txt"
check "inspect exits 0" $?
[ "$(longest "$work/inspect.txt")" -le 100 ]; check "inspect: no line longer than COLUMNS=100" $?
head -n 1 "$work/inspect.txt" | grep -q "^checkpoint " && grep -q "^  format     tessera" "$work/inspect.txt" \
  && grep -q "^  saved      20" "$work/inspect.txt" && grep -q "^  contents   " "$work/inspect.txt"
check "inspect starts with a summary: format, save time, contents" $?
COLUMNS=40 "$tessera" inspect "$work/runs/step100" > "$work/narrow.txt"
[ "$(longest "$work/narrow.txt")" -le 40 ]; check "inspect at 40 columns: no longer line" $?
"$tessera" inspect --json "$work/runs/step100" > "$work/inspect.json"
$python - "$work/inspect.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for k in ["path", "format_version", "save_id", "num_ranks", "total_bytes", "total_chunks",
          "user_metadata", "tensors", "objects", "files", "format", "save_time_unix_ms"]:
    assert k in doc, k
assert doc["format"] == "tessera" and doc["save_time_unix_ms"] > 0
PY
check "inspect --json keeps its fields, adds format and save time" $?
if [ $have_python -eq 1 ]; then
grep -q "tessera.python.structure = <Python structure: 305 leaves, 3 containers" "$work/inspect.txt"
check "inspect summarises the Python structure instead of dumping it" $?
grep -q "^  metadata   step = 100" "$work/inspect.txt"; check "inspect shows the step" $?
grep -Eq "^optimizer.step +object +pickle .*= 7$" "$work/inspect.txt" \
  && grep -Eq "^note .*= 'hello'$" "$work/inspect.txt" && grep -Eq "^lr .*= 0.5$" "$work/inspect.txt"
check "inspect shows small objects by value" $?
grep -A1 "^optimizer.step " "$work/narrow.txt" | grep -Eq "^ += 7$"
check "inspect at 40 columns: a value with no room gets a line of its own" $?
grep -q "^model.a_rather_long_module_name" "$work/inspect.txt"
check "a key longer than its column is printed whole (wrapped)" $?
$python - "$work/inspect.txt" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
i = lines.index(next(l for l in lines if l.startswith("KEY ")))
rows = [l for l in lines[i + 1:] if l and not l.startswith(" ")]
keys = [l.split()[0] for l in rows if len(l.split()) >= 4]
layers = [int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")]
assert layers == sorted(layers) and len(layers) == 300, layers[:12]  # natural order
dtype_col = {l.index(" F32 ") for l in rows if " F32 " in l}
assert len(dtype_col) == 1, dtype_col  # aligned
PY
check "inspect: aligned columns, keys in natural order (layers.2 before layers.10)" $?
COLUMNS=100 "$tessera" inspect "$work/runs/step100" --keys 'model.layers.1?.w' > "$work/keys.txt"
grep -q "^10 of 305 keys match" "$work/keys.txt" && [ "$(grep -c '^model.layers.1[0-9].w ' "$work/keys.txt")" -eq 10 ]
check "inspect --keys GLOB filters" $?
COLUMNS=100 "$tessera" inspect "$work/runs/step100" --tree --depth 2 > "$work/tree.txt"
grep -Eq "^model +301 " "$work/tree.txt" && grep -Eq "^  layers +300 +[0-9.]+ kB" "$work/tree.txt" \
  && grep -Eq "^optimizer +2 " "$work/tree.txt"
check "inspect --tree groups by dotted prefix with key counts and bytes" $?
$python - "$work/inspect.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
objects = {o["key"]: o for o in doc["objects"]}
assert objects["optimizer.step"]["value"] == "7" and objects["optimizer.step"]["encoding"] == "pickle"
assert doc["user_metadata"]["tessera.python.structure"].startswith("{")  # --json keeps it whole
PY
check "inspect --json: object values; the structure whole" $?
else
COLUMNS=100 "$tessera" inspect "$work/runs/step100" --keys '*embedding*' > "$work/keys.txt"
grep -q "^3 of 67 keys match" "$work/keys.txt"; check "inspect --keys GLOB filters" $?
COLUMNS=100 "$tessera" inspect "$work/runs/step100" --tree --depth 1 > "$work/tree.txt"
grep -Eq "^decoder +21 " "$work/tree.txt" && grep -Eq "^optimizer +45 " "$work/tree.txt"
check "inspect --tree groups by dotted prefix with key counts and bytes" $?
fi

# ---- ls ------------------------------------------------------------------------------------
mkdir -p "$work/runs/broken" "$work/runs/dcp_partial" "$work/runs/dcp"
cp "$work/runs/step100/"*.safetensors "$work/runs/broken/"        # data files, no manifest
echo junk > "$work/runs/dcp/.metadata"; echo x > "$work/runs/dcp/__0_0.distcp"
echo x > "$work/runs/dcp_partial/__0_0.distcp"
mkdir -p "$work/runs/hf"
$python - "$work/runs/hf/model.safetensors" <<'PY'
import json, struct, sys
header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + bytes(8))
PY
COLUMNS=120 "$tessera" ls "$work/runs" > "$work/ls.txt"; check "ls exits 0" $?
cat "$work/ls.txt"
"$tessera" ls --json "$work/runs" > "$work/ls.json"; check "ls --json exits 0" $?
$python - "$work/ls.json" "$have_python" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
found = {c["path"]: c for c in doc["checkpoints"]}
assert set(found) == {"a", "step100", "nested/step200", "broken", "dcp", "dcp_partial", "hf"}, found
if sys.argv[2] == "1":  # saved from Python with user_metadata step
    assert found["step100"]["step"] == "100" and found["nested/step200"]["step"] == "200"
assert found["step100"]["format"] == "tessera" and found["step100"]["committed"]
assert found["a"]["ranks"] == 4 and found["a"]["files"] == 8 and found["a"]["step"] is None
assert found["broken"]["committed"] is False and found["broken"]["format"] == "tessera"
assert found["broken"]["bytes"] > 0
assert found["dcp_partial"]["format"] == "torch_dist" and not found["dcp_partial"]["committed"]
assert found["dcp"]["format"] == "torch_dist" and "error" in found["dcp"]
assert found["hf"]["format"] == "safetensors" and found["hf"]["files"] == 1
times = [c["save_time_unix_ms"] for c in doc["checkpoints"]]
assert times == sorted(times), times
order = [c["path"] for c in doc["checkpoints"]]
assert order.index("step100") < order.index("nested/step200")
PY
check "ls finds every checkpoint (tessera, uncommitted, DCP, HF) with step, bytes, files, ranks, sorted by save time" $?
# Issue 30: off a terminal (here a file) no path is cut with "...", whatever COLUMNS says.
mkdir -p "$work/deep/a_rather_long_directory_name_for_a_run/and_another_long_one_below_it"
cp -r "$work/runs/a" "$work/deep/a_rather_long_directory_name_for_a_run/and_another_long_one_below_it/step_0000100"
COLUMNS=40 "$tessera" ls "$work/deep" > "$work/ls_deep.txt"; rc=$?
[ $rc -eq 0 ] && grep -q "^a_rather_long_directory_name_for_a_run/and_another_long_one_below_it/step_0000100  .*committed" "$work/ls_deep.txt" && ! grep -qF "..." "$work/ls_deep.txt"
check "ls off a terminal prints whole paths and whole lines" $?
head -n 1 "$work/ls.txt" | grep -q "PATH.*FORMAT.*STEP.*BYTES.*FILES.*RANKS.*SAVED.*STATE"
check "ls prints a table with a header" $?
grep -Eq "^broken .* uncommitted" "$work/ls.txt"; check "ls marks an uncommitted save" $?
msg="$("$tessera" ls "$work/nothing" 2>&1)"; rc=$?
[ $rc -eq 1 ] && [ "$(echo "$msg" | wc -l)" -eq 1 ] && echo "$msg" | grep -q "does not exist"
check "ls of a missing directory: one line, exit 1" $?

# Issue 22, defect 15: a stray .safetensors file in the searched folder made `ls` print only
# "." and hid every checkpoint below it. A Hugging Face directory is listed and searched on
# (the Trainer keeps checkpoint-N/ subdirectories beside the final model).
mkdir -p "$work/stray/trainer/checkpoint-500"
cp "$work/runs/hf/model.safetensors" "$work/stray/stray.safetensors"
cp -r "$work/runs/a" "$work/stray/run_a"
cp "$work/runs/hf/model.safetensors" "$work/stray/trainer/model.safetensors"
cp "$work/runs/hf/model.safetensors" "$work/stray/trainer/checkpoint-500/model.safetensors"
"$tessera" ls --json "$work/stray" > "$work/stray.json"
$python - "$work/stray.json" <<'PY'
import json, sys
found = {c["path"]: c["format"] for c in json.load(open(sys.argv[1]))["checkpoints"]}
assert found == {".": "safetensors", "run_a": "tessera", "trainer": "safetensors",
                 "trainer/checkpoint-500": "safetensors"}, found
PY
check "ls: a stray .safetensors file hides no checkpoint below it; HF directories are searched on" $?

# ---- diff ----------------------------------------------------------------------------------
# Without --values nothing is said to be identical (issue 30): the values were not compared,
# and a checkpoint whose values differ has the same keys, shapes and dtypes. Exit 3.
"$tessera" diff "$work/runs/step100" "$work/runs/step100" > "$work/self.txt"; rc=$?
[ $rc -eq 3 ] && tail -n 1 "$work/self.txt" | grep -qx "same keys, shapes and dtypes; values not compared"
check "diff of a checkpoint with itself without --values: exit 3, values not compared" $?
"$tessera" diff "$work/runs/step100" "$work/runs/nested/step200" > "$work/diff.txt"; rc=$?
[ $rc -eq 3 ] && ! grep -q "identical" "$work/diff.txt" \
  && tail -n 1 "$work/diff.txt" | grep -qx "same keys, shapes and dtypes; values not compared" \
  && { [ $have_python -eq 0 ] || grep -q "metadata step: 100 -> 200" "$work/diff.txt"; }
check "diff without --values of checkpoints whose values differ: never 'identical', exit 3, metadata noted" $?
"$tessera" diff --json "$work/runs/step100" "$work/runs/nested/step200" > "$work/diff3.json"; rc=$?
[ $rc -eq 3 ] && $python -c "
import json, sys; d = json.load(open(sys.argv[1]))
assert d['identical'] is False and d['same_keys_shapes_dtypes'] is True and d['values_compared'] is False, d" "$work/diff3.json"
check "diff --json without --values: identical false, same_keys_shapes_dtypes true, exit 3" $?
"$tessera" diff --help > "$work/diff_help.txt"; rc=$?
[ $rc -eq 0 ] && tr -s ' \n' ' ' < "$work/diff_help.txt" | grep -q "3 same keys, shapes and dtypes but values not compared"
check "diff --help documents the exit statuses" $?
if [ $have_python -eq 1 ]; then
"$tessera" diff --values --json "$work/runs/step100" "$work/runs/nested/step200" > "$work/diff.json"; rc=$?
[ $rc -eq 1 ]; check "diff --values of checkpoints whose values differ: exit 1" $?
$python - "$work/diff.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["identical"] is False and doc["values_compared"] is True
diffs = {d["key"]: d for d in doc["differing_values"]}
assert set(diffs) == {"model.layers.3.w"}, diffs
assert diffs["model.layers.3.w"]["elements_differing"] == 1
assert abs(diffs["model.layers.3.w"]["max_abs_diff"] - 0.25) < 1e-6
assert doc["keys_compared"] == 305
PY
check "diff --values names the tensor that differs and its max absolute difference" $?
fi
cp -r "$work/runs/step100" "$work/copy"
"$tessera" diff --values "$work/runs/step100" "$work/copy" > "$work/same.txt"; rc=$?
[ $rc -eq 0 ] && grep -q "chunks and objects equal by checksum, not read" "$work/same.txt" && tail -n 1 "$work/same.txt" | grep -q identical
check "diff --values of a copy: identical by checksums, exit 0" $?
"$tessera" diff "$work/runs/step100" "$work/nothing" > /dev/null 2> "$work/diff.err"; rc=$?
[ $rc -eq 2 ] && [ "$(wc -l < "$work/diff.err")" -eq 1 ]; check "diff with a missing checkpoint: one line, exit 2" $?

# ---- rm-keys -------------------------------------------------------------------------------
before="$(md5sum "$work/copy/$(commit "$work/copy")")"
"$tessera" rm-keys "$work/copy" --prefix optimizer. --dry-run > "$work/dry.txt"; check "rm-keys --dry-run exits 0" $?
[ "$before" = "$(md5sum "$work/copy/$(commit "$work/copy")")" ] && grep -Eq "^would remove [1-9][0-9]* tensors and 1 objects" "$work/dry.txt"
check "rm-keys --dry-run says what it would do and changes nothing" $?
# A prefix that matches nothing is an error naming it, with the closest keys, and nothing is
# removed (issue 30: it exited 0 saying nothing).
msg="$("$tessera" rm-keys "$work/copy" --prefix optimizer. --prefix optimzer. 2>&1)"; rc=$?
[ $rc -eq 1 ] && [ "$(echo "$msg" | wc -l)" -eq 1 ] && echo "$msg" | grep -q "NotFound: no key of .* starts with the prefix 'optimzer.' (did you mean 'optimizer.'" \
  && echo "$msg" | grep -q "nothing was removed" && [ "$before" = "$(md5sum "$work/copy/$(commit "$work/copy")")" ]
check "rm-keys with a prefix that matches nothing: exit 1 naming it, did you mean, nothing removed" $?
msg="$("$tessera" rm-keys "$work/copy" --prefix zzzzzzzzzz --json 2>&1)"; rc=$?
[ $rc -eq 1 ] && echo "$msg" | grep -q "starts with the prefix 'zzzzzzzzzz'; nothing was removed"
check "rm-keys --json with a prefix close to nothing: exit 1, no suggestion" $?
# Issue 30, defect 1: a prefix that is not UTF-8 aborted the process (exit 134, an exception of
# the JSON writer); now a clear error, nothing removed.
listing_before="$(ls "$work/copy" | sort)"
for json in "" --json; do
  "$tessera" rm-keys "$work/copy" --prefix $'\xc3' $json > "$work/bad_prefix.out" 2> "$work/bad_prefix.err"
  rc=$?
  [ $rc -eq 1 ] && grep -q 'not valid UTF-8' "$work/bad_prefix.err"
  check "rm-keys --prefix \\xc3 $json: an error naming the prefix, not an abort (rc $rc)" $?
done
[ "$(ls "$work/copy" | sort)" = "$listing_before" ]; check "rm-keys with a bad prefix changed nothing" $?
"$tessera" rm-keys "$work/copy" --prefix optimizer. --prefix optimizer.step --progress --json > "$work/rm.json" 2> "$work/rm.err"
check "rm-keys exits 0" $?
$python - "$work/rm.json" "$work/copy" "$have_python" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
removed = r["removed_tensors"] + r["removed_objects"]
assert removed and all(k.startswith("optimizer.") for k in removed), removed
assert r["removed_objects"] == ["optimizer.step"]
assert [p["keys"] for p in r["prefixes"]] == [len(removed), 1]
assert r["bytes_freed"] > 0 and r["files_rewritten"] >= 1
if sys.argv[3] == "1":
    assert r["removed_tensors"] == ["optimizer.exp_avg"] and r["files_rewritten"] == 1
    assert r["bytes_freed"] >= 64 * 64 * 4
on_disk = sum(os.path.getsize(os.path.join(sys.argv[2], f)) for f in os.listdir(sys.argv[2])
              if f.endswith(".safetensors"))
assert on_disk == r["bytes_after"], (on_disk, r["bytes_after"])
PY
check "rm-keys frees the bytes on disk (--json report)" $?
tail -n 1 "$work/rm.err" | grep -Eq "^rm-keys: (\S+ \S+) / \1 \(100%\)"
check "rm-keys --progress ends at the bytes copied" $?
"$tessera" verify "$work/copy" > /dev/null; check "verify passes after rm-keys" $?
"$tessera" diff --json "$work/runs/step100" "$work/copy" > "$work/after.json"; rc=$?
[ $rc -eq 1 ] && $python -c "
import json, sys; d = json.load(open(sys.argv[1])); r = json.load(open(sys.argv[2]))
assert set(d['only_in_a']) == set(r['removed_tensors'] + r['removed_objects']), d
assert d['only_in_b'] == [] and d['changed'] == [], d" "$work/after.json" "$work/rm.json"
check "diff after rm-keys: the removed keys are only in a, exit 1" $?
msg="$("$tessera" rm-keys "$work/runs/hf" --prefix w 2>&1)"; rc=$?
[ $rc -eq 1 ] && [ "$(echo "$msg" | wc -l)" -eq 1 ] && echo "$msg" | grep -q "it is a safetensors checkpoint"
check "rm-keys of a Hugging Face checkpoint: one line naming the format, exit 1" $?

msg="$("$tessera" rm-keys "$work/copy" 2>&1)"; rc=$?
[ $rc -eq 2 ] && [ "$(echo "$msg" | wc -l)" -eq 1 ] && echo "$msg" | grep -q "^tessera: error: .*--prefix"
check "a command line that does not parse: one line naming what is missing, exit 2" $?
# CLI11's own codes were 105-109 (issue 30); the README says 2.
for args in "ls --no-such-flag" "diff onlyone" "rm-keys x --prefix a --io-threads two" "no-such-command" ""; do
  "$tessera" $args > /dev/null 2>&1; rc=$?
  [ $rc -eq 2 ]; check "usage error '$args': exit 2 (got $rc)" $?
done
"$tessera" --help > /dev/null; check "--help exits 0" $?
"$tessera" --version > "$work/version.txt"; rc=$?
[ $rc -eq 0 ] && grep -Eqx "tessera [0-9]+\.[0-9]+\.[0-9]+" "$work/version.txt" \
  && grep -q "project(tessera VERSION $(cut -d' ' -f2 "$work/version.txt")" "$(dirname "$0")/../CMakeLists.txt"
check "--version prints the project's version from CMake" $?

# ---- --json and text that is not UTF-8 (issue 22, defects 9 and 10) -------------------------
# Every JSON document prints, whatever bytes its strings hold: a string that is not UTF-8 comes
# out with U+FFFD in place of each bad byte, and "non_utf8" lists it by JSON Pointer with its
# exact bytes escaped (tools/json_output.h). Before: each of these aborted (rc 134) after the
# work was done.
json_check() {  # json_check FILE POINTER BYTES: valid JSON whose non_utf8 lists POINTER as BYTES
  $python - "$@" <<'PY'
import json, sys
raw = open(sys.argv[1], "rb").read()
doc = json.loads(raw.decode("utf-8"))  # strict UTF-8: fails on any byte that is not
entries = {e["pointer"]: e["bytes"] for e in doc["non_utf8"]}
assert entries.get(sys.argv[2]) == sys.argv[3], (sys.argv[2], doc["non_utf8"])
PY
}
cp -r "$work/runs/a" "$work/nu_rm"
# Issue 30, defect 1: a prefix that is not UTF-8 aborted (type_error.316, exit 134). Keys are
# UTF-8: RemoveKeys refuses such a prefix by name, one line, exit 1, nothing changed.
nu_before="$(ls "$work/nu_rm" | md5sum)"
for prefix in $'opt\xff' $'\xc3' $'optimizer.\xc3'; do
  for json in "" --json; do
    msg="$("$tessera" rm-keys "$work/nu_rm" --prefix "$prefix" $json 2>&1)"; rc=$?
    [ $rc -eq 1 ] && [ "$(echo "$msg" | wc -l)" -eq 1 ] && echo "$msg" | grep -q "InvalidArgument: RemoveKeys: the key prefix .* is not valid UTF-8" \
      && [ "$(ls "$work/nu_rm" | md5sum)" = "$nu_before" ]
    check "rm-keys $json with the prefix $(printf '%q' "$prefix") (not UTF-8): exit 1 naming it (got $rc)" $?
  done
done
"$tessera" convert "$work/runs/a" "$work/nu_dst_"$'\xff' --to safetensors --json --no-sync \
  > "$work/nu_convert.json"; rc=$?
[ $rc -eq 0 ] && json_check "$work/nu_convert.json" /destination "$work/nu_dst_\\xff"
check "convert --json to a destination that is not UTF-8 prints JSON" $?
# A PyTorch DCP checkpoint whose object key is not UTF-8 (its .metadata patched in place: the
# pickle's strings are length-prefixed), converted to safetensors, which skips objects.
"$tessera" convert "$work/runs/a" "$work/nu_dcp" --to torch_dist --no-sync > /dev/null
$python - "$work/nu_dcp/.metadata" <<'PY'
import sys
data = open(sys.argv[1], "rb").read()
assert b"optimizer.step" in data
open(sys.argv[1], "wb").write(data.replace(b"optimizer.step", b"optimizer.st\xff\xfe"))
PY
"$tessera" convert "$work/nu_dcp" "$work/nu_dcp_hf" --to safetensors --json --no-sync \
  > "$work/nu_dcp.json"; rc=$?
[ $rc -eq 0 ] && json_check "$work/nu_dcp.json" /skipped_objects/0 'optimizer.st\xff\xfe'
check "convert --json of a DCP checkpoint with an object key that is not UTF-8 prints JSON" $?
mkdir -p "$work/nu_ls/run_"$'\xff'
cp -r "$work/runs/a" "$work/nu_ls/run_"$'\xff'/ckpt
"$tessera" ls --json "$work/nu_ls" > "$work/nu_ls.json"; rc=$?
[ $rc -eq 0 ] && json_check "$work/nu_ls.json" /checkpoints/0/path 'run_\xff/ckpt'
check "ls --json of a directory whose name is not UTF-8 prints JSON" $?
"$tessera" inspect --json "$work/nu_dcp" > "$work/nu_inspect.json"; rc=$?
[ $rc -eq 0 ] && json_check "$work/nu_inspect.json" /objects/0/key 'optimizer.st\xff\xfe'
check "inspect --json of a checkpoint whose key is not UTF-8 prints JSON" $?
"$tessera" diff --json "$work/nu_dcp" "$work/nu_dcp" > "$work/nu_diff.json"; rc=$?
[ $rc -eq 3 ] && $python -c 'import json,sys; json.loads(open(sys.argv[1],"rb").read().decode())' "$work/nu_diff.json"
check "diff --json of checkpoints with a key that is not UTF-8 prints JSON" $?

# Issue 30, defect 1, for every command: arguments that are not UTF-8 (paths, keys, prefixes)
# never abort (nlohmann's dump throws on such strings unless told not to): each command exits
# with its status (< 128), prints at most one error line, and --json output that is printed is
# strict UTF-8 JSON.
bad=$'\xc3'
sweep() {  # sweep NAME ARGS...: run `tessera ARGS...`, check the outcome
  local name="$1"; shift
  "$tessera" "$@" > "$work/sweep.out" 2> "$work/sweep.err"; local rc=$?
  [ $rc -lt 128 ] && [ "$(wc -l < "$work/sweep.err")" -le 1 ] \
    && { [ ! -s "$work/sweep.out" ] || ! printf '%s ' "$@" | grep -q -- "--json" \
         || $python -c 'import json,sys; json.loads(open(sys.argv[1],"rb").read().decode())' "$work/sweep.out"; }
  check "not UTF-8: $name exits $rc, no abort, at most one error line" $?
}
cp -r "$work/runs/a" "$work/sweep_ck"
for json in "" --json; do
  sweep "inspect --keys $json" inspect "$work/sweep_ck" --keys "model.${bad}*" $json
  sweep "inspect path $json" inspect "$work/nope_$bad" $json
  sweep "ls $json" ls "$work/nope_$bad" $json
  sweep "diff $json" diff "$work/sweep_ck" "$work/nope_$bad" $json
  sweep "rm-keys path $json" rm-keys "$work/nope_$bad" --prefix model. $json
  sweep "rm-keys prefix $json" rm-keys "$work/sweep_ck" --prefix "model.$bad" $json
  sweep "convert --keys $json" convert "$work/sweep_ck" "$work/sweep_dst1$json" --keys "$bad" --to safetensors --no-sync $json
  sweep "convert --strip-prefix $json" convert "$work/sweep_ck" "$work/sweep_dst2$json" --strip-prefix "$bad" --to safetensors --no-sync $json
  sweep "convert destination $json" convert "$work/sweep_ck" "$work/sweep_dst3_$bad$json" --to tessera --no-sync $json
  sweep "latest $json" latest "$work/nope_$bad" $json
  sweep "prune $json" prune "$work/nope_$bad" --keep-last 1 $json
done
sweep "verify" verify "$work/nope_$bad"
sweep "finalize" finalize "$work/nope_$bad"
sweep "demo --out" demo --out "$work/sweep_demo_$bad" --size 1MiB --no-sync
sweep "unknown option" inspect "$work/sweep_ck" "--$bad"

# Defect 10: error lines carry no control character raw (a hostile key's or path's escape
# sequences), escaped \xNN as the tables escape them.
msg="$("$tessera" verify "$work/no_such_"$'\x1b]0;pwned\x07\x1b[2J' 2>&1)"; rc=$?
[ $rc -ne 0 ] && ! printf '%s' "$msg" | grep -q $'\x1b' && printf '%s' "$msg" | grep -qF 'no_such_\x1b]0;pwned\x07\x1b[2J'
check "an error naming a path with escape sequences prints them escaped" $?
if [ $have_python -eq 1 ]; then
$python - "$work/hostile" <<'PY'
import sys
import numpy as np
import tessera
tessera.save({"w\x1b]0;pwned\x07\x1b[31m": np.arange(1024, dtype=np.float32)}, sys.argv[1])
PY
data="$(ls "$work/hostile"/*.safetensors | head -n 1)"
$python - "$data" <<'PY'
import sys
data = bytearray(open(sys.argv[1], "rb").read())
data[-100] ^= 0x10  # a byte of the tensor's elements: a checksum mismatch naming the key
open(sys.argv[1], "wb").write(bytes(data))
PY
msg="$("$tessera" verify "$work/hostile" 2>&1)"; rc=$?
[ $rc -ne 0 ] && ! printf '%s' "$msg" | grep -q $'\x1b' && printf '%s' "$msg" | grep -qF "key 'w\x1b]0;pwned\x07\x1b[31m'"
check "an error naming a hostile key prints its escape sequences escaped" $?
fi

# ---- rank-local saves and finalize ---------------------------------------------------------
"$tessera" demo --out "$work/rl" --size 8MiB --no-sync --rank-local --save-layout tp2,dp2 \
  --load-layout tp4,dp1 > "$work/rl.out" 2>&1
check "demo --rank-local saves without a collective and loads resharded" $?
[ "$(ls "$work/rl" | grep -c '^tessera.manifest.rank-')" -eq 4 ] && [ "$(ls "$work/rl" | grep -cE '^tessera\.manifest\.[0-9]{20}$')" -eq 1 ]
check "a rank-local save leaves one rank manifest per rank and one commit (rank 0's reference)" $?
"$tessera" verify "$work/rl" --quiet > /dev/null
check "verify reads the rank manifests as one checkpoint" $?
COLUMNS=200 "$tessera" ls "$work/rl" > "$work/rl_ls.txt"
grep -q "committed (rank-local, 4 of 4 parts, not finalized)" "$work/rl_ls.txt" && grep -Eq "  4  .* committed" "$work/rl_ls.txt"
check "ls: a complete rank-local save is committed, 4 ranks, not finalized" $?
"$tessera" inspect "$work/rl" > "$work/rl_inspect.txt" && grep -q "^  state      rank-local save, not finalized: 4 rank manifests" "$work/rl_inspect.txt"
check "inspect reads an unfinalized rank-local save and says it is one" $?
cp -r "$work/rl" "$work/rl_rm"
"$tessera" rm-keys "$work/rl_rm" --prefix optimizer. > /dev/null && "$tessera" verify "$work/rl_rm" --quiet > /dev/null && [ -n "$(commit "$work/rl_rm")" ] && [ "$(ls "$work/rl_rm" | grep -c '^tessera.manifest.rank-')" -eq 0 ]
check "rm-keys of an unfinalized rank-local save commits a whole manifest without the keys" $?
"$tessera" finalize "$work/rl" > "$work/finalize.out"
check "finalize exits 0" $?
"$tessera" diff "$work/rl" "$work/rl_rm" > /dev/null; [ $? -eq 1 ]
check "diff of a finalized and a rank-local-then-rm-keys checkpoint: they differ (exit 1)" $?
[ -n "$(commit "$work/rl")" ] && [ "$(ls "$work/rl" | grep -c '^tessera.manifest.rank-')" -eq 0 ]
check "finalize merges the rank manifests into one manifest, the commit" $?
"$tessera" verify "$work/rl" --quiet > /dev/null
check "the finalized checkpoint verifies" $?
msg="$("$tessera" finalize "$work/rl" 2>&1)"; rc=$?
[ $rc -ne 0 ] && echo "$msg" | grep -q "nothing to finalize"
check "finalize of a finalized checkpoint: one line saying there is nothing to do" $?
rm "$work/rl/$(commit "$work/rl")"
"$tessera" demo --out "$work/rl2" --size 4MiB --no-sync --rank-local > /dev/null 2>&1
rm "$work/rl2/"tessera.manifest.rank-*-r00001
msg="$("$tessera" verify "$work/rl2" 2>&1)"; rc=$?
[ $rc -ne 0 ] && echo "$msg" | grep -q "lacks the manifests of rank 1 (of 4)"
check "a rank-local save missing a rank manifest: an error naming the rank" $?
COLUMNS=200 "$tessera" ls "$work/rl2" | grep -q "uncommitted (rank-local, 3 of 4 parts"
check "ls: an incomplete rank-local save is uncommitted, 3 of 4 parts" $?

"$tessera" bench rank-local --size 4MiB --repeat 1 --layout tp2,dp2 > "$work/bench_rl.json"
check "bench rank-local exits 0" $?
$python -c 'import json,sys; j=json.load(open(sys.argv[1])); assert j["ranks"] == 4 and j["rank_local_save_seconds"] > 0 and j["collective_save_seconds"] > 0, j' "$work/bench_rl.json"
check "bench rank-local prints both save times as JSON" $?

if [ $failures -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all operations checks passed"
