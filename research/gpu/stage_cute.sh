#!/usr/bin/env bash
# Once per checkout, here (not on the GPU machine): CuTe DSL 4.8.1's wheels for the GPU image
# (Python 3.12), with apache-tvm-ffi for research/b7_ffi.py, in two ignored folders, each under
# what one device call carries. The libs wheel's files (225 MB) go as one xz archive split in
# two; research/gpu/cute_env.sh joins and installs them on the machine after two back-to-back
# calls (cute_a.sh, then queue.sh or ab_old.sh).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
tmp=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/wh" "nvidia-cutlass-dsl==4.8.1" "apache-tvm-ffi==0.1.15.post2"
mkdir -p "$tmp/site"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  "$tmp"/wh/nvidia_cutlass_dsl_libs_cu12-*.whl "$tmp/site"
tar cf - -C "$tmp/site" . | xz -9 -T2 > "$tmp/libs.tar.xz"
rm -rf .cute1 .cute2 && mkdir .cute1 .cute2
for w in "$tmp"/wh/*.whl; do
  case $(basename "$w") in nvidia_cutlass_dsl_libs_cu12-*|typing_extensions-*) ;; *) cp "$w" .cute1/ ;; esac
done
head -c 25000000 "$tmp/libs.tar.xz" > .cute1/libs.part0
tail -c +25000001 "$tmp/libs.tar.xz" > .cute2/libs.part1
sha256sum "$tmp/libs.tar.xz" | cut -c1-64 > .cute2/libs.sha256
rm -rf "$tmp"
du -sh .cute1 .cute2
