# Sourced by the GPU scripts from the repository root: the module built into python/
# (gpu_suite.sh's copy) first on PYTHONPATH, megatron-core installed from .whl/ into
# /tmp/site when missing, and fio unpacked from .deps/fio.tar.xz (scripts/fetch_fio.sh)
# when only the archive was carried.
export PYTHONUNBUFFERED=1
if compgen -G "python/statepager/_C*.so" >/dev/null; then
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ! -d /tmp/site/megatron ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site/megatron ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
if [ ! -x .deps/fio/usr/bin/fio ] && [ -f .deps/fio.tar.xz ]; then
  tar -C .deps -xJf .deps/fio.tar.xz
fi
