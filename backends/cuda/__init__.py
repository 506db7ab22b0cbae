"""The cuda backend: an exact GPU target on batch-invariant Triton kernels.

backend.py probes and loads (importing neither torch nor Triton until asked);
kernels.py holds the kernels, ops.py launches them, forward.py is the model,
weights.py streams weights onto the device, runner.py is the Runner, and
graphs.py captures decode and verify calls as CUDA graphs.
"""
