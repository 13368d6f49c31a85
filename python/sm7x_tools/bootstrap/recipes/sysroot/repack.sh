#!/usr/bin/env bash
# Make a glibc 2.$GLIBC_MINOR sysroot in conda-forge's layout from the zig wheel: zig
# writes link stubs and startup files for a target glibc when it links for it; the
# headers are zig's glibc headers, pinned to that version.
set -euo pipefail
sysroot="$PREFIX/x86_64-conda-linux-gnu/sysroot"
lib="$sysroot/usr/lib"
work="$SRC_DIR/_sysroot"
mkdir -p "$work" "$lib" "$sysroot/usr/include"
unzip -q *.whl -d "$work/wheel"
zigdir="$work/wheel/ziglang"
chmod +x "$zigdir/zig"
export ZIG_GLOBAL_CACHE_DIR="$work/cache" ZIG_LOCAL_CACHE_DIR="$work/lcache"
target="x86_64-linux-gnu.2.$GLIBC_MINOR"
echo 'int main(void){return 0;}' > "$work/m.c"
"$zigdir/zig" cc -target "$target" -o "$work/m" "$work/m.c" -lm -lpthread -ldl -lrt -lutil -lresolv

# exactly one of each in zig's cache, or zig changed and this script must follow
one() {
  local hits
  hits=$(find "$ZIG_GLOBAL_CACHE_DIR/o" -name "$1")
  if [[ -z "$hits" || $(wc -l <<<"$hits") != 1 ]]; then
    echo "error: zig's cache has ${hits:-no} $1 (expected one); update repack.sh for zig $(\"$zigdir/zig\" version)" >&2
    exit 1
  fi
  echo "$hits"
}
for so in libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 libutil.so.1 libresolv.so.2; do
  install -m644 "$(one "$so")" "$lib/$so"
  # the -l names: copies, not symlinks (a noarch package may hold none)
  [[ $so == libc.so.6 ]] || cp "$lib/$so" "$lib/${so%.so.*}.so"
done
install -m644 "$(one libld.so.2)" "$lib/ld-linux-x86-64.so.2"
install -m644 "$(one libc_nonshared.a)" "$lib/libc_nonshared.a"
install -m644 "$(one crt1.o)" "$lib/crt1.o"
cp "$lib/crt1.o" "$lib/Scrt1.o"  # zig's crt1.o is position-independent
# libc.so is a linker script, as in glibc (paths are looked up inside the sysroot)
printf '%s\n' 'OUTPUT_FORMAT(elf64-x86-64)' \
  'GROUP ( /usr/lib/libc.so.6 /usr/lib/libc_nonshared.a AS_NEEDED ( /usr/lib/ld-linux-x86-64.so.2 ) )' > "$lib/libc.so"
# crti.o/crtn.o, the _init/_fini prologue and epilogue gcc links into every shared
# object, as glibc's sysdeps/x86_64/crt[in].S make them (without the gprof hook)
printf '%s\n' '.section .init,"ax",@progbits' '.globl _init' '.hidden _init' '.type _init,@function' '_init:' \
  'subq $8, %rsp' '.section .fini,"ax",@progbits' '.globl _fini' '.hidden _fini' '.type _fini,@function' \
  '_fini:' 'subq $8, %rsp' '.section .note.GNU-stack,"",@progbits' > "$work/crti.s"
printf '%s\n' '.section .init,"ax",@progbits' 'addq $8, %rsp' 'ret' '.section .fini,"ax",@progbits' \
  'addq $8, %rsp' 'ret' '.section .note.GNU-stack,"",@progbits' > "$work/crtn.s"
"$zigdir/zig" cc -target "$target" -c "$work/crti.s" -o "$lib/crti.o"
"$zigdir/zig" cc -target "$target" -c "$work/crtn.s" -o "$lib/crtn.o"

# headers: zig's search order for x86_64 glibc, the first copy of a file wins
inc="$zigdir/lib/libc/include"
for d in x86-linux-gnu generic-glibc x86-linux-any any-linux-any; do
  cp -an "$inc/$d/." "$sysroot/usr/include/"
done
# zig passes -D__GLIBC_MINOR__ per target, before any header; a sysroot says it at the
# top of features.h
h="$sysroot/usr/include/features.h"
patch_once() {  # patch_once FILE SED-SCRIPT WHAT: the edit must change the file
  local before
  before=$(sha256sum < "$1")
  sed -i "$2" "$1"
  [[ $(sha256sum < "$1") != "$before" ]] \
    || { echo "error: zig's $(basename "$1") no longer has what repack.sh edits ($3)" >&2; exit 1; }
}
patch_once "$h" '/^\/\* zig patch: we pass `-D__GLIBC_MINOR__=XX` depending on the target. \*\/$/d' "__GLIBC_MINOR__ note"
patch_once "$h" "s|^#define\t_FEATURES_H\t1\$|&\n#define __GLIBC_MINOR__ $GLIBC_MINOR  /* this sysroot's glibc */|" "_FEATURES_H"
# zig's headers are glibc 2.41's and do not version the C23 math block: declarations of
# functions glibc added in 2.40/2.41 (sinpi, cospi, rsqrt, ...) that 2.28 lacks, and that
# clash with CUDA 12's own math_functions.h. Off below 2.40, as before them; exp10, which
# the block also holds, stays a GNU extension as it was
patch_once "$sysroot/usr/include/bits/libc-header-start.h" \
  's/^#if __GLIBC_USE (IEC_60559_FUNCS_EXT) || __GLIBC_USE (ISOC23)$/#if (__GLIBC_USE (IEC_60559_FUNCS_EXT) || __GLIBC_USE (ISOC23)) \&\& __GLIBC_MINOR__ >= 40/' \
  "IEC_60559_FUNCS_EXT_C23"
patch_once "$sysroot/usr/include/bits/mathcalls.h" \
  's/^__MATHCALL_VEC (exp10,, (_Mdouble_ __x));$/#endif\n#if __GLIBC_USE (IEC_60559_FUNCS_EXT_C23) || defined __USE_GNU\n__MATHCALL_VEC (exp10,, (_Mdouble_ __x));\n#endif\n#if __GLIBC_USE (IEC_60559_FUNCS_EXT_C23)/' \
  "exp10"
# a header a later glibc added errors out when included for 2.28; __has_include (which
# libstdc++ uses, e.g. for sys/single_threaded.h) must not find it at all
{ grep -rlE '^[[:space:]]*#[[:space:]]*error .*did not exist' "$sysroot/usr/include" || true; } | while read -r h; do
  need=$(grep -oE '__GLIBC_MINOR__ < [0-9]+' "$h" | head -1 | grep -oE '[0-9]+$' || true)
  if [[ -n $need && $need -gt $GLIBC_MINOR ]]; then rm "$h"; echo "dropped ${h#$sysroot/} (glibc 2.$need)"; fi
done
mkdir -p "$PREFIX/share/licenses/sysroot_linux-64"
cp "$zigdir/lib/libc/glibc/LICENSES" "$PREFIX/share/licenses/sysroot_linux-64/glibc-LICENSES"
cp "$zigdir/LICENSE" "$PREFIX/share/licenses/sysroot_linux-64/zig-LICENSE"
