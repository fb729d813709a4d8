"""Regular expressions over a model's module paths (plain strings: importing them loads no model library)."""

#: Every attention and MLP projection of the decoder blocks (Llama and Qwen2 naming).
DEFAULT_TARGET = r"(.*\.)?layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
