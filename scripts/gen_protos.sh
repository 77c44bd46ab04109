#!/usr/bin/env bash
# Regenerates the Python stubs in stargrpc/v1/ from protos/, and beside them
# descriptors.binpb: the contract's FileDescriptorSet with its comments (source info) and
# imports, which server reflection serves (so `grpcurl describe` explains each field).
# Never edit the output by hand. With an argument, writes below that folder instead (CI
# compares the two).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
out=${1:-.}
if [ "$out" = . ]; then
  rm -f stargrpc/v1/*_pb2*.py stargrpc/v1/*_pb2*.pyi stargrpc/v1/descriptors.binpb
fi
mkdir -p "$out/stargrpc/v1"
"$py" -m grpc_tools.protoc -Iprotos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  --descriptor_set_out="$out/stargrpc/v1/descriptors.binpb" \
  --include_source_info --include_imports \
  protos/stargrpc/v1/*.proto
