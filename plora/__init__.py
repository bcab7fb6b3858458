"""Import root of the generated protobuf code (``plora.v1``); built by ``make gen``."""
