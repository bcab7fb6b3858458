"""The ``plora`` command and the tools that drive the cluster: the local launcher, the CLI,
benchmarks, trace replay, the simulator and the adapter maker. The three services
(:mod:`services.gateway`, :mod:`services.worker`, :mod:`services.predictor`) never import this
package. ``plora.v1`` is the generated protobuf code (``make gen``)."""
