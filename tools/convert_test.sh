#!/usr/bin/env bash
# End-to-end test of `tessera convert` and of Hugging Face checkpoints in inspect and verify.
# Usage: convert_test.sh PATH_TO_TESSERA
set -uo pipefail
tessera="$1"
python=/usr/bin/python3
here="$(cd "$(dirname "$0")/.." && pwd)"
testdata="$here/src/format/huggingface/testdata"
work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-convert-XXXXXX")"
trap 'rm -rf "$work"' EXIT
failures=0
check() {  # check NAME CONDITION-EXIT-CODE
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAILED: $1"; failures=$((failures + 1)); fi
}

"$tessera" demo --out "$work/ck" --size 8MiB --save-layout tp2,dp2 --load-layout tp1,dp1 \
  --no-sync > /dev/null
check "demo writes a sharded checkpoint" $?

# Export: several shards, the index, nothing else; an independent reader agrees.
out="$("$tessera" convert "$work/ck" "$work/hf" --to safetensors --max-shard-size 2MB --quiet)"
rc=$?
echo "$out"
check "convert --to safetensors exits 0" $rc
echo "$out" | grep -q "^converted $work/ck (tessera) to $work/hf (safetensors): " &&
  echo "$out" | grep -q "not exported: 1 objects (safetensors files hold only tensors): optimizer.step"
check "convert says what it wrote and which objects it left out" $?
$python "$testdata/read_hf.py" "$work/hf" > "$work/hf.json"
check "an independent reader reads the export" $?
$python - "$work/hf.json" "$work/hf" <<'PY'
import json, os, sys
doc = json.load(open(sys.argv[1]))
files = doc["files"]
n = len(files)
assert n >= 3, files
assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], files
assert sorted(os.listdir(sys.argv[2])) == sorted(files + ["model.safetensors.index.json"])
assert "decoder.layers.0.mlp.linear_fc1.weight" in doc["tensors"]
assert all(t["file"] in files for t in doc["tensors"].values())
PY
check "shards are model-0000i-of-0000N.safetensors with model.safetensors.index.json" $?
[ -z "$(ls -A "$work" | grep tessera-convert)" ]
check "no temporary directory is left" $?

# The export reads back: inspect and verify say what the format lacks; a load of every tensor.
"$tessera" inspect "$work/hf" > "$work/inspect.txt"
check "inspect reads the Hugging Face export" $?
grep -q "format *safetensors (no checksums)" "$work/inspect.txt"; check "inspect names the format" $?
msg="$("$tessera" verify "$work/hf")"; rc=$?
echo "$msg"
[ $rc -eq 0 ] && echo "$msg" | grep -q "structure only, the format has no checksums"
check "verify of Hugging Face files says it checked structure only" $?
first="$(ls "$work/hf" | grep '^model-00001-of-' )"
"$tessera" inspect --json "$work/hf/$first" > "$work/one.json"
$python -c "
import json, sys; d = json.load(open(sys.argv[1]))
assert d['format'] == 'safetensors' and d['checksums'] is False and len(d['files']) == 1, d" \
  "$work/one.json"
check "inspect --json reads one .safetensors file by path" $?

