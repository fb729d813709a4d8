"""The gates of the delta-rule memory (nestfed.nn.memory), without torch: FedNL's options check a
gate's name at config load (nestfed.methods.fednl.options) against the same list the layer builds.

``constant``: alpha is set by a schedule, never trained; ``learned``: alpha = sigmoid(a) per layer;
``dynamic``: alpha_t from a causal Conv1d over the layer's input, rescaled into DYNAMIC_RANGE.
"""

GATES = ("constant", "learned", "dynamic")
DYNAMIC_RANGE = (0.1, 0.9)  # docs/methods.md: the dynamic gate is rescaled to [0.1, 0.9]
