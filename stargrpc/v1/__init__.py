"""Generated protobuf and gRPC stubs for the stargrpc.v1 contract (see protos/).

Everything in this package except this file is produced by scripts/gen_protos.sh.
"""
