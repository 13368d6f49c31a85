#!/usr/bin/env bash
# A vLLM 0.26 install for a GPU machine that has no network but already has torch 2.11 and
# most of vLLM's Python dependencies, as the real-engine tests (this folder) were run.
# Built here from PyPI, carried there, unpacked onto PYTHONPATH:
#
#     tests/vllm_engine/offline_vllm.sh OUT [HAVE]
#
# OUT/vllm-py.tar.xz   the vllm 0.26.0 wheel's files without what an attention-backend test
#                      does not load: the FlashAttention 2/3 and MoE extensions (450 MB),
#                      the vllm-rs binary, the vendored include trees and other Pythons'
#                      deep_gemm builds; a placeholder vllm/vllm_flash_attn/_vllm_fa2_C.py
#                      (model inspection imports vllm_flash_attn, which raises without it)
# OUT/_C_stable_libtorch.abi3.so.xz   the extension vllm/platforms/cuda.py always imports
#                      (79 MB, 56 MB as xz: apart, so each part can travel on its own)
# OUT/whl/             cp312 wheels of the modules of tests/vllm_plugin/requirements-0.26.txt
#                      and of ENGINE_EXTRA_PINS (below) that the target lacks: HAVE is a
#                      file of the target's installed distribution names (`pip list
#                      --format freeze | cut -d= -f1`), one per line; without it, every
#                      pinned module but vllm
# OUT/sm7x-0.0.0.dist-info   sm7x's two vLLM entry points (vLLM reads them from installed
#                      metadata; sm7x itself comes from python/ on PYTHONPATH)
#
# There: pip install --no-index --no-deps --target SITE OUT/whl/*.whl; untar vllm-py.tar.xz
# and the extension and the dist-info into SITE; PYTHONPATH=SITE:python SM7X_LIBRARY_PATH=
# (the built libraries) VLLM_USE_FLASHINFER_SAMPLER=0 (no flashinfer; sm7x.bench's engine
# children set it). Only Python 3.12 / x86-64 targets.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: offline_vllm.sh OUT [HAVE]}
have=${2:-/dev/null}
[[ -r $have ]] || { echo "offline_vllm.sh: HAVE file '$have' cannot be read (one installed distribution name per line, or leave it out)" >&2; exit 2; }
req=tests/vllm_plugin/requirements-0.26.txt
# what the engine tests load beyond the plugin tests' imports: blake3 (vLLM hashes
# multimodal inputs with it; the vision-tower engine failed to start without it)
ENGINE_EXTRA_PINS=(blake3==1.0.11)
version=$(sed -n 's/^vllm==//p' "$req")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# this script's own outputs are made afresh: wheels left from another pin list would give
# pip two versions of one module there
rm -rf "$out/whl" "$out/sm7x-0.0.0.dist-info"
mkdir -p "$out/whl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 1 17 24 27 28 31 34 35; do
  plat+=(--platform "manylinux_2_${n}_x86_64")
done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

python3 -m pip download -q --no-deps "${plat[@]}" -d "$work" "vllm==$version"
(cd "$work" && python3 -m zipfile -e vllm-"$version"-*.whl unpacked)
v="$work/unpacked/vllm"
rm -f "$v"/vllm_flash_attn/_vllm_fa2_C.abi3.so "$v"/vllm_flash_attn/_vllm_fa3_C.abi3.so \
      "$v"/_moe_C_stable_libtorch.abi3.so "$v"/vllm-rs
find "$v/third_party" -type d -name include -prune -exec rm -rf {} +
find "$v/third_party" -name '_C.cpython-3*' ! -name '_C.cpython-312-*' -delete
echo '# placeholder: this install has no FlashAttention extension' > "$v/vllm_flash_attn/_vllm_fa2_C.py"
xz -T0 -9 -c "$v/_C_stable_libtorch.abi3.so" > "$out/_C_stable_libtorch.abi3.so.xz.part"
mv "$out/_C_stable_libtorch.abi3.so.xz.part" "$out/_C_stable_libtorch.abi3.so.xz"
rm "$v/_C_stable_libtorch.abi3.so"
tar -C "$work/unpacked" -cJf "$out/vllm-py.tar.xz.part" vllm "vllm-$version.dist-info"
mv "$out/vllm-py.tar.xz.part" "$out/vllm-py.tar.xz"

# the pinned modules the target lacks (names compared normalized: - _ . alike, any case)
norm() { tr 'A-Z_.' 'a-z--'; }
grep -E '^[A-Za-z0-9_.-]+==' "$req" | grep -v '^vllm==' > "$work/pins"
# and the engine tests' own (ENGINE_EXTRA_PINS)
printf '%s\n' "${ENGINE_EXTRA_PINS[@]}" >> "$work/pins"
norm < "$have" | sort -u > "$work/have"
while IFS= read -r pin; do
  name=$(echo "${pin%%==*}" | norm)
  grep -qx "$name" "$work/have" || echo "$pin"
done < "$work/pins" > "$work/missing"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/whl" -r "$work/missing"

d="$out/sm7x-0.0.0.dist-info"
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: sm7x\nVersion: 0.0.0\n' > "$d/METADATA"
python3 - "$d/entry_points.txt" <<'PY'
import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
with open(sys.argv[1], "w") as f:
    for group in ("vllm.general_plugins", "vllm.platform_plugins"):
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps[group].items()) + "\n")
PY
echo "$(wc -l < "$work/missing") wheels in $out/whl; $(du -sh "$out" | cut -f1) in all"
