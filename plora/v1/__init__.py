"""Generated protobuf and gRPC code for ``protos/plora/v1`` (``make gen``; never hand-edited)."""
