"""``plora bench engine`` and ``plora bench pool``: the engine and adapter-pool benchmarks."""