# Under mpirun, the ranks split the files and write the same bytes as one process.
if command -v mpirun > /dev/null; then
  msg="$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 2 \
    "$tessera" convert "$work/ck" "$work/hf_mpi" --to safetensors --max-shard-size 2MB \
    --comm mpi --quiet 2>&1)"
  rc=$?
  if echo "$msg" | grep -q "built without MPI"; then
    echo "skipped: convert --comm mpi (this tessera was built without MPI)"
  else
    echo "$msg"
    [ $rc -eq 0 ] && [ "$(echo "$msg" | grep -c '^converted ')" -eq 1 ]
    check "convert --comm mpi -np 2 exits 0 and one rank reports" $?
    same=0
    for f in "$work"/hf/*; do cmp -s "$f" "$work/hf_mpi/$(basename "$f")" || same=1; done
    [ "$(ls "$work/hf" | wc -l)" -eq "$(ls "$work/hf_mpi" | wc -l)" ] || same=1
    check "2 MPI ranks write the same files as one process" $same
  fi
fi

# Selection, renaming, bf16, one file.
"$tessera" convert "$work/ck" "$work/bf16" --to safetensors --keys decoder. embedding. \
  --strip-prefix decoder. --dtype bf16 --quiet > /dev/null
check "convert --keys --strip-prefix --dtype bf16 exits 0" $?
$python - "$testdata/read_hf.py" "$work/bf16" <<'PY'
import json, subprocess, sys
doc = json.loads(subprocess.check_output([sys.executable, sys.argv[1], sys.argv[2]]))
assert doc["files"] == ["model.safetensors"] and doc["index"] is None, doc["files"]
names = set(doc["tensors"])
assert "layers.0.mlp.linear_fc1.weight" in names, sorted(names)[:5]
assert not any(n.startswith(("decoder.", "optimizer.")) for n in names), sorted(names)[:5]
assert any(n.startswith("embedding.") for n in names)
assert all(t["dtype"] == "BF16" for t in doc["tensors"].values())
PY
check "only the selected keys, renamed, all BF16, in one model.safetensors" $?

# To tessera and back, on 3 ranks: verify checks every checksum; objects are kept.
"$tessera" convert "$work/hf" "$work/back" --to tessera --ranks 3 --quiet > /dev/null
check "convert --to tessera --ranks 3 exits 0" $?
"$tessera" verify "$work/back" | grep -q "checksums match"
check "the tessera conversion verifies with checksums" $?
"$tessera" convert "$work/ck" "$work/tsr" --to tessera --json --quiet > "$work/tsr.json"
$python -c "
import json, sys; d = json.load(open(sys.argv[1]))
assert d['objects'] == 1 and d['skipped_objects'] == [] and d['source_format'] == 'tessera', d
assert 'tessera.manifest.00000000000000000001' in d['files'], d['files']" "$work/tsr.json"
check "tessera to tessera keeps the objects (--json report)" $?

# PyTorch DCP: torch 1.13's own reader loads the conversion (flavor 1.13, several files and
# threads), and every tensor equals the safetensors export of the same checkpoint above.
out="$("$tessera" convert "$work/ck" "$work/dcp" --to torch_dist --torch-dist-flavor 1.13 \
  --max-shard-size 3MB --threads 3 --buffer 4MiB --quiet)"; rc=$?
echo "$out"
check "convert --to torch_dist exits 0" $rc
echo "$out" | grep -q "^converted $work/ck (tessera) to $work/dcp (torch_dist): .*1 objects"
check "convert says it wrote a torch_dist checkpoint with the object" $?
$python - "$work/dcp" "$work/hf.json" "$here/src/format/torch_dist/testdata" <<'PY'
import json, os, sys
sys.path.insert(0, sys.argv[3])
import torch113_compat  # noqa: F401 (torch 1.13's DCP under Python 3.11)
import torch
from torch.distributed._shard import checkpoint as dcp

names = os.listdir(sys.argv[1])
assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) >= 3, names
reader = dcp.FileSystemReader(sys.argv[1])
hf = json.load(open(sys.argv[2]))["tensors"]
dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "F64": torch.float64}
state = {k: torch.zeros(t["shape"], dtype=dtypes[t["dtype"]]) for k, t in hf.items()}
state["optimizer.step"] = None
dcp.load_state_dict(state, reader, no_dist=True)
for key, t in hf.items():
    got = state[key].contiguous().view(torch.uint8).numpy().tobytes().hex()
    assert got == t["hex"], key
assert state["optimizer.step"] is not None
print(f"torch 1.13 loaded {len(hf)} tensors equal to the safetensors export")
PY
check "torch 1.13's load_state_dict reads the torch_dist conversion, values equal" $?

# Errors: one line, exit 1, nothing left behind.
msg="$("$tessera" convert "$work/ck" "$work/hf" --to safetensors 2>&1)"; rc=$?
[ $rc -eq 1 ] && echo "$msg" | grep -q "tessera: error: AlreadyExists: the destination $work/hf exists and is not empty"
check "an existing destination is refused" $?
msg="$("$tessera" convert "$work/ck" "$work/dcp_bad" --to torch_dist --torch-dist-flavor 1.12 2>&1)"
rc=$?
[ $rc -ne 0 ] && echo "$msg" | grep -q "torch-dist-flavor"
check "--torch-dist-flavor takes only 2.x or 1.13" $?
[ ! -e "$work/dcp_bad" ]; check "... and creates nothing" $?
msg="$("$tessera" convert "$work/ck" "$work/x" --to safetensors --dtype i8 2>&1)"; rc=$?
[ $rc -eq 1 ] && echo "$msg" | grep -q "\-\-dtype must be bf16, f16, f32 or f64, not 'I8'"
check "--dtype takes only float targets" $?
msg="$("$tessera" convert "$work/ck" "$work/x" --to safetensors --keys nothing. 2>&1)"; rc=$?
[ $rc -eq 1 ] && echo "$msg" | grep -q "starts with the prefix 'nothing.'; nothing was converted" && [ ! -e "$work/x" ]
check "--keys that match nothing is an error" $?
# Issue 30: each prefix must match (one typo among good prefixes is an error too), with a
# "did you mean" of the closest keys and prefixes.
msg="$("$tessera" convert "$work/ck" "$work/x" --to safetensors --keys decoder. embeding. 2>&1)"; rc=$?
[ $rc -eq 1 ] && [ "$(echo "$msg" | wc -l)" -eq 1 ] && echo "$msg" | grep -q "prefix 'embeding.' (did you mean 'embedding.'" && [ ! -e "$work/x" ]
check "--keys with one prefix that matches nothing: an error naming it, did you mean" $?

# The progress bar: drawn when asked (or on a terminal), never with --quiet.
"$tessera" convert "$work/ck" "$work/p1" --to safetensors --progress > /dev/null 2> "$work/bar.txt"
check "convert --progress exits 0" $?
grep -q "convert: .*(100%)" "$work/bar.txt"
check "--progress draws a bar that reaches 100%" $?
"$tessera" convert "$work/ck" "$work/p2" --to safetensors > /dev/null 2> "$work/nobar.txt"
[ ! -s "$work/nobar.txt" ]; check "no bar when stderr is not a terminal" $?

# Memory is bounded by the buffer, not the checkpoint: a 96 MiB export with an 8 MiB buffer.
# (Not under AddressSanitizer, whose shadow memory and quarantine dwarf the figure.)
# (grep reads all of ldd's output: with -q it could exit first, and pipefail would then see
# ldd's SIGPIPE and run the check under AddressSanitizer after all.)
if ldd "$tessera" 2> /dev/null | grep libasan > /dev/null; then
  echo "skipped: resident memory under AddressSanitizer"
else
  "$tessera" demo --out "$work/big" --size 96MiB --save-layout tp2,dp1 --load-layout tp1,dp1 \
    --no-sync > /dev/null
  $python - "$tessera" "$work/big" "$work/big_hf" <<'PY'
import resource, subprocess, sys
subprocess.check_call([sys.argv[1], "convert", sys.argv[2], sys.argv[3], "--to", "safetensors",
                       "--buffer", "8MiB", "--threads", "2", "--quiet", "--no-sync"],
                      stdout=subprocess.DEVNULL)
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(f"peak resident memory of the conversion: {peak_mib:.1f} MiB")
assert peak_mib < 48, peak_mib
PY
  check "a 96 MiB conversion with --buffer 8MiB stays under 48 MiB resident" $?
  $python - "$tessera" "$work/big" "$work/big_dcp" <<'PY'
import resource, subprocess, sys
subprocess.check_call([sys.argv[1], "convert", sys.argv[2], sys.argv[3], "--to", "torch_dist",
                       "--buffer", "8MiB", "--threads", "2", "--quiet", "--no-sync"],
                      stdout=subprocess.DEVNULL)
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(f"peak resident memory of the torch_dist conversion: {peak_mib:.1f} MiB")
assert peak_mib < 48, peak_mib
PY
  check "a 96 MiB conversion to torch_dist with --buffer 8MiB stays under 48 MiB resident" $?
fi

if [ "$failures" -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all convert checks passed"
