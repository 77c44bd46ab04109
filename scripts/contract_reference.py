"""The contract reference in docs/contract.md, generated from the protos' comments.

    python scripts/contract_reference.py           # print the page
    python scripts/contract_reference.py --write   # write docs/contract.md

It reads the committed descriptor set (``stargrpc/v1/descriptors.binpb``, made by
``scripts/gen_protos.sh`` with the comments as source info), so it needs no protoc. The test
suite checks that docs/contract.md holds exactly what this prints.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTORS = ROOT / "stargrpc" / "v1" / "descriptors.binpb"
PAGE = ROOT / "docs" / "contract.md"
PACKAGE = "stargrpc.v1"

# Field numbers of descriptor.proto, the steps of a SourceCodeInfo location path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

_SCALARS: dict[int, str] = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in descriptor_pb2.FieldDescriptorProto.Type.items()
}

Comments = dict[tuple[int, ...], str]


def _comments(file: descriptor_pb2.FileDescriptorProto) -> Comments:
    found: Comments = {}
    for location in file.source_code_info.location:
        text = location.leading_comments or location.trailing_comments
        if text.strip():
            found[tuple(location.path)] = "\n".join(
                line.removeprefix(" ") for line in text.strip("\n").splitlines()).strip()
    return found


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(full: str) -> str:
    name = full.lstrip(".")
    if name.startswith(PACKAGE + "."):
        short = name.removeprefix(PACKAGE + ".")
        return f"[`{short}`](#{_anchor(short)})"
    return f"`{name}`"


def _anchor(short: str) -> str:
    return short.replace(".", "-").lower()


def _plain(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type_name:
        return str(field.type_name).lstrip(".").removeprefix(PACKAGE + ".")
    return _SCALARS[field.type]


def _field_type(field: descriptor_pb2.FieldDescriptorProto,
                maps: dict[str, descriptor_pb2.DescriptorProto]) -> str:
    if field.type_name and field.type_name in maps:
        entry = maps[field.type_name]
        key, value = entry.field[0], entry.field[1]
        return f"`map<{_plain(key)}, {_plain(value)}>`"
    base = _type_name(field.type_name) if field.type_name else f"`{_SCALARS[field.type]}`"
    if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        return f"repeated {base}"
    if field.proto3_optional:
        return f"optional {base}"
    return base


def _enum(enum: descriptor_pb2.EnumDescriptorProto, name: str, path: tuple[int, ...],
          comments: Comments) -> Iterator[str]:
    yield f"### enum `{name}` {{ #{_anchor(name)} }}\n"
    if path in comments:
        yield comments[path] + "\n"
    yield "| value | number | meaning |\n|---|---|---|"
    for i, value in enumerate(enum.value):
        about = _cell(comments.get((*path, _ENUM_VALUE, i), ""))
        yield f"| `{value.name}` | {value.number} | {about} |"
    yield ""


def _message(message: descriptor_pb2.DescriptorProto, name: str, path: tuple[int, ...],
             comments: Comments, maps: dict[str, descriptor_pb2.DescriptorProto]) -> Iterator[str]:
    yield f"### message `{name}` {{ #{_anchor(name)} }}\n"
    if path in comments:
        yield comments[path] + "\n"
    if message.field:
        yield "| field | type | number | meaning |\n|---|---|---|---|"
        for i, field in enumerate(message.field):
            about = _cell(comments.get((*path, _MESSAGE_FIELD, i), ""))
            kind = _field_type(field, maps)
            if field.HasField("oneof_index") and not field.proto3_optional:
                kind += f" (oneof `{message.oneof_decl[field.oneof_index].name}`)"
            yield f"| `{field.name}` | {kind} | {field.number} | {about} |"
        yield ""
    else:
        yield "No fields.\n"
    for i, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            yield from _message(nested, f"{name}.{nested.name}",
                                (*path, _MESSAGE_NESTED, i), comments, maps)
    for i, enum in enumerate(message.enum_type):
        yield from _enum(enum, f"{name}.{enum.name}", (*path, _MESSAGE_ENUM, i), comments)


def _map_entries(files: Sequence[descriptor_pb2.FileDescriptorProto]
                 ) -> dict[str, descriptor_pb2.DescriptorProto]:
    entries: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(prefix: str, messages: Sequence[descriptor_pb2.DescriptorProto]) -> None:
        for message in messages:
            full = f"{prefix}.{message.name}"
            if message.options.map_entry:
                entries[full] = message
            walk(full, message.nested_type)

    for file in files:
        walk(f".{file.package}", file.message_type)
    return entries


def page() -> str:
    """The whole page, from the committed descriptor set."""
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes()).file
    maps = _map_entries(files)
    out = ["# Contract reference\n",
           "<!-- generated by scripts/contract_reference.py from the protos' comments; "
           "do not edit -->\n",
           f"Every service, message and enum of `{PACKAGE}`, with the comments of "
           "`protos/stargrpc/v1/`. The same text is served by reflection "
           "(`grpcurl describe`).\n"]
    for file in sorted((f for f in files if f.package == PACKAGE), key=lambda f: f.name):
        comments = _comments(file)
        out.append(f"## `{file.name}`\n")
        for i, service in enumerate(file.service):
            path = (_FILE_SERVICE, i)
            out.append(f"### service `{service.name}` {{ #{_anchor(service.name)} }}\n")
            if path in comments:
                out.append(comments[path] + "\n")
            out.append("| method | request | response | meaning |\n|---|---|---|---|")
            for j, method in enumerate(service.method):
                request = ("stream " if method.client_streaming else "") + _type_name(
                    method.input_type)
                response = ("stream " if method.server_streaming else "") + _type_name(
                    method.output_type)
                about = _cell(comments.get((*path, _SERVICE_METHOD, j), ""))
                out.append(f"| `{method.name}` | {request} | {response} | {about} |")
            out.append("")
        for i, message in enumerate(file.message_type):
            out.extend(_message(message, message.name, (_FILE_MESSAGE, i), comments, maps))
        for i, enum in enumerate(file.enum_type):
            out.extend(_enum(enum, enum.name, (_FILE_ENUM, i), comments))
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    if "--write" in sys.argv:
        PAGE.write_text(page())
        return 0
    sys.stdout.write(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
