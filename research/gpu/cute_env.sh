# Source after .gpu/env.sh on the GPU machine: CuTe DSL 4.8.1 into /tmp/cute-site, its libs
# wheel's files joined from the two parts carried by two back-to-back calls (.cute1, .cute2).
mkdir -p /tmp/cute-parts
[ -d .cute1 ] && cp -n .cute1/* /tmp/cute-parts/ 2>/dev/null
[ -d .cute2 ] && cp -n .cute2/* /tmp/cute-parts/ 2>/dev/null
if [ ! -f /tmp/cute-site/.ready ] && [ -f /tmp/cute-parts/libs.part0 ] && [ -f /tmp/cute-parts/libs.part1 ]; then
  mkdir -p /tmp/cute-site
  cat /tmp/cute-parts/libs.part0 /tmp/cute-parts/libs.part1 > /tmp/cute-libs.tar.xz
  echo "$(cat /tmp/cute-parts/libs.sha256)  /tmp/cute-libs.tar.xz" | sha256sum -c - || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cute-site /tmp/cute-parts/*.whl >/dev/null 2>&1 \
    || { echo "cute wheel install failed" >&2; return 1; }
  tar xJf /tmp/cute-libs.tar.xz -C /tmp/cute-site && rm /tmp/cute-libs.tar.xz
  touch /tmp/cute-site/.ready
fi
if [ -f /tmp/cute-site/.ready ]; then
  export PYTHONPATH="/tmp/cute-site:/tmp/cute-site/nvidia_cutlass_dsl/dsl_packages:$PWD:$PYTHONPATH"
  python3 -c "import cutlass, cuda.bindings; print('cute ok', cutlass.__file__)" || return 1
else
  echo "cute parts present: $(ls /tmp/cute-parts | tr '\n' ' ')"
fi
