"""Trace-driven discrete-event simulator of the P-LoRA cluster (``plora simulate``).

It runs the production policy code (allocators, eviction, forecasters, placement and routing)
on a virtual clock; see :mod:`plora.simulator.engine`.
"""
