#!/usr/bin/env bash
# Builds and runs the C and Fortran consumers of an installed KokkosMoE with
# nothing but pkg-config and the MPI compiler wrappers, as a C or Fortran
# code's own build would.
#   pkgconfig_consumers.sh <prefix> <work folder> <deck> <mpiexec and its flags...>
# KMOE_CONSUMER_FLAGS: extra compile and link flags (the sanitizers of a
# sanitized install, which its consumers must carry too).
set -euo pipefail
prefix=$1 work=$2 deck=$3
shift 3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pcdir=$(dirname "$(find "$prefix" -name kokkosmoe.pc -print -quit)")
[ -f "$pcdir/kokkosmoe.pc" ] || { echo "no kokkosmoe.pc under $prefix" >&2; exit 1; }
export PKG_CONFIG_PATH="$pcdir"
mkdir -p "$work"
echo "pkg-config kokkosmoe: $(pkg-config --cflags --libs kokkosmoe)"
flags=(${KMOE_CONSUMER_FLAGS:-})
mpicc -std=c11 -Wall -Werror "${flags[@]}" "$here/c_consumer.c" $(pkg-config --cflags --libs kokkosmoe) -o "$work/c_consumer"
"$@" -n 2 "$work/c_consumer"
if pkg-config --exists kokkosmoe-fortran; then
  echo "pkg-config kokkosmoe-fortran: $(pkg-config --cflags --libs kokkosmoe-fortran)"
  (cd "$work" && mpifort -Wall -Werror "${flags[@]}" "$here/fortran_consumer.f90" $(pkg-config --cflags --libs kokkosmoe-fortran) \
     -o "$work/fortran_consumer")
  "$@" -n 2 "$work/fortran_consumer" "$deck"
else
  echo "fortran consumer: skipped (the install has no Fortran module)"
fi
# The Python package of the moved install, when it has one and an interpreter is given.
site=$(dirname "$(find "$prefix" -path '*site-packages/kokkosmoe' -print -quit 2>/dev/null)" 2>/dev/null || true)
if [ -n "${KMOE_PYTHON:-}" ] && [ -d "$site/kokkosmoe" ]; then
  PYTHONPATH="$site" "$@" -n 2 "$KMOE_PYTHON" -c "
import kokkosmoe as km, numpy as np
with km.Layer(hidden=16, experts=4, top_k=2, ffn=24, tokens_per_rank=8) as layer:
    out = layer.forward(np.ones((8, 16), dtype=np.float32))
    assert out.shape == (8, 16) and np.isfinite(out).all()
    assert layer.last_step()['routes']['attempted'] == 16
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 0:
    print('python consumer ok: KokkosMoE', km.version(), 'from', km.__file__)
"
fi
