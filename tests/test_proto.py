"""The checked-in stubs are what `make proto` generates from the .proto today."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

PROTOS = Path(__file__).parent.parent / "protos"
GENERATED = ("lmgate_pb2.py", "lmgate_pb2.pyi", "lmgate_pb2_grpc.py")


def test_generated_stubs_are_current(tmp_path):
    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTOS}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(PROTOS / "lmgate" / "v1" / "lmgate.proto"),
        ]
    )
    assert rc == 0
    for name in GENERATED:
        fresh = (tmp_path / "lmgate" / "v1" / name).read_text()
        assert fresh == (PROTOS / "lmgate" / "v1" / name).read_text(), f"{name} is stale: run `make proto`"
