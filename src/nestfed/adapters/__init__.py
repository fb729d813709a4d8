"""Adapters: prefix-truncatable LoRA layers and their PEFT export."""
