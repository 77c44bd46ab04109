#!/usr/bin/env bash
# Regenerates the Go stubs in clients/go/stargrpcv1/ from protos/, offline, with Debian's
# protoc, protoc-gen-go and protoc-gen-go-grpc (apt-get install protobuf-compiler
# protoc-gen-go protoc-gen-go-grpc). Never edit the output by hand. With an argument,
# writes into that folder instead (CI compares the two).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-clients/go/stargrpcv1}
mkdir -p "$out"
if [ "$out" = clients/go/stargrpcv1 ]; then
  rm -f "$out"/*.pb.go
fi
# module= strips the import path, so the files go flat into clients/go/stargrpcv1/.
protoc -Iprotos \
  --go_out="$out" --go_opt=paths=import \
  --go_opt=module=github.com/stargrpc/stargrpc/clients/go/stargrpcv1 \
  --go-grpc_out="$out" --go-grpc_opt=paths=import \
  --go-grpc_opt=module=github.com/stargrpc/stargrpc/clients/go/stargrpcv1 \
  protos/stargrpc/v1/*.proto
