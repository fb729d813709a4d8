"""Secure aggregation on Flower's deployment engine with Flower's own SecAgg+ (flwr 1.42).

The protocol is Flower's: ``flwr.server.workflow.SecAggPlusWorkflow`` on the server (setup, share
keys, collect masked vectors, unmask: four TRAIN messages per node) and
``flwr.client.mod.secaggplus_mod`` on every node (keys, Shamir shares, quantisation, masks). The
server learns the sum of the nodes' vectors and who contributed, never one node's vector. A node
lost at any stage is survived while every node keeps at least ``threshold`` live neighbours: one
that shared its keys has its pairwise masks rebuilt from the survivors' shares; one lost before
(at setup or share keys) is in no survivor's masks, and ``SurvivingSecAggPlus`` corrects
flwr 1.42's workflow, which would ask for its shares all the same.

What is summed (nestfed.federation.secure_sum): per LoRA key the zero-padded update
n_k / n_max * pad(reply - sent) and one count vector [r] with n_k / n_max at rank rows < r_k.

How it is wired:

- Server (``secure_fit``, called by the ServerApp's FlowerTransport for a TRAIN round): a
  legacy shim strategy (``SumOnly``) hands the workflow one ``FitIns`` per node (the
  instruction's arrays as legacy Parameters, its config and the layout in the FitIns config) and
  receives the unmasked result in ``aggregate_fit``. Every client reports ``num_examples = 1`` to
  the mod and the workflow runs with ``max_weight = 1``, so Flower's weighted average is the plain
  mean over the K contributors, exactly (every weight quantises to Q); K times it is the sum.
  Stage messages go through the ServerApp's own polling exchange (``StageGrid``), which also
  records why and at which stage a node dropped out.
- Node (``secure_mod`` on the ClientApp's TRAIN handler): applies ``secaggplus_mod`` only to
  messages carrying SecAgg+ configs, so plain TRAIN messages are untouched. In the collect stage the
  mod calls the ClientApp's handler, which trains, validates and clips its own update and replies
  with the encoded vectors as a legacy FitRes (``read_fit_instruction``, ``fit_reply``).

Quantisation: values in [-c, c] (c = ``clipping_range`` >= 1, since counts reach 1) on Q levels
(``quantization_range``) with stochastic rounding, summed modulo 2^32, so K Q < 2^32 is required.
Each decoded sum and count is then within eps = K 2c n_max / Q of the exact one
(nestfed.federation.secure_sum.sum_error).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow

from nestfed.errors import ConfigError
from nestfed.federation.messages import Arrays, Instruction
from nestfed.federation.secure_sum import Layout, decode, layout, sum_error
from nestfed.federation.transport import FitResults

MODULUS = 2**32  # Flower's default modulus: the sums wrap above it
FITINS_CONFIG, FITINS_PARAMETERS = "fitins.config", "fitins.parameters"
_PREFIX = "nestfed-"


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+ parameters (the run config's ``secagg-*`` keys).

    Attributes:
        num_shares: each node's key is shared with this many nodes, itself included; 0 = every
            sampled node, else >= 3.
        threshold: the shares needed to rebuild a key; 0 = a majority of the shares
            (num_shares // 2 + 1), else >= 2 and at most num_shares.
        clipping_range: c, the values' range [-c, c] (the module docstring); >= 1, default 1.0.
        quantization_range: Q, the quantisation levels (the module docstring); in [2, 2^31),
            default 2^24.
    """

    num_shares: int = 0
    threshold: int = 0
    clipping_range: float = 1.0
    quantization_range: int = 2**24

    def check(self) -> None:
        """Check the settings alone.

        Raises:
            ConfigError: naming the run-config key, for a value SecAgg+ cannot take.
        """
        if self.num_shares != 0 and self.num_shares < 3:
            raise ConfigError(
                f"run config: secagg-num-shares = {self.num_shares}, expected 0 (every sampled node) or >= 3"
            )
        if self.threshold != 0 and self.threshold < 2:
            raise ConfigError(
                f"run config: secagg-reconstruction-threshold = {self.threshold}, expected 0 (a majority "
                "of the shares) or >= 2"
            )
        if self.num_shares and self.threshold > self.num_shares:
            raise ConfigError(
                f"run config: secagg-reconstruction-threshold = {self.threshold} is above "
                f"secagg-num-shares = {self.num_shares}"
            )
        if self.clipping_range < 1.0:
            raise ConfigError(
                f"run config: secagg-clipping-range = {self.clipping_range}, expected >= 1 (the count "
                "vectors carry values up to 1)"
            )
        if not 2 <= self.quantization_range < 2**31:
            raise ConfigError(
                f"run config: secagg-quantization-range = {self.quantization_range}, expected an integer in [2, 2^31)"
            )

    def shares(self, k: int) -> int:
        """Shares per key among the sampled nodes.

        Args:
            k: the nodes sampled.

        Returns:
            min(num_shares, k), or k when num_shares is 0.
        """
        return min(self.num_shares, k) if self.num_shares else k

    def threshold_for(self, k: int) -> int:
        """The reconstruction threshold among the sampled nodes.

        Args:
            k: the nodes sampled.

        Returns:
            ``threshold``, or a majority of ``shares(k)`` when it is 0.
        """
        return self.threshold or self.shares(k) // 2 + 1

    def check_clients(self, k: int) -> None:
        """Raise ConfigError when a round of k sampled nodes cannot run SecAgg+ with these settings."""
        if k < 2:
            raise ConfigError(f"secure aggregation needs at least 2 clients per round, a round samples {k}")
        if k * self.quantization_range >= MODULUS:
            raise ConfigError(
                f"run config: secagg-quantization-range = {self.quantization_range}: {k} clients times "
                f"it must stay below 2^32 (the sum would wrap)"
            )
        if self.threshold_for(k) > self.shares(k):
            raise ConfigError(
                f"run config: secagg-reconstruction-threshold = {self.threshold} is above the "
                f"{self.shares(k)} shares a round of {k} clients has"
            )


