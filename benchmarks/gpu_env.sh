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
# That machine's Python packages come without bytecode and it sets PYTHONDONTWRITEBYTECODE=1, so
# every process there compiled the sources of everything it imported (2.7 s of a 10 s validation,
# 7 s more with torch). A worker image has its bytecode compiled at install (pip's default):
# compile it once, into a writable prefix, so that measurements there pay the imports a worker pays.
export PYTHONPYCACHEPREFIX=/tmp/pycache
if ! test -f /tmp/pycache/.compiled; then
  python3 -m compileall -q -j 0 $(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    /tmp/site "$PWD/exporter" > /dev/null 2>&1
  mkdir -p /tmp/pycache && touch /tmp/pycache/.compiled
fi
