"""``plora bench engine``, ``plora bench pool`` and ``plora bench http``: the engine, adapter-pool
and HTTP-door benchmarks."""
