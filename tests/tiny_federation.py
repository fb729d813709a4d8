"""A tiny federation for fast tests: the tiny random Llama, clients whose data are learnable
arithmetic streams (client k counts in steps of k + 1 modulo 50), any registered method set up
through its home exactly as ``nestfed run`` sets it up, driven by the one round loop."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from nestfed import methods
from nestfed.config import ExperimentConfig, client_ranks, dumps_toml, per_client_inline, r_max
from nestfed.data.clients import ClientData
from nestfed.federation import tracking
from nestfed.federation.in_process import InProcessTransport
from nestfed.federation.loop import RoundLoop
from nestfed.federation.messages import ClientInfo
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import RunDir
from nestfed.nn.backbone import load_backbone
from nestfed.nn.frozen_prefix import first_adapted_layer
from nestfed.nn.lora import inject_lora, module_shapes

BASE = (
    "model.name=tiny-llama",
    "data.num_clients=3",
    "lora.ranks=[2,4,8]",
    'lora.target_modules=["q_proj","v_proj"]',
    "lora.layers=[-1]",
    "lora.lora_alpha=16.0",
    "train.local_steps=2",
    "train.batch_size=2",
    "train.lr=1e-2",
    "federation.seed=1",
    "federation.rounds=3",
    "output.plots=false",
)


def tiny_config(*overrides: str) -> ExperimentConfig:
    """The tiny federation's config with ``section.key=value`` overrides (validated by the registry)."""
    return methods.load_config(None, list(BASE) + list(overrides))


def tiny_prepared(cfg: ExperimentConfig, n_examples: tuple[int, ...] = (6, 6, 6), n_test: int = 2) -> Prepared:
    """The prepared experiment: LoRA (rank r_max, s = lora_alpha / r_max) on the config's layers,
    each client's arithmetic streams of 16 tokens (n_examples train rows, n_test test rows), the
    frozen prefix cached below the first adapted layer."""
    bb = load_backbone(cfg.model)
    inject_lora(bb.model, cfg.lora.target_modules, r_max(cfg), cfg.lora.lora_alpha / r_max(cfg), cfg.lora.layers)
    g = torch.Generator().manual_seed(0)
    data = {}
    for cid, n in enumerate(n_examples):
        starts = torch.randint(0, 50, (n + n_test, 1), generator=g)
        seqs = (starts + (cid + 1) * torch.arange(16)) % 50
        tr, te = seqs[:n], seqs[n:]
        data[cid] = ClientData(tr, tr.clone(), te, te.clone(), label=f"step {cid + 1}")
        data[cid].cache_prefix(bb.model, first_adapted_layer(bb.model) if cfg.train.cache_frozen_prefix else 0)
    ranks = client_ranks(cfg)
    clients = [ClientInfo(c, ranks[c], n) for c, n in enumerate(n_examples)]
    return Prepared(cfg, bb, data, clients, module_shapes(bb.model), 0.0)


def tiny_run(run_dir: Path, cfg: ExperimentConfig, prep: Prepared | None = None, resume: bool = False, wrap=None):
    """Run ``cfg``'s method over the tiny federation into ``run_dir`` (a fresh directory, or
    resumed); ``wrap(trainer)`` may replace the trainer's methods (fault injection). Returns
    (final state, loop, method run)."""
    prep = prep if prep is not None else tiny_prepared(cfg)
    method = methods.get(cfg.strategy.name)
    mr = method.build(prep, cfg)
    trainer = wrap(mr.trainer) if wrap is not None else mr.trainer
    rd = RunDir.open(run_dir) if resume else RunDir.create(run_dir, dumps_toml(cfg), per_client_inline(cfg))
    loop = RoundLoop.from_config(
        cfg,
        mr.strategy,
        InProcessTransport(trainer),
        mr.clients,
        rd,
        mr.keeps_client_state,
        sinks=tracking.sinks(cfg.tracking, Path(run_dir), cfg.output.dir, cfg.output.name),
        capabilities=method.capabilities,
        method=method.name,
        refusals=method.refusals,
    )
    return loop.run(mr.shapes, resume=resume), loop, mr


class Interrupt(Exception):
    """A crash injected into a client's fit."""


def crash_at(rnd: int, cid: int):
    """A ``wrap`` for :func:`tiny_run`: client ``cid`` raises :class:`Interrupt` in round ``rnd``."""

    def wrap(trainer):
        real = trainer.fit

        def fit(c, ins):
            if ins.config["round"] == rnd and c == cid:
                raise Interrupt(f"round {rnd}, client {cid}")
            return real(c, ins)

        trainer.fit = fit
        return trainer

    return wrap


def lines(run_dir: Path) -> list[dict]:
    """The metrics lines of a run directory."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def same_arrays(a: dict, b: dict) -> bool:
    """Same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_digest(run_dir: Path) -> str:
    """sha256 over the exported adapter (keys, dtypes, shapes, raw bytes; r and lora_alpha), the
    memory rules and the fused cores that a run directory holds."""
    h = hashlib.sha256()
    for name in ("adapter/adapter_model.safetensors", "memory_rules.safetensors", "weak_model_cores.safetensors"):
        p = run_dir / name
        if not p.is_file():
            continue
        h.update(name.encode())
        tensors = load_file(str(p))
        for k in sorted(tensors):
            t = tensors[k].contiguous()
            h.update(f"{k}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    config = run_dir / "adapter" / "adapter_config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        h.update(f"r={c['r']} alpha={c['lora_alpha']!r}".encode())
    return h.hexdigest()


def crash_and_resume(tmp_path: Path, cfg: ExperimentConfig, rnd: int = 2, cid: int = 1):
    """Run ``cfg`` uninterrupted into tmp_path/full; run it again into tmp_path/part with client
    ``cid`` crashing in round ``rnd``, then resume it. Checks that the crash left checkpoints
    0..rnd-1; returns (full final state, resumed final state)."""
    full, _, _ = tiny_run(tmp_path / "full", cfg)
    try:
        tiny_run(tmp_path / "part", cfg, wrap=crash_at(rnd, cid))
    except Interrupt:
        pass
    else:
        raise AssertionError("the injected crash did not happen")
    assert [r for r, _ in RunDir(tmp_path / "part").checkpoints()] == list(range(rnd))
    resumed, _, _ = tiny_run(tmp_path / "part", cfg, resume=True)
    return full, resumed


def with_build(name: str, build) -> "methods.Method":
    """The registered method ``name`` whose implementation sets a run up with ``build(prep, cfg)``
    (fault injection: wrap the real build)."""
    m = methods.get(name)
    return dataclasses.replace(m, home=dataclasses.replace(m.implementation, build=build))
