"""Server reflection that explains the contract: its descriptors carry their comments.

The stock reflection servicer serialises each file from the descriptor pool, which keeps no
source info, so ``grpcurl describe stargrpc.v1.WatchRunRequest`` would not say what
``after_seq`` means. :class:`ContractReflection` answers the same, except that the files of
the contract's descriptor set (``stargrpc/v1/descriptors.binpb``, made with its comments by
``scripts/gen_protos.sh`` beside the stubs) go out as they are there, comments included.
Any other file (health, reflection itself) goes out as the pool has it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from importlib import resources
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

# Registers ErrorReason in the default pool: no other file of the contract imports it, and
# reflection finds symbols there.
from stargrpc.v1 import errors_pb2  # noqa: F401

SERVICE_NAME = reflection.SERVICE_NAME


def contract_files() -> dict[str, bytes]:
    """The serialised FileDescriptorProtos of the contract's descriptor set, by file name."""
    data = resources.files("stargrpc.v1").joinpath("descriptors.binpb").read_bytes()
    files = descriptor_pb2.FileDescriptorSet.FromString(data).file
    return {file.name: file.SerializeToString() for file in files}


class ContractReflection(reflection.aio.ReflectionServicer):
    """The asyncio reflection servicer, with the contract's comments in its descriptors."""

    _files: dict[str, bytes]

    def __init__(self, service_names: Iterable[str]) -> None:
        super().__init__(service_names)
        self._files = contract_files()

    async def ServerReflectionInfo(
            self, request_iterator: AsyncIterable[reflection_pb2.ServerReflectionRequest],
            context: Any) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        async for response in super().ServerReflectionInfo(request_iterator, context):
            if response.HasField("file_descriptor_response"):
                protos = response.file_descriptor_response.file_descriptor_proto
                for index, proto in enumerate(protos):
                    name = descriptor_pb2.FileDescriptorProto.FromString(proto).name
                    protos[index] = self._files.get(name, proto)
            yield response


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection for ``service_names`` (and itself) on ``server``."""
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        ContractReflection((*service_names, SERVICE_NAME)), server)
