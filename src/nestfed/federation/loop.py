"""The round loop: the only one. The embedded runner and Flower's ServerApp are two transports of it.

Per round: sample clients (fraction; seeded by round) -> ``strategy.configure`` -> the transport
delivers each instruction and brings the replies back -> every reply is validated (keys, shapes,
rank, dtype, NaN/Inf, n_k against the declared, the update's norm; a bad update is rejected with
its reason and never reaches the global model) -> ``strategy.aggregate`` (or its robust / DP form)
when at least ``min_clients`` updates were accepted, then the server optimiser's step
(nestfed.federation.server_optimizer; the identity by default); a non-finite result is refused -> held-out
evaluation of what each client now runs -> commit: the metrics line, then the checkpoint with the
clients' kept state (nestfed.federation.run_dir). Like Flower's ``Strategy.start(grid)``, the loop
talks to a :class:`Transport` and never to a client directly. Under secure aggregation (Flower's
SecAgg+, nestfed.flower.secure) the transport brings back only sums (``FitResults.secure``): no
reply can be validated (each client validates and clips its own), and the strategy's
``aggregate_secure`` rebuilds its rule from the sums (nestfed.federation.secure_sum).

Every random choice derives from (seed, round, client, stream) (nestfed.seeds), so a run resumed
from the checkpoint of round t reaches the same final state as an uninterrupted run (exactly, on
the same CPU and thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.config.capabilities import Capability, refusal
from nestfed.errors import RunFailed, UpdateRejected
from nestfed.federation.evaluation_plan import Deployments, EvalPlan
from nestfed.federation.folding import ReplyFolder
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply, SecureSum
from nestfed.federation.payload import non_finite_keys, payload_stats, validate_reply
from nestfed.federation.population import Population
from nestfed.federation.rank_groups import summarise_metrics
from nestfed.federation.relative_screen import RelativeScreen, round_blocks
from nestfed.federation.run_dir import ClientState, RunDir
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.strategy import Strategy
from nestfed.federation.tracking import Sink
from nestfed.seeds import stream_seed

OnEvent = Callable[[str, dict[str, Any]], None]


@dataclass
class FitResults:
    """What a transport brings back from one round's instructions.

    replies: {cid: Reply} as received (decoded) and not yet handed to ``on_reply`` (a transport
    given an ``on_reply`` hands each reply over as it arrives and keeps none); dropped: {cid:
    reason} for clients that gave no usable reply; info: {cid: transport fields for the metrics line
    (bytes on the wire, node id, timings)}; round_info: transport fields for the round's line.
    """

    replies: dict[int, Reply] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    round_info: dict[str, Any] = field(default_factory=dict)
    secure: SecureSum | None = None  # secure aggregation: only the sums came back, no reply


class Transport(Protocol):
    """How instructions reach clients and replies come back (in process, or Flower messages).

    client_state_home: where the clients' kept state lives (run_dir.KEPT: in the checkpoints, as
    :meth:`client_state` gives it; run_dir.ON_NODES: on the nodes, which keep it themselves).
    asks: what the transport asks of the method, {capability: the setting that asks}
    (nestfed.config.capabilities: e.g. Flower and its secure aggregation), refused by the loop
    unless the method declares it.
    """

    client_state_home: str
    asks: Mapping[Capability, str]

    def open(self) -> dict[str, Any]:
        """Fields for the round-0 metrics line (e.g. the nodes that answered)."""

    def fit(
        self, rnd: int, instructions: dict[int, Instruction], on_reply: Callable[[int, Reply], None] | None = None
    ) -> FitResults:
        """Deliver one instruction per client; hand each reply to ``on_reply(cid, reply)`` as it
        arrives (then keep it no longer), or collect them in FitResults.replies without one."""

    def evaluate(
        self, rnd: int, deployments: Mapping[int, tuple[Arrays, float]], as_sent: bool = False
    ) -> dict[str, dict[str, float]] | None:
        """Held-out metrics {cid: metrics} of each client under its (arrays, scale s), computed as
        each is read (:class:`Deployments`), as the client runs them (its kept state mixed in by
        its hooks) or, with ``as_sent``, exactly as sent (a global adapter measured on the
        client's data: the mechanism reports); None when this transport does not evaluate."""

    def client_state(self) -> ClientState | None:
        """The clients' kept state to checkpoint; None when the clients keep it themselves."""

    def restore_client_state(self, state: ClientState | None) -> None:
        """Give the clients the kept state of a resumed checkpoint."""


def sample_clients(
    clients: Sequence[ClientInfo],
    fraction: float,
    seed: int,
    rnd: int,
    sampling: str = "fixed",
    population: int | None = None,
) -> list[ClientInfo]:
    """Seeded client sampling (the seed rule's stream ``sampling`` of round ``rnd``), sorted by id.

    clients: those that can be sampled (the online ones); population: the federation's size K
    (default len(clients)). ``fixed``: max(1, round(fraction * K)) of ``clients`` without
    replacement (all of them when fewer are online); ``poisson``: each client independently with
    probability ``fraction`` (possibly none).
    """
    rng = np.random.default_rng(stream_seed(seed, rnd, 0, "sampling"))
    if sampling == "poisson":
        if fraction >= 1:
            return list(clients)
        draws = rng.random(len(clients))
        return [c for c, u in zip(clients, draws) if u < fraction]
    k = max(1, round(fraction * (len(clients) if population is None else population)))
    if k >= len(clients):
        return list(clients)
    chosen = sorted(rng.choice(len(clients), size=k, replace=False).tolist())
    return [clients[i] for i in chosen]


@dataclass
class RoundLoop:
    """Drive ``strategy`` through ``transport`` for ``rounds`` rounds, committing into ``run_dir``.

    min_clients: the fewest accepted updates a round needs to aggregate (else the global state is
    kept). capabilities: what the method ``method`` declares (nestfed.methods.method.Method), with
    its ``refusals``: the loop refuses at construction, with ConfigError naming the setting, what it
    or its transport asks beyond them (:meth:`asked`), so no transport runs a method past what it
    can do. keeps_client_state: the method's clients keep state between rounds (a resume then needs
    it in the checkpoint). safeguards: what an update must satisfy beyond its shapes (n_k, norm
    bound, DP clipping), the aggregation rule (robust or DP) and the privacy accountant
    (nestfed.federation.safeguards). on_event(kind, info): progress (``client_done``,
    ``round_done``). log: what happened that a user should read (rejections, drops, repairs).
    sinks: experiment-tracking sinks (nestfed.federation.tracking) handed every committed line,
    caught up from metrics.jsonl when the run resumes. population: the per-round draws of who is
    online, who drops out and the elastic ranks (nestfed.federation.population). evaluation: which
    clients each round evaluates (:class:`EvalPlan`). hold_replies: accepted replies kept before a
    mean-type rule folds them into sums (nestfed.federation.folding). server_evaluate(rnd, state):
    metrics the server measures itself after the round (the global held-out set), put in the line
    as ``eval_global``.
    """

    strategy: Strategy
    transport: Transport
    clients: list[ClientInfo]
    rounds: int
    run_dir: RunDir | None  # set before run() (nestfed.experiments.federated_run: after the capability check)
    fraction: float = 1.0
    min_clients: int = 1
    seed: int = 0
    keeps_client_state: bool = False
    keep_checkpoints: bool = True
    safeguards: Safeguards = field(default_factory=Safeguards)
    sampling: str = "fixed"
    on_event: OnEvent | None = None
    log: list[str] = field(default_factory=list)
    sinks: list[Sink] = field(default_factory=list)
    population: Population = field(default_factory=Population)
    evaluation: EvalPlan = field(default_factory=EvalPlan)
    hold_replies: int = 32
    server_evaluate: Callable[[int, GlobalState], dict[str, Any]] | None = None
    capabilities: frozenset[Capability] = frozenset()
    method: str = ""
    refusals: Mapping[Capability, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        line = refusal(self.method or self.strategy.name, self.capabilities, self.asked(), self.refusals)
        if line is not None:
            raise ConfigError(line)

    def asked(self) -> dict[Capability, str]:
        """What this loop asks of the method, {capability: the setting that asks}: its clients'
        ranks, elastic ranks, a robust rule or central DP, a server optimiser, and what the
        transport asks (nestfed.config.capabilities)."""
        out: dict[Capability, str] = {}
        if len({c.rank for c in self.clients}) > 1:
            out[Capability.HETEROGENEOUS_RANKS] = "lora.ranks"
        if self.population.elastic != "none":
            out[Capability.ELASTIC_RANKS] = "population.elastic"
        if self.safeguards.rule.active:
            central = self.safeguards.privacy.mode == "central"
            out[Capability.ROBUST_AGGREGATION] = "privacy.mode" if central else "robust.rule"
        if not self.safeguards.optimizer.identity:
            out[Capability.SERVER_OPTIMIZER] = "server_optimizer.name"
        for cap, setting in self.transport.asks.items():
            out.setdefault(cap, setting)
        return out

    @classmethod
    def from_config(
        cls,
        cfg: ExperimentConfig,
        strategy: Strategy,
        transport: Transport,
        clients: list[ClientInfo],
        run_dir: RunDir | None,
        keeps_client_state: bool,
        **kw: Any,
    ) -> RoundLoop:
        """The loop of an experiment: its rounds, sampling, min_clients, seed, safeguards, population,
        evaluation plan and reply bound from ``cfg``; ``kw`` sets the other fields (on_event, sinks,
        server_evaluate) or replaces one (min_clients on Flower). Raises ConfigError for a bad
        elastic trace (nestfed.federation.population.read_trace)."""
        f = cfg.federation
        settings: dict[str, Any] = {
            "fraction": f.fraction,
            "min_clients": f.min_clients,
            "seed": f.seed,
            "sampling": f.sampling,
            "safeguards": Safeguards.from_config(cfg),
            "evaluation": EvalPlan.from_config(cfg),
            "hold_replies": f.hold_replies,
        }
        settings.update(kw)
        if "population" not in settings:
            settings["population"] = Population.from_config(cfg, clients)
        return cls(strategy, transport, clients, f.rounds, run_dir, keeps_client_state=keeps_client_state, **settings)

    @property
    def _ranks(self) -> dict[str, int]:
        """{cid: r_k} of every client (the rank groups of the summaries)."""
        return {str(c.cid): c.rank for c in self.clients}

    def _emit(self, kind: str, **info: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, info)

    def _say(self, text: str) -> None:
        self.log.append(text)
        self._emit("log", text=text)

    def _track(self, line: dict[str, Any]) -> None:
        """Hand a committed line to every sink. A sink that fails is dropped for the rest of the run
        with a warning (metrics.jsonl has the line; a resume catches the sink up)."""
        for sink in list(self.sinks):
            try:
                sink.log(line)
            except Exception as exc:
                self.sinks.remove(sink)
                self._say(
                    f"round {line['round']}: tracking sink {sink.name} failed ({type(exc).__name__}: {exc}); "
                    "it is dropped for this run (metrics.jsonl has every round; a resume catches it up)"
                )

    def _close_sinks(self, finished: bool) -> None:
        for sink in self.sinks:
            try:
                sink.close(finished)
            except Exception as exc:
                self._say(f"tracking sink {sink.name} did not close ({type(exc).__name__}: {exc})")

    def run(self, shapes: dict[str, tuple[int, int]], resume: bool = False) -> GlobalState:
        """Run (or resume) the federation; return the final global state.

        Without ``resume``: round 0 (the initial state, evaluated) is committed first. With it:
        continue after the latest checkpoint (RunDir.resume; its errors propagate), or from round 0
        when the run crashed before committing it.
        """
        if self.run_dir is None:
            raise RuntimeError("RoundLoop.run: no run directory was set")
        ck = None
        if resume:
            ck, notes = self.run_dir.resume(self.keeps_client_state, self.transport.client_state_home)
            for n in notes:
                self._say(f"resume: {n}")
        committed = self.run_dir.read_metrics() if resume and self.run_dir.metrics_path.is_file() else []
        self._stalled = 0  # rounds in a row that did not aggregate, counted again from the committed lines
        for ln in committed:
            if ln["round"] > 0:
                self._stalled = 0 if ln.get("aggregated") else self._stalled + 1
        for sink in self.sinks:  # catch up on the committed rounds (none in a fresh run)
            sink.open(committed)
        try:
            state = self._run(shapes, ck)
        except BaseException:
            self._close_sinks(False)
            raise
        self._close_sinks(True)
        return state

    def _run(self, shapes: dict[str, tuple[int, int]], ck) -> GlobalState:
        if ck is not None:
            self.transport.restore_client_state(ck.client_state)
            state, start = ck.state, ck.round + 1
        else:
            state = self.strategy.initialize(shapes, self.clients)
            line: dict[str, Any] = {"round": 0, **self.transport.open()}
            cids = self.evaluation.clients(0, self.rounds, [c.cid for c in self.clients])
            evaluation = self.transport.evaluate(0, {c: ({}, 1.0) for c in cids}) if cids else None
            if evaluation is not None:
                line["eval"] = evaluation
            if self.server_evaluate is not None:
                line["eval_global"] = self.server_evaluate(0, state)
            self._summarise(line)
            self._track(self.run_dir.commit(0, state, self.transport.client_state(), line, self.keep_checkpoints))
            self._check_outcome(line)
            start = 1
        for rnd in range(start, self.rounds + 1):
            state = self.run_round(rnd, state)
        return state

    def run_round(self, rnd: int, state: GlobalState) -> GlobalState:  # noqa: C901, PLR0915 (the round's phases; split into steps is issue 36's)
        """One round: sample, configure, exchange, validate and fold, aggregate, evaluate, commit."""
        t0 = time.perf_counter()
        online = self.population.online(rnd, self.clients)
        sampled = self.population.this_round(
            rnd, sample_clients(online, self.fraction, self.seed, rnd, self.sampling, len(self.clients))
        )
        declared = {c.cid: c.num_examples for c in sampled}
        instructions = self.strategy.configure(rnd, state, sampled)
        for ins in instructions.values():  # a schedule over the federation's steps needs its length
            ins.config.setdefault("rounds", self.rounds)
        why_gone = self.population.dropouts(rnd, sampled)
        gone = set(why_gone)
        t_conf = time.perf_counter()
        ratio = self.safeguards.validation.norm_ratio
        folder = ReplyFolder(
            self.strategy,
            self.safeguards,
            rnd,
            state,
            instructions,
            self.hold_replies,
            max(declared.values(), default=1),
            screen=RelativeScreen(ratio, round_blocks(instructions)) if ratio > 0 else None,
            secure=Capability.SECURE_AGGREGATION in self.capabilities,
        )
        per_client: dict[str, dict[str, Any]] = {}
        rejected: dict[str, str] = {}
        dropped: dict[str, str] = {str(c): why_gone[c] for c in sorted(gone)}
        timing = {"validate_s": 0.0}

        def on_reply(cid: int, reply: Reply) -> None:  # validated, screened and folded as it arrives
            t = time.perf_counter()
            ins = instructions[cid]
            up = payload_stats(reply.arrays)
            info = per_client.setdefault(str(cid), {})
            info.update(
                {
                    "bytes_up": up["bytes"],
                    "params_up": up["params"],
                    "dtypes_up": up["dtypes"],
                    "num_examples": reply.num_examples,
                }
            )
            try:
                validate_reply(ins, reply)
                norms = folder.block_norms(cid, reply)
                screened, checks = self.safeguards.screen(ins, reply, declared[cid], norms)
                info.update(checks)
                if norms is not None and "clipped_to" in checks:  # scaled as a whole: every block alike
                    norms = {b: x * checks["clipped_to"] / checks["update_norm"] for b, x in norms.items()}
                folder.add(cid, screened, norms)
                info["status"] = "accepted"
            except UpdateRejected as exc:
                rejected[str(cid)] = str(exc)
                info["status"] = "rejected"
                self._say(f"round {rnd}: client {cid} update rejected: {exc}")
            # the client's own metrics, in their own namespace: they never touch the server's fields
            info["metrics"] = {k: v for k, v in reply.metrics.items() if isinstance(v, (int, float))}
            timing["validate_s"] += time.perf_counter() - t
            self._emit("client_done", round=rnd, cid=cid)

        delivered = {c: ins for c, ins in instructions.items() if c not in gone}
        res = self.transport.fit(rnd, delivered, on_reply) if delivered else FitResults()
        for cid in sorted(res.replies):  # a transport that collected its replies instead
            on_reply(cid, res.replies[cid])
        for cid, why in folder.settle().items():  # the default screen, over the round's replies
            per_client[str(cid)]["status"] = "rejected"
            rejected[str(cid)] = why
            self._say(f"round {rnd}: client {cid} update rejected: {why}")
        t_fit = time.perf_counter()
        for cid, ins in instructions.items():
            down = payload_stats(ins.arrays)
            info = {
                "bytes_down": down["bytes"],
                "params_down": down["params"],
                "dtypes_down": down["dtypes"],
                "rank_sent": ins.config.get("rank"),
            }
            info.update(res.info.get(cid, {}))
            info.update(per_client.get(str(cid), {}))
            if cid in gone:
                info.update({"status": "dropped", "bytes_up": 0, "bytes_down": 0})
            elif res.secure is not None and cid in res.secure.clients:  # in the secure sum: nothing to validate
                info.setdefault("bytes_up", 0)
                info["status"] = "secure"
            elif "status" not in info:
                reason = res.dropped.get(cid, "no reply")
                dropped[str(cid)] = reason
                info.update({"status": "dropped", "bytes_up": 0})
                self._say(f"round {rnd}: client {cid} dropped: {reason}")
            per_client[str(cid)] = info
        per_client = {str(c): per_client[str(c)] for c in sorted(instructions)}
        if sampled and len(dropped) * 2 > len(sampled):
            self._say(
                f"round {rnd}: WARNING {len(dropped)} of the {len(sampled)} sampled clients dropped out; the round "
                "aggregates the others only"
            )
        count = len(res.secure.clients) if res.secure is not None else folder.count
        aggregated = count >= self.min_clients
        trust: dict[str, Any] = {}
        if aggregated and res.secure is not None:  # the strategy rebuilds its rule from the sums alone
            new_state, trust = self.safeguards.aggregate_secure(self.strategy, rnd, state, res.secure)
        elif aggregated:
            new_state, trust = folder.aggregate()
        if aggregated:  # the arrays and the server optimiser's state, which is kept or refused with them
            bad = non_finite_keys(new_state.arrays) + non_finite_keys(new_state.optimizer)
            if bad:  # never accepted as the global state: the round keeps the old one
                aggregated = False
                trust["aggregate_rejected"] = f"non-finite values in {bad[:3]}{' ...' if len(bad) > 3 else ''}"
                self._say(
                    f"round {rnd}: the aggregate has non-finite values in {len(bad)} arrays "
                    f"({bad[0]}, ...); global state kept"
                )
            else:
                state = new_state
        else:
            self._say(f"round {rnd}: {count} accepted updates < min_clients {self.min_clients}; global state kept")
        trust.update(self.safeguards.privacy_spent(rnd, self.fraction))
        t_agg = time.perf_counter()
        cids = self.evaluation.clients(rnd, self.rounds, [c.cid for c in self.clients])
        evaluation = self.transport.evaluate(rnd, Deployments(self.strategy, state, cids)) if cids else None
        t_eval = time.perf_counter()
        line: dict[str, Any] = {
            "round": rnd,
            "sampled": [c.cid for c in sampled],
            "aggregated": aggregated,
            "clients": per_client,
            "rejected": rejected,
            "dropped": dropped,
        }
        if evaluation is not None:
            line["eval"] = evaluation
        if self.server_evaluate is not None and self.evaluation.evaluates(rnd, self.rounds):
            line["eval_global"] = self.server_evaluate(rnd, state)
        line.update(trust)
        line.update(
            {
                "bytes_down": sum(c["bytes_down"] for c in per_client.values()),
                "bytes_up": sum(c["bytes_up"] for c in per_client.values()),
            }
        )
        if self.population.availability < 1:
            line["online"] = len(online)
        if folder.count > self.hold_replies or folder.folded:
            line["replies"] = folder.facts()
        line.update(res.round_info)
        line["timing"] = {
            "configure_s": t_conf - t0,
            "exchange_s": t_fit - t_conf - timing["validate_s"],
            "validate_s": timing["validate_s"],
            "aggregate_s": t_agg - t_fit,
            "evaluate_s": t_eval - t_agg,
        }
        line["time_s"] = time.perf_counter() - t0
        self._summarise(line)
        t_commit = time.perf_counter()
        self._track(self.run_dir.commit(rnd, state, self.transport.client_state(), line, self.keep_checkpoints))
        self._emit("round_done", round=rnd, line=line, commit_s=time.perf_counter() - t_commit)
        self._stalled = 0 if aggregated else self._stalled + 1
        self._check_outcome(line)
        return state

    def _check_outcome(self, line: dict[str, Any]) -> None:
        """Raise RunFailed (after the round's line is committed, so it is on disk) when the round's
        global evaluation is non-finite, or when validation.stall_rounds rounds in a row aggregated
        nothing (a federation one client can stall)."""
        rnd = line["round"]
        ppl = [v.get("ppl") for v in (line.get("eval") or {}).values()]
        if "eval_global" in line:
            ppl.append(line["eval_global"].get("ppl"))
        bad = [p for p in ppl if isinstance(p, float) and not math.isfinite(p)]
        if bad:
            raise RunFailed(
                f"round {rnd}: the global model's held-out perplexity is {bad[0]} for "
                f"{len(bad)} of {len(ppl)} evaluations: the model is destroyed; the run stops",
                rnd,
            )
        limit = self.safeguards.validation.stall_rounds
        if limit and self._stalled >= limit:
            raise RunFailed(
                f"round {rnd}: no update aggregated for {self._stalled} rounds in a row "
                f"(validation.stall_rounds = {limit}; the rounds' lines say why); the run stops",
                rnd,
            )

    def _summarise(self, line: dict[str, Any]) -> None:
        """With the per-client numbers in their own file (RunDir.inline False), what the metrics
        line keeps of them: the evaluation by rank group (nestfed.federation.rank_groups), the
        number sampled and the statuses' counts."""
        if self.run_dir.inline:
            return
        if "eval" in line:
            line["eval_summary"] = summarise_metrics(line["eval"], self._ranks)
        if "sampled" in line:
            line["num_sampled"] = len(line["sampled"])
            statuses: dict[str, int] = {}
            for info in line["clients"].values():
                statuses[info["status"]] = statuses.get(info["status"], 0) + 1
            line["statuses"] = statuses
