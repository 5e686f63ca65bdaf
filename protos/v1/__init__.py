"""Generated gRPC/protobuf modules for the ``ckptstage.v1`` package (tools/gen_protos.py)."""
