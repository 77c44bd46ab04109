#!/usr/bin/env bash
# Runs a go command offline in GOPATH mode over Debian's Go libraries (golang-go,
# golang-google-grpc-dev, golang-google-protobuf-dev, golang-github-golang-protobuf-1-5-dev):
# a temporary GOPATH links github.com/stargrpc/stargrpc to this repository.
#   bash clients/go/gopath.sh go build -o /tmp/stargrpc-go github.com/stargrpc/stargrpc/clients/go/cmd/stargrpc-go
#   bash clients/go/gopath.sh go test github.com/stargrpc/stargrpc/clients/go/stargrpc
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
gopath=$(mktemp -d)
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/github.com/stargrpc"
ln -s "$repo" "$gopath/src/github.com/stargrpc/stargrpc"
export GOPATH="$gopath:/usr/share/gocode" GO111MODULE=off GOPROXY=off GOFLAGS=
cd "$gopath/src/github.com/stargrpc/stargrpc/clients/go"
"$@"
