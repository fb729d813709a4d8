"""The names the delta-rule memory (nestfed.nn.memory) accepts, without torch: FedNL's options check
them at config load (nestfed.methods.fednl.options) against the same lists the layer builds.

Gates: ``constant`` -- alpha set by a schedule, never trained; ``learned`` -- alpha = sigmoid(a),
per head or per layer (GATE_SCOPES); ``dynamic`` -- alpha_t from a causal Conv1d over the layer's
input, rescaled into DYNAMIC_RANGE. Beta sources: ``hidden`` -- a projection of the layer's input
(DeltaNet's b_proj); ``keys`` -- a causal average of the raw keys (TPTT's).
"""

GATES = ("constant", "learned", "dynamic")
GATE_SCOPES = ("head", "layer")
BETA_SOURCES = ("hidden", "keys")
DYNAMIC_RANGE = (0.1, 0.9)  # docs/methods.md: the dynamic gate is rescaled to [0.1, 0.9]
