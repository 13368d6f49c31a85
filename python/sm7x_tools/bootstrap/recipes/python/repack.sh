#!/usr/bin/env bash
set -euo pipefail
if [[ ! -x "$SRC/bin/python$SHORT" ]]; then
  echo "error: no CPython at $SRC (expected $SRC/bin/python$SHORT); install it with pyenv or remove it from python/sm7x_tools/bootstrap/recipes/python/variants.yaml" >&2
  exit 1
fi
mkdir -p "$PREFIX"
# copy without third-party packages and test suites
tar -C "$SRC" \
  --exclude="./lib/python$SHORT/site-packages/*" \
  --exclude="./lib/python$SHORT/test" \
  --exclude="./lib/python$SHORT/idlelib/idle_test" \
  --exclude="./lib/python$SHORT/tkinter/test" \
  --exclude="./lib/python$SHORT/lib2to3/tests" \
  --exclude='./bin/pip*' --exclude='./bin/2to3*' --exclude='./bin/idle*' \
  -cf - . | tar -C "$PREFIX" -xf -
# ELF RUNPATHs pointed at the pyenv prefix; make them relative
patchelf --set-rpath '$ORIGIN/../lib' "$PREFIX/bin/python$SHORT"
for so in "$PREFIX"/lib/libpython*.so*; do
  [[ -L "$so" ]] || patchelf --set-rpath '$ORIGIN' "$so"
done
for so in "$PREFIX"/lib/python"$SHORT"/lib-dynload/*.so; do
  if [[ -n "$(patchelf --print-rpath "$so")" ]]; then
    patchelf --set-rpath '$ORIGIN/../..' "$so"
  fi
done
# text files (python-config, sysconfigdata, Makefile, pkgconfig) name the old prefix;
# rewriting them to $PREFIX lets conda's prefix replacement relocate them on install
grep -rlI --null -F "$SRC" "$PREFIX" | xargs -0 -r sed -i "s|$SRC|$PREFIX|g"
ln -sf "python$SHORT" "$PREFIX/bin/python"
ln -sf "python$SHORT" "$PREFIX/bin/python3"
