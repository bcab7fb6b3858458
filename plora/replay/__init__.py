"""Trace replay against a live cluster (``plora bench replay``, issue 6).

- :mod:`plora.replay.report` — the records of one replay and the pure statistics over them
  (TTFT percentiles, throughput, cold starts, pool figures, the plora-vs-baseline comparison,
  the trace's compulsory cold-start floor), the Markdown report and the plots.
- :mod:`plora.replay.client` — the open-loop gRPC replay client and the cluster-status
  sampler.
- :mod:`plora.replay.bench` — the CLI verb: adapters, one fresh cluster per policy, replay,
  report.
"""
