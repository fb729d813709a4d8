"""Sequence operators used by nestfed's layers.

``nestfed.ops.delta_rule``: the delta-rule linear-attention memory of FedNL (a per-token
reference recurrence, a chunkwise WY/UT-transform form for training on CPU, and a dispatcher
that uses flash-linear-attention's Triton kernel on CUDA when it is installed).
"""