# -- the server --------------------------------------------------------------------------------
class SumOnly(LegacyStrategy):
    """The legacy strategy the SecAgg+ workflow drives; it aggregates nothing itself.

    It hands out the round's FitIns and keeps what ``aggregate_fit`` receives: the unmasked mean
    and the contributors' FitRes, whose parameters the workflow replaced by that mean.

    Args:
        fitins: the round's (client proxy, FitIns), one per node.
    """

    def __init__(self, fitins: list[tuple[ClientProxy, FitIns]]):
        self.fitins = fitins
        self.mean: list[np.ndarray] | None = None
        self.results: list[tuple[ClientProxy, FitRes]] = []

    def initialize_parameters(self, client_manager: Any) -> Parameters | None:
        """No global parameters: each node's FitIns carries its own.

        Args:
            client_manager: Flower's client manager (unused).

        Returns:
            None.
        """
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        """Hand out the round's FitIns.

        Args:
            server_round: the round (unused).
            parameters: the workflow's global parameters (unused).
            client_manager: Flower's client manager (unused).

        Returns:
            The (client proxy, FitIns) pairs given at construction.
        """
        return list(self.fitins)

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        """Keep the contributors' FitRes and the unmasked mean the workflow put in their parameters.

        Args:
            server_round: the round (unused).
            results: the contributors' (client proxy, FitRes).
            failures: the failures (unused: the stage grid records who dropped).

        Returns:
            (None, {}): nothing is aggregated here.
        """
        self.results = list(results)
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        """No evaluation in the workflow (the transport sends its own EVALUATE messages).

        Args:
            server_round: the round (unused).
            parameters: the global parameters (unused).
            client_manager: Flower's client manager (unused).

        Returns:
            [].
        """
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        """Nothing to aggregate.

        Args:
            server_round: the round (unused).
            results: the evaluation results (none).
            failures: the failures (none).

        Returns:
            (None, {}).
        """
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        """No server-side evaluation.

        Args:
            server_round: the round (unused).
            parameters: the global parameters (unused).
        """
        return None


