#!/usr/bin/env bash
# Fetch, here, the wheels a GPU machine that reaches no package registry needs for
# `bash scripts/gpu-check.sh --wheels DIR`: kvtier's dependencies that such a machine's image
# lacks, for its Python and platform, at the versions installed here (pydantic and
# pydantic-core must match). Only these: numpy, torch, pytest and the rest are the image's.
#
# Usage: bash scripts/gpu-wheels.sh [DIR] [PYTHON_VERSION]     (defaults: .whl 3.12)
# Then carry DIR to the machine and run: bash scripts/gpu-check.sh --wheels DIR
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${2:-3.12}
# Missing from the lent H200's image (seen 2026-11-27; msgspec, pyzmq and pytest-rerunfailures
# from its package list of 2026-11-17), with what they need.
NAMES=(blake3 pydantic pydantic-core annotated-types typing-inspection typing-extensions redis
       zstandard lz4 cryptography cffi pycparser msgspec pyzmq pytest-rerunfailures)
pins=()
for name in "${NAMES[@]}"; do
  version=$(python3 -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
  pins+=("$name${version:+==$version}")
done
mkdir -p "$DIR"
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "${pins[@]}"
echo "gpu-wheels: $(find "$DIR" -type f -name '*.whl' | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1));" \
  "on the GPU machine: bash scripts/gpu-check.sh --wheels $DIR"
