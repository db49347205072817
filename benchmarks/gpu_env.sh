# Source on the GPU machine (see ../shared/gpu/README.md) from the project root, once the five
# onnxruntime-gpu parts are in /tmp/ortparts and the farm's pure-Python wheels are carried in .whl/:
#   . benchmarks/gpu_env.sh
# Installs both into /tmp/site once (nothing there reaches a registry) and puts it on PYTHONPATH.
if ! test -f /tmp/site/onnxruntime/__init__.py; then
  wheel=/tmp/$(cat /tmp/ortparts/WHEEL)
  cat /tmp/ortparts/part.* > "$wheel"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel"
fi
if test -d .whl && ! test -f /tmp/site/sqlalchemy/__init__.py; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