@dataclass
class StageGrid:
    """What the workflow calls ``grid``: its ``send_and_receive`` goes through the ServerApp's exchange.

    Attributes:
        grid: the Flower grid.
        exchange: the ServerApp's polling push/pull with a timeout (nestfed.flower.exchange.exchange).
        timeout_s: how long a stage waits for replies, in seconds.
        poll_s: how often replies are pulled, in seconds.
        lost: {node id: why}: the first stage each node failed.
        stage_s: {stage: seconds}.
        masked_bytes: {node id: bytes of its masked vector}.
    """

    grid: Any
    exchange: Callable[..., Any]
    timeout_s: float
    poll_s: float
    lost: dict[int, str] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)
    masked_bytes: dict[int, int] = field(default_factory=dict)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Send one stage's messages and pull the replies, recording losses, time and masked bytes.

        Args:
            messages: the stage's messages, one per node.
            timeout: the workflow's timeout (unused: ``timeout_s`` applies).

        Returns:
            The replies that came back, errors included.
        """
        msgs = list(messages)
        if not msgs:
            return []
        stage = str(msgs[0].content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE, "?"))
        t0 = time.perf_counter()
        ex = self.exchange(self.grid, {m.metadata.dst_node_id: m for m in msgs}, self.timeout_s, self.poll_s)
        self.stage_s[stage] = time.perf_counter() - t0
        for n in ex.missing:
            self.lost.setdefault(n, f"node {n}: no reply at SecAgg+ stage '{stage}' within {self.timeout_s:g} s")
        for n, m in ex.replies.items():
            if m.has_error():
                self.lost.setdefault(
                    n, f"node {n}: SecAgg+ stage '{stage}': node error {m.error.code}: {m.error.reason}"
                )
            elif stage == Stage.COLLECT_MASKED_VECTORS:
                masked = m.content.config_records[RECORD_KEY_CONFIGS].get(Key.MASKED_PARAMETERS, [])
                self.masked_bytes[n] = sum(len(b) for b in masked)
        return list(ex.replies.values())


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        raise ConfigError("secure aggregation sends arrays as NumPy arrays: bfloat16 payloads are not supported")
    return t.numpy()


def fit_instruction(
    ins: Instruction, cid: int, cfg_text: str, lay: Layout, scale: float, clip: float, run_dir: str = ""
) -> FitIns:
    """One node's instruction as a legacy FitIns.

    Args:
        ins: the instruction; its arrays become Parameters (in key order).
        cid: the client's id.
        cfg_text: the resolved experiment.
        lay: the layout of the summed vectors (nestfed.federation.secure_sum.layout).
        scale: the encoding's scale, 1 / n_max.
        clip: the encoding's clipping range c.
        run_dir: the server's run directory (the key of the node's kept client state).

    Returns:
        The FitIns, everything but the arrays in its config.
    """
    keys = list(ins.arrays)
    config = {
        f"{_PREFIX}experiment": cfg_text,
        f"{_PREFIX}cid": cid,
        f"{_PREFIX}run-dir": run_dir,
        f"{_PREFIX}config": json.dumps(ins.config),
        f"{_PREFIX}keys": json.dumps(keys),
        f"{_PREFIX}layout": json.dumps({k: list(v) for k, v in lay.items()}),
        f"{_PREFIX}scale": float(scale),
        f"{_PREFIX}clip": float(clip),
    }
    return FitIns(ndarrays_to_parameters([_numpy(ins.arrays[k]) for k in keys]), config)


@dataclass
class FitInstruction:
    """What a node reads from a secure TRAIN message (``read_fit_instruction``).

    Attributes:
        cfg_text: the resolved experiment.
        cid: the client's id.
        instruction: the arrays and config the server sent.
        layout: the layout of the summed vectors.
        scale: the encoding's scale, 1 / n_max.
        clip: the encoding's clipping range c.
        run_dir: the server's run directory; "" when not sent.
    """

    cfg_text: str
    cid: int
    instruction: Instruction
    layout: Layout
    scale: float
    clip: float
    run_dir: str = ""


def is_secure(content: RecordDict) -> bool:
    """Whether a TRAIN message is SecAgg+'s collect stage carrying a nestfed instruction.

    Args:
        content: the message's content.

    Returns:
        True when it carries a legacy FitIns config.
    """
    return FITINS_CONFIG in content.config_records


def read_fit_instruction(content: RecordDict) -> FitInstruction:
    """Inverse of ``fit_instruction`` on the node.

    Args:
        content: the collect stage's message content.

    Returns:
        The instruction and its encoding.

    Raises:
        KeyError: when a field is missing.
        ValueError: when malformed (the arrays do not match the keys).
    """
    cfg = content.config_records[FITINS_CONFIG]
    params = compat.arrayrecord_to_parameters(content.array_records[FITINS_PARAMETERS], keep_input=True)
    keys = json.loads(str(cfg[f"{_PREFIX}keys"]))
    nd = parameters_to_ndarrays(params)
    if len(nd) != len(keys):
        raise ValueError(f"{len(nd)} arrays for {len(keys)} keys")
    arrays: Arrays = {k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(keys, nd)}
    lay = {k: tuple(int(x) for x in v) for k, v in json.loads(str(cfg[f"{_PREFIX}layout"])).items()}
    return FitInstruction(
        str(cfg[f"{_PREFIX}experiment"]),
        int(cfg[f"{_PREFIX}cid"]),
        Instruction(arrays, json.loads(str(cfg[f"{_PREFIX}config"]))),
        lay,
        float(cfg[f"{_PREFIX}scale"]),
        float(cfg[f"{_PREFIX}clip"]),
        str(cfg.get(f"{_PREFIX}run-dir", "")),
    )


def fit_reply(vectors: list[torch.Tensor], metrics: dict[str, float]) -> RecordDict:
    """The node's encoded vectors as the legacy FitRes ``secaggplus_mod`` masks.

    Args:
        vectors: the encoded vectors.
        metrics: the client's metrics.

    Returns:
        The FitRes as a RecordDict: the vectors as float64, num_examples 1 (weight 1).
    """
    params = ndarrays_to_parameters([v.detach().to(torch.float64).numpy() for v in vectors])
    return compat.fitres_to_recorddict(FitRes(Status(Code.OK, "ok"), params, 1, dict(metrics)), keep_input=False)


class SurvivingSecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow that survives a node lost before it shared its keys.

    flwr 1.42's unmask stage counts as dead every sampled node that sent no masked vector and asks
    the survivors for shares of its key; a node lost at setup or share keys never gave any (the
    survivors' mod raises KeyError, the server finds too few shares), so the round halts. In the
    protocol (Bell et al., CCS 2020, Algorithm 2: only U2 \\ U3 is unmasked) and in flwr's own mod
    (a node masks only with the neighbours whose key shares reached it) those nodes take no part
    after share keys: once it is over, the sampled set and every neighbourhood are narrowed to the
    nodes that shared their keys, and the threshold is checked on them.
    """

    def share_keys_stage(self, grid: Any, context: LegacyContext, state: Any) -> bool:
        """Run flwr's share-keys stage, then narrow the round to the nodes that shared their keys.

        Args:
            grid: the workflow's grid.
            context: the legacy context.
            state: the workflow's state, narrowed in place.

        Returns:
            Whether every node still has at least the threshold's live neighbours.
        """
        super().share_keys_stage(grid, context, state)
        shared = set(state.active_node_ids)
        state.sampled_node_ids = shared
        state.nid_to_neighbours = {n: nb & shared for n, nb in state.nid_to_neighbours.items() if n in shared}
        return self._check_threshold(state)


