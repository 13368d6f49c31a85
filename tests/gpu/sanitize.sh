#!/usr/bin/env bash
# The GPU suite under compute-sanitizer, for both FA2 libraries: memcheck (out-of-bounds
# and misaligned accesses, leaks of device memory errors) and racecheck (shared-memory
# hazards between threads of a block), each over every test of the FA2 and core GPU files.
#
#   SM7X_LIBRARY_PATH=<dir with the .abi3.so files> tests/gpu/sanitize.sh [pytest args...]
#
# Extra arguments go to pytest (e.g. -k "1-1 or 333" for a quicker subset: the sanitizers
# slow kernels down 10-100x). ARCHS (default "sm75 sm70") and TOOLS (default "memcheck
# racecheck") choose the runs; on a GPU newer than Turing the library is forced, as the GPU
# tests do. Exit status: 0 when every run is clean, else the number of failing runs. Each
# run's summary line ("ERROR SUMMARY: N errors" / "RACECHECK SUMMARY: ...") is printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer is not on PATH (CUDA toolkit bin/)" >&2; exit 2; }
failed=0
for arch in ${ARCHS:-sm75 sm70}; do
  for tool in ${TOOLS:-memcheck racecheck}; do
    log=$(mktemp)
    # the serving tests run both the narrow and the wide serving kernels (fp16 and 8-bit) and the combine; the
    # backward tests every main, dQ and preprocess/convert kernel; the multi-device tests
    # skip on a machine with one GPU
    SM7X_FA2_FORCE=$arch compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
      python -m pytest -q -p no:cacheprovider -W ignore "tests/gpu/test_fa2_$arch.py" \
      tests/gpu/test_fa2_serving.py tests/gpu/test_fa2_kv8.py tests/gpu/test_fa2_backward.py tests/gpu/test_core_cuda.py \
      tests/gpu/test_fa2_multi_device.py "$@" > "$log" 2>&1
    rc=$?
    echo "== $arch $tool: exit $rc; $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)"
    grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -2
    if [ $rc -ne 0 ]; then failed=$((failed + 1)); grep -m 20 -E "=========  (Invalid|Error|Race)" "$log"; fi
    rm -f "$log"
  done
done
exit $failed
