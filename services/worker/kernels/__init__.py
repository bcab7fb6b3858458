"""Device kernels of the worker (Triton), imported only where Triton is installed."""
