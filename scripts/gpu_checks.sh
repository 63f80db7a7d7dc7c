#!/usr/bin/env bash
# The GPU checks (docs/gpu.md) on a machine with one CUDA GPU and torch >= 2.11, from any folder:
#
#   bash scripts/gpu_checks.sh [OUT_DIR] [options of python -m autopar.bench.gpu]
#
# OUT_DIR defaults to out/gpu. The machine needs no network: autopar is installed
# without its dependencies (`pip install --no-deps -e .`), and pulp and highspy, which GPU images lack, come
# from the wheels `make gpu-wheels` put in gpu-wheels/ (installed into a folder of their own). Then
# `python -m autopar.bench.gpu` runs each check under its own time limit, all within nine minutes, and writes
# gpu_checks.json and gpu_checks.md (and the cost check's device_measurement.json and cluster_override.yaml)
# into OUT_DIR; install.log there holds what the installation said.
set -uo pipefail
cd "$(dirname "$0")/.."
out=out/gpu
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out=$1; shift; fi
mkdir -p "$out"
py=${PYTHON:-python3}
log="$out/install.log"
unset TRITON_INTERPRET  # the checks time compiled kernels, not the interpreter
export PYTHONUNBUFFERED=1

if ls gpu-wheels/*.whl >/dev/null 2>&1; then
    site=/tmp/autopar-wheels
    if $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        gpu-wheels/*.whl >"$log" 2>&1; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "installing gpu-wheels/*.whl failed (see $log); the planner needs pulp and highspy"
    fi
else
    echo "gpu-wheels/ holds no wheels: run 'make gpu-wheels' where pip reaches the registry (the planner needs pulp and highspy)" | tee "$log"
fi

if ! $py -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1; then
    # no setuptools the editable install can use: lay the package out as setuptools would, by links
    echo "pip install -e . failed (see $log); importing autopar from a linked tree instead" | tee -a "$log"
    tree=/tmp/autopar-tree/autopar
    rm -rf /tmp/autopar-tree && mkdir -p "$tree"
    ln -s "$PWD"/autopar/* "$tree"/
    for pkg in passes cost_model triton_kernels; do ln -s "$PWD/$pkg" "$tree/$pkg"; done
    export PYTHONPATH="/tmp/autopar-tree${PYTHONPATH:+:$PYTHONPATH}"
fi

$py -m autopar.bench.gpu --out "$out" "$@"
