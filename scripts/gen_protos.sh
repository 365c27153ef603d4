#!/usr/bin/env bash
# Regenerates the committed Python stubs in raypaged/proto/v1/ from protos/raypaged/v1/*.proto.
#
# Pinned to grpcio-tools 1.78.0 (installed into a throwaway venv): its protoc (31.1) writes
# protobuf 6.31.1 gencode and its plugin requires grpcio >= 1.78, so the stubs import on every
# version set we run: grpcio 1.84 / protobuf 7 (the GPU machine) and grpcio 1.85 / protobuf 7
# (CPU machines). Stubs from a newer grpcio-tools refuse to import under an older grpcio, and
# protobuf gencode refuses a runtime older than itself: never regenerate with a newer tool
# without checking both.
#
#   scripts/gen_protos.sh            # reuses $GEN_VENV (default /tmp/raypaged-gen-protos) if present
set -euo pipefail
cd "$(dirname "$0")/.."
tools_version=1.78.0
venv=${GEN_VENV:-/tmp/raypaged-gen-protos}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import grpc_tools, importlib.metadata as m; \
    assert m.version('grpcio-tools') == '$tools_version'" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "grpcio-tools==$tools_version"
fi
out=raypaged/proto/v1
rm -f "$out"/*_pb2.py "$out"/*_pb2.pyi "$out"/*_pb2_grpc.py
# -I maps the sources onto the virtual path raypaged/proto/, so the generated imports read
# `from raypaged.proto.v1 import …` (the proto package itself stays raypaged.v1).
"$venv/bin/python" -m grpc_tools.protoc -Iraypaged/proto=protos/raypaged \
  --python_out=. --pyi_out=. --grpc_python_out=. protos/raypaged/v1/*.proto
ls "$out"