def secure_fit(
    grid: Any,
    exchange: Callable[..., Any],
    rnd: int,
    instructions: dict[int, Instruction],
    node_of: dict[int, int],
    cfg_text: str,
    sa: SecAggSettings,
    n_max: int,
    timeout_s: float,
    poll_s: float,
    say: Callable[[str], None],
    run_dir: str = "",
) -> FitResults:
    """One TRAIN round through Flower's SecAgg+ workflow.

    Args:
        grid: the Flower grid.
        exchange: the ServerApp's polling push/pull (nestfed.flower.exchange.exchange).
        rnd: the round.
        instructions: {cid: instruction} of the sampled clients.
        node_of: {cid: node id}.
        cfg_text: the resolved experiment.
        sa: the SecAgg+ settings.
        n_max: the largest n_k of the federation (the encoding's scale is 1 / n_max).
        timeout_s: how long a stage waits for replies, in seconds.
        poll_s: how often replies are pulled, in seconds.
        say: called with each line to log.
        run_dir: the server's run directory (the key of the nodes' kept client state).

    Returns:
        Only the ``nestfed.federation.messages.SecureSum`` (``secure``; None when no sum came
        out), per-node transport info and the reasons of the nodes that dropped out (halted: every
        node dropped with the reason).
    """
    t0 = time.perf_counter()
    out = FitResults()
    cids = sorted(instructions)
    k = len(cids)
    lay = layout(instructions[c].expect for c in cids)
    scale = 1.0 / n_max
    cid_of = {node_of[c]: c for c in cids}
    fitins = []
    for c in cids:
        fi = fit_instruction(instructions[c], c, cfg_text, lay, scale, sa.clipping_range, run_dir)
        fitins.append((GridClientProxy(node_of[c], grid, 0), fi))
        out.info[c] = {"node_id": node_of[c], "wire_bytes_down": sum(len(t) for t in fi.parameters.tensors)}
    shim = SumOnly(fitins)
    shares, threshold = sa.shares(k), sa.threshold_for(k)
    stages = StageGrid(grid, exchange, timeout_s, poll_s)
    _workflow(sa, k, timeout_s)(stages, _legacy_context(rnd, shim))
    contributors = sorted(cid_of[p.node_id] for p, _ in shim.results) if shim.mean is not None else []
    _record_dropped(out, [c for c in cids if c not in contributors], node_of, stages, threshold)
    info = {
        "clients": k,
        "shares": shares,
        "threshold": threshold,
        "clipping_range": sa.clipping_range,
        "quantization_range": sa.quantization_range,
        "in_sum": contributors,
        "stages_s": stages.stage_s,
    }
    if contributors:
        total = [torch.from_numpy(np.asarray(a, dtype=np.float64) * len(contributors)) for a in shim.mean]
        out.secure = decode(total, lay, scale, contributors)
        info["sum_error_bound"] = sum_error(len(contributors), sa.clipping_range, sa.quantization_range, n_max)
        _contributor_info(out, shim, stages, cid_of)
    else:
        say(f"round {rnd}: secure aggregation produced no sum")
    out.round_info = {"secure_aggregation": info, "flower": {"exchange_s": time.perf_counter() - t0}}
    return out


