"""Adapters a user can take away: a finished (or interrupted) run's adapter at any rank, or exactly
the adapter one client runs, as a PEFT adapter directory.

The run directory's ``adapter/`` is the global adapter at r_max and its scale s. Truncating it by
hand to a client's rank r and loading it with the exported ``lora_alpha`` gives PEFT's scale
``lora_alpha / r``, r_max / r times nestfed's under ``fixed`` scaling. `export_adapter`
writes instead:

- ``rank=r``: the global adapter's prefix of rank r (A[:r], B[:, :r]) at the scale a client of rank
  r runs it, s(r) = lora_alpha / r_max (``fixed``) or lora_alpha / r (``rank``); what the
  truncation curve evaluates (nestfed.experiments.mechanisms). Only for a method whose export is
  one nested adapter of rank r_max (the same test as the truncation curve's).
- ``client=k``: the adapter client k runs, as its hooks run it: the strategy's ``deploy(state, k)``
  (its rank prefix, FlexLoRA's truncated SVD, ...) with the client's kept state applied
  (``evaluation_arrays``: a local-only client's own adapter, FedSA-LoRA's local B). Merged factors
  (FLoRA's stack, FedEx-LoRA's residual: scale 1 beside the LoRA factors at scale s) are stacked
  into one adapter at scale 1, [merged_A; s A] and [merged_B, B], zero-padded to one rank.

The adapter is written with lora_alpha = s * r, so PEFT's ``lora_alpha / r`` is nestfed's s
(nestfed.nn.peft_export), and ``base_model_name_or_path`` is the run's backbone directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from nestfed import methods
from nestfed.config import check_rank
from nestfed.errors import NestfedError
from nestfed.experiments.mechanisms import adapter_rank, skip_reason
from nestfed.federation.aggregation import one_adapter, truncate_rank
from nestfed.federation.run_dir import RunDir
from nestfed.methods.implementation import lora_settings
from nestfed.nn.backbone import load_backbone
from nestfed.nn.peft_export import export_peft_adapter
from nestfed.nn.quantization import bnb_config

#: what an adapter directory written by PEFT (or by us) holds; only such a directory is replaced
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md"}


def check_target(target: Path, run_dir: Path) -> None:
    """Refuse an export target that would destroy anything but an earlier adapter.

    Args:
        target: the adapter directory to write.
        run_dir: the run directory exported from.

    Raises:
        NestfedError: naming the path, when the target is the run directory or a folder above it,
            an existing file (or link), or a folder holding files other than `ADAPTER_FILES`.
    """
    t, r = target.resolve(), run_dir.resolve()
    if t == r or t in r.parents:
        raise NestfedError(f"--out {target}: that is the run directory or a folder above it; give a new path")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise NestfedError(f"--out {target}: exists and is not an adapter directory; give a new path")
    if target.is_dir():
        other = sorted(p.name for p in target.iterdir() if p.name not in ADAPTER_FILES)
        if other:
            raise NestfedError(
                f"--out {target}: holds files that are not an adapter's ({', '.join(other[:3])}); give a new path"
            )


def _base_model(rd: RunDir, cfg) -> str:
    """The backbone directory PEFT should load the adapter onto: the run's own adapter's
    ``base_model_name_or_path`` when it has one, else the backbone's source ("" for a tiny model)."""
    written = rd.path / "adapter" / "adapter_config.json"
    if written.is_file():
        return json.loads(written.read_text()).get("base_model_name_or_path") or ""
    return load_backbone(cfg.model).source


