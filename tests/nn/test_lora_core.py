"""The trainable core between frozen LoRA factors (nn/lora_core.py): the block-diagonal matrix of the
stacked heads, the head-by-head forward, shape checks, and a plain layer untouched by the variant."""

import pytest
import torch

from nestfed.nn.keys import lora_core_key, module_of, rank_dim
from nestfed.nn.lora import LoraLinear
from nestfed.nn.lora_core import GatedHeads, SquareCore, core_matrix

T = torch.tensor


def test_core_matrix_is_the_block_diagonal_of_the_stacked_heads():
    heads = T([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])  # H_1 = [[1, 2], [3, 4]], H_2 = [[5, 6], [7, 8]]
    expected = T([[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 5.0, 6.0], [0.0, 0.0, 7.0, 8.0]])
    assert torch.equal(core_matrix(heads), expected)
    with pytest.raises(ValueError, match="must be \\[h q, q\\]"):
        core_matrix(torch.zeros(3, 2))


def test_the_head_by_head_forward_is_M_times_z():
    like = torch.zeros(1)
    heads = GatedHeads(T([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]), like)
    with torch.no_grad():
        heads.gates.copy_(T([1.0, 0.5]))
    z = T([[1.0, 1.0, 2.0, 0.0]])
    # head 1: [1 + 2, 3 + 4] = [3, 7]; head 2 (gate 0.5): 0.5 [10, 14] = [5, 7]
    torch.testing.assert_close(heads(z), T([[3.0, 7.0, 5.0, 7.0]]))
    torch.testing.assert_close(heads.reply(), T([[1.0, 2.0], [3.0, 4.0], [2.5, 3.0], [3.5, 4.0]]))
    with pytest.raises(ValueError, match="one \\[r, r\\] matrix"):
        SquareCore(torch.zeros(4, 2), like)


def test_the_core_keys_have_a_rank_dimension_like_A():
    key = lora_core_key("model.layers.0.q_proj", "lora_heads")
    assert key == "base_model.model.model.layers.0.q_proj.lora_heads.weight"
    assert module_of(key) == ("model.layers.0.q_proj", "lora_heads") and rank_dim(key) == 0


def test_a_layer_without_a_core_computes_what_it_computed_before():
    torch.manual_seed(0)
    plain = LoraLinear(torch.nn.Linear(4, 3), rank=2, scaling=0.5)
    torch.manual_seed(0)
    cored = LoraLinear(torch.nn.Linear(4, 3), rank=2, scaling=0.5)
    A, B = torch.randn(2, 4), torch.randn(3, 2)
    for m in (plain, cored):
        m.set_weights(A, B)
    cored.set_core("lora_core", torch.eye(2))
    x = torch.randn(5, 4)
    torch.testing.assert_close(cored(x), plain(x))  # R = I: the same update, computed the core's way
    cored.set_core(None)
    assert cored.lora_core is None and torch.equal(cored(x), plain(x))  # bit for bit
    with pytest.raises(ValueError, match="a core of rank 4"):
        cored.set_core("lora_core", torch.eye(4))
