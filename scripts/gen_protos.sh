#!/usr/bin/env bash
# Regenerates the Python stubs in stargrpc/v1/ from protos/. Never edit the output by hand.
# With an argument, writes the stubs below that folder instead (CI compares the two).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
out=${1:-.}
if [ "$out" = . ]; then
  rm -f stargrpc/v1/*_pb2*.py stargrpc/v1/*_pb2*.pyi
fi
"$py" -m grpc_tools.protoc -Iprotos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/stargrpc/v1/*.proto
