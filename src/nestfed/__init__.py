"""nestfed: federated fine-tuning of LLMs under data and resource heterogeneity."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes (model.quantization; peft and transformers import it whenever it is installed) warns
# on import that an optional CPU kernel package is missing, and on every int8 matmul that it casts
# float32 inputs to float16 (LLM.int8's design): neither says anything a user can act on
for _name in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
