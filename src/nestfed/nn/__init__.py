"""Model surgery: the frozen backbone, LoRA layers, the delta-rule memory layer, SVD-compressed
layers and their whitening, the frozen-prefix cache, payload keys, loading arrays into a model,
and the PEFT export. Depends on ``nestfed.ops`` and ``nestfed.config`` only."""
