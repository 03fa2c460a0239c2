#!/usr/bin/env bash
# The wheels a GPU machine's image lacks (docs/deploy.md "The device command"), for its
# Python 3.12 on x86-64, fetched on a machine with network into DIR (default .whl/, git-ignored):
#
#     bash tools/download_wheels.sh [DIR]        (make wheels)
#
# numpy<2.5 goes first on the device's PYTHONPATH, ahead of the image's numpy 2.5
# (numba-cuda 0.30.4 registers np.row_stack: pyproject.toml's cuda extra says why); llguidance
# 1.9 is built for manylinux_2_31 only. Then tools/device_run.py installs them with --target.
set -euo pipefail
dir=${1:-.whl}
pip=(${PYTHON:-python3} -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --dest "$dir")
mkdir -p "$dir"
rm -f "$dir"/*.whl
"${pip[@]}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    nvmath-python msgspec falcon gunicorn uvicorn uvicorn-worker gguf "numpy<2.5"
"${pip[@]}" --platform manylinux_2_31_x86_64 "llguidance>=1.9,<1.10"
ls -l "$dir"