def _workflow(sa: SecAggSettings, k: int, timeout_s: float) -> SurvivingSecAggPlus:
    """Flower's SecAgg+ workflow for ``k`` clients under the settings ``sa``."""
    return SurvivingSecAggPlus(
        sa.shares(k) / k,
        sa.threshold_for(k),
        max_weight=1.0,
        clipping_range=sa.clipping_range,
        quantization_range=sa.quantization_range,
        modulus_range=MODULUS,
        timeout=timeout_s,
    )


def _record_dropped(
    out: FitResults, dropped: list[int], node_of: dict[int, int], stages: StageGrid, threshold: int
) -> None:
    """Give each client left out of the sum the reason its node was lost (or that the protocol halted)."""
    for c in dropped:
        out.dropped[c] = stages.lost.get(node_of[c]) or (
            f"node {node_of[c]}: secure aggregation halted (fewer than {threshold} live neighbours for some node)"
        )


def _legacy_context(rnd: int, shim: SumOnly) -> LegacyContext:
    """The legacy context Flower's workflow runs in: round ``rnd``, the strategy ``shim``, no
    global parameters (each node's instruction carries its own)."""
    ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), strategy=shim)
    ctx.state.config_records["config"] = ConfigRecord({"current_round": rnd})
    ctx.state.array_records["parameters"] = ArrayRecord()
    return ctx


def _contributor_info(out: FitResults, shim: SumOnly, stages: StageGrid, cid_of: dict[int, int]) -> None:
    """Per client in the sum: the bytes of its masked vector (``bytes_up``) and its numeric
    metrics (booleans left out), into ``out.info``."""
    for proxy, res in shim.results:
        out.info[cid_of[proxy.node_id]].update(
            {
                "bytes_up": stages.masked_bytes.get(proxy.node_id, 0),
                "metrics": {
                    m: float(v)
                    for m, v in res.metrics.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                },
            }
        )


def secure_mod(msg: Message, ctx: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Apply Flower's ``secaggplus_mod`` to the TRAIN messages that carry SecAgg+ configs.

    Args:
        msg: the message.
        ctx: the node's context.
        call_next: the ClientApp's handler.

    Returns:
        The reply: through the mod for a SecAgg+ TRAIN message, else the handler's own.
    """
    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctx, call_next)
    return call_next(msg, ctx)