def _client_adapter(run_dir, method, cfg, ck, strategy, ranks: dict[int, int], client: int, rank: int | None):
    """(arrays, scale, rank) of the adapter client ``client`` runs (its deployed arrays through its
    hooks' evaluation view), for `export_adapter`. Raises NestfedError as it documents."""
    if client not in ranks:
        raise NestfedError(f"--client {client}: {run_dir} has clients {', '.join(map(str, sorted(ranks)))}")
    hooks = method.client_hooks(cfg)
    if hooks is None:
        raise NestfedError(f"--client: {method.name}'s clients do not run the LoRA client trainer")
    arrays, scale = strategy.deploy(ck.state, client)
    kept = (ck.client_state or {}).get(client, {})
    arrays = hooks.evaluation_arrays(kept, arrays)
    # below r_k where the method caps it (PreLort's min_holders) or the client chose less (deploy_rank)
    deployed = adapter_rank(arrays) or ranks[client]
    if rank is not None and rank != deployed:
        raise NestfedError(f"--rank {rank}: client {client} runs rank {deployed} (give that rank or leave --rank out)")
    files = strategy.export_files(ck.state)
    if files:
        raise NestfedError(
            f"--client: {method.name}'s clients also run {', '.join(sorted(files))}, which a "
            "PEFT LoRA adapter cannot hold"
        )
    return arrays, scale, deployed


def export_adapter(
    run_dir: str | Path, rank: int | None = None, client: int | None = None, out: str | Path | None = None
) -> tuple[Path, dict]:
    """Write the adapter of a run's latest checkpoint as a PEFT adapter directory, atomically.

    The adapter is the global one at ``rank`` and/or the one ``client`` runs (see the module
    docstring). An existing target is replaced only when it is an earlier adapter directory
    (`check_target`).

    Args:
        run_dir: the run directory.
        rank: the rank of the global adapter's prefix; with ``client``, it must be the client's own
            rank.
        client: the client whose adapter to write.
        out: the target directory; default ``RUN_DIR/adapter_r<r>`` or ``RUN_DIR/adapter_client<k>``.

    Returns:
        The directory and a description: round, rank, scale, client, base model, method.

    Raises:
        NestfedError: one line naming the run, option or client at fault: not a run directory,
            neither rank nor client given, no checkpoint, an unknown client, a method whose global
            adapter has no nested prefixes (``--rank``), a method whose clients do not run LoRA on
            the backbone or whose per-client state stayed on Flower's nodes (``--client``), a rank
            out of range, an unsafe target.
    """
    rd = RunDir(run_dir)
    if not rd.config_path.is_file():
        raise NestfedError(f"{run_dir}: not a nestfed run directory (no config.toml)")
    if rank is None and client is None:
        raise NestfedError("export: give --rank R, --client K, or both")
    cfg = methods.load_run_config(rd.config_path)
    method = methods.get(cfg.strategy.name)
    if method.client_hooks(cfg) is None:
        raise NestfedError(
            f"{run_dir}: {method.name}'s clients do not run a LoRA adapter on the backbone; nothing PEFT could load"
        )
    keeps = method.keeps_client_state(cfg) and client is not None
    ck = rd.latest_checkpoint(keeps)
    strategy = method.server(cfg, {})
    settings = lora_settings(cfg)
    ranks = {int(c): int(r) for c, r in ck.state.meta.get("ranks", {}).items()}
    if client is not None:
        arrays, scale, r = _client_adapter(run_dir, method, cfg, ck, strategy, ranks, client, rank)
    else:
        arrays, scale = strategy.export(ck.state)
        reason = skip_reason(cfg, arrays, strategy.export_files(ck.state))
        if reason:
            raise NestfedError(f"--rank: {run_dir}: {reason}; export a client's adapter with --client K")
        check_rank(rank, settings.r_max, "--rank", NestfedError)
        arrays, scale, r = truncate_rank(arrays, rank), settings.scale(rank), rank
    try:
        arrays, scale = one_adapter(arrays, scale)
    except ValueError as exc:
        raise NestfedError(f"{run_dir}: {exc}") from None
    target = (
        Path(out)
        if out is not None
        else rd.path / (f"adapter_client{client}" if client is not None else f"adapter_r{rank}")
    )
    check_target(target, rd.path)
    base = _base_model(rd, cfg)
    try:
        path = export_peft_adapter(arrays, scale, target, base, cfg.lora.lora_dropout, bnb_config(cfg.model))
    except ValueError as exc:
        raise NestfedError(f"{run_dir}: {exc}") from None
    return path, {
        "round": ck.round,
        "rank": r,
        "scale": scale,
        "client": client,
        "base_model": base,
        "method": method.name,
    }
