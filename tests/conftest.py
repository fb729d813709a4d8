"""Shared fixtures: seeds and tiny random models (hidden 64, 2 layers)."""

from pathlib import Path

import pytest
import torch

from nestfed.backbone import load_backbone
from nestfed.config import ModelConfig

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    """A frozen tiny random backbone of each supported family, with the byte tokenizer."""
    return load_backbone(ModelConfig(name=request.param))


@pytest.fixture
def tiny_llama():
    return load_backbone(ModelConfig(name="tiny-llama"))
