"""The round loop: the only one. The embedded runner and Flower's ServerApp are two transports of it.

Per round:

1. sample clients (``fraction``; seeded by round), then ``strategy.configure``;
2. the transport delivers each instruction and brings the replies back;
3. every reply is validated (keys, shapes, rank, dtype, NaN/Inf, n_k against the declared, the
   update's norm): a bad update is rejected with its reason and never reaches the global model;
4. ``strategy.aggregate`` (or its robust / DP form) when at least ``min_clients`` updates were
   accepted, then the server optimiser's step (nestfed.federation.server_optimizer; the identity
   by default); a non-finite result is refused;
5. held-out evaluation of what each client now runs;
6. commit: the metrics line (each client's status, bytes and checks, the phases' timings:
   nestfed.federation.round_record), then the checkpoint with the clients' kept state
   (nestfed.federation.run_dir).

Like Flower's ``Strategy.start(grid)``, the loop talks to a ``Transport`` and never to a client
directly. Under secure aggregation (Flower's SecAgg+, nestfed.flower.secure) the transport brings
back only sums (``FitResults.secure``): no reply can be validated (each client validates and clips
its own), and the strategy's ``aggregate_secure`` rebuilds its rule from the sums
(nestfed.federation.secure_sum).

Every random choice derives from (seed, round, client, stream) (nestfed.seeds), so a run resumed
from the checkpoint of round t reaches the same final state as an uninterrupted run (exactly, on
the same CPU and thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nestfed.config import ConfigError, ExperimentConfig, clients_per_round
from nestfed.config.capabilities import Capability, refusal
from nestfed.errors import RunFailed, UpdateRejected
from nestfed.federation.evaluation_plan import Deployments, EvalPlan
from nestfed.federation.folding import ReplyFolder
from nestfed.federation.messages import ClientInfo, GlobalState, Instruction, Reply, SecureSum
from nestfed.federation.payload import non_finite_keys, validate_reply
from nestfed.federation.population import Population
from nestfed.federation.relative_screen import RelativeScreen, round_blocks
from nestfed.federation.round_record import RoundRecord, summarise_clients
from nestfed.federation.run_dir import RunDir
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.strategy import Strategy
from nestfed.federation.tracking import Sink
from nestfed.federation.transport import FitResults, Transport
from nestfed.seeds import stream_seed

OnEvent = Callable[[str, dict[str, Any]], None]


def sample_clients(
    clients: Sequence[ClientInfo],
    fraction: float,
    seed: int,
    rnd: int,
    sampling: str = "fixed",
    population: int | None = None,
) -> list[ClientInfo]:
    """Seeded client sampling (the seed rule's stream ``sampling`` of round ``rnd``), sorted by id.

    Args:
        clients: those that can be sampled (the online ones).
        fraction: the share of the federation to sample, in (0, 1].
        seed: the run's seed (nestfed.seeds.stream_seed).
        rnd: the round.
        sampling: ``fixed``: max(1, round(fraction * K)) of ``clients`` without replacement (all
            of them when fewer are online); ``poisson``: each client independently with
            probability ``fraction`` (possibly none).
        population: the federation's size K; None for len(clients).

    Returns:
        The sampled clients, in the order of ``clients``.
    """
    rng = np.random.default_rng(stream_seed(seed, rnd, 0, "sampling"))
    if sampling == "poisson":
        if fraction >= 1:
            return list(clients)
        draws = rng.random(len(clients))
        return [c for c, u in zip(clients, draws) if u < fraction]
    k = clients_per_round(fraction, len(clients) if population is None else population)
    if k >= len(clients):
        return list(clients)
    chosen = sorted(rng.choice(len(clients), size=k, replace=False).tolist())
    return [clients[i] for i in chosen]


@dataclass
class RoundLoop:
    """Drive ``strategy`` through ``transport`` for ``rounds`` rounds, committing into ``run_dir``.

    The loop refuses at construction, with ConfigError naming the setting, what it or its
    transport asks (``asked``) beyond the method's ``capabilities`` and ``refusals``, so no
    transport runs a method past what it can do.

    Attributes:
        strategy: the method's server side (configure, aggregate).
        transport: how instructions reach the clients and replies come back.
        clients: every client of the federation.
        rounds: the number of rounds T.
        run_dir: where rounds are committed; None until set, before ``run``
            (nestfed.experiments.federated_run sets it after the capability check).
        fraction: the share of clients sampled per round; default 1.0.
        min_clients: the fewest accepted updates a round needs to aggregate (else the global state
            is kept); default 1.
        seed: the run's seed, from which every random choice derives; default 0.
        keeps_client_state: the method's clients keep state between rounds (a resume then needs it
            in the checkpoint); default False.
        keep_checkpoints: keep every round's checkpoint (False: the latest only); default True.
        safeguards: what an update must satisfy beyond its shapes (n_k, norm bound, DP clipping),
            the aggregation rule (robust or DP) and the privacy accountant
            (nestfed.federation.safeguards).
        sampling: ``fixed`` or ``poisson`` (``sample_clients``); default ``fixed``.
        on_event: called as ``on_event(kind, info)`` with progress (``client_done``,
            ``round_done``, ``log``); None for none.
        log: what happened that a user should read (rejections, drops, repairs).
        sinks: experiment-tracking sinks (nestfed.federation.tracking) handed every committed line,
            caught up from metrics.jsonl when the run resumes.
        population: the per-round draws of who is online, who drops out and the elastic ranks
            (nestfed.federation.population).
        evaluation: which clients each round evaluates (``EvalPlan``).
        hold_replies: accepted replies kept before a mean-type rule folds them into sums
            (nestfed.federation.folding); default 32.
        server_evaluate: called as ``server_evaluate(rnd, state)`` after the round for the metrics
            the server measures itself (the global held-out set), put in the line as
            ``eval_global``; None for none.
        capabilities: what the method declares (nestfed.methods.method.Method).
        method: the method's name, for the refusal's message (default: the strategy's name).
        refusals: {capability: why the method refuses it}, for the refusal's message.
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
        """What this loop asks of the method (nestfed.config.capabilities).

        Returns:
            {capability: the setting that asks}: its clients' ranks, elastic ranks, a robust rule or
            central DP, a server optimiser, and what the transport asks.
        """
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
        """The loop of an experiment.

        Its rounds, sampling, min_clients, seed, safeguards, population, evaluation plan and reply
        bound come from ``cfg``.

        Args:
            cfg: the experiment's config.
            strategy: the method's server side.
            transport: how instructions reach the clients.
            clients: every client of the federation.
            run_dir: where rounds are committed; None to set it later.
            keeps_client_state: the method's clients keep state between rounds.
            **kw: the other fields (on_event, sinks, server_evaluate, capabilities ...), or one of
                the config's replaced (min_clients on Flower).

        Returns:
            The loop.

        Raises:
            ConfigError: for a bad elastic trace (nestfed.federation.population.read_trace), or
                when the loop asks what the method refuses.
        """
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
        """Run (or resume) the federation.

        Args:
            shapes: the LoRA layers' weight shapes, {module: (out, in)}, for the initial state.
            resume: False commits round 0 (the initial state, evaluated) first; True continues
                after the latest checkpoint (``RunDir.resume``; its errors propagate), or from
                round 0 when the run crashed before committing it.

        Returns:
            The final global state.

        Raises:
            RuntimeError: when no run directory was set.
            RunFailed: when a round's global evaluation is non-finite or validation.stall_rounds
                rounds in a row aggregated nothing (after the round's line is committed).
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

    def run_round(self, rnd: int, state: GlobalState) -> GlobalState:
        """One round: sample, configure, exchange, validate and fold, aggregate, evaluate, commit.

        Args:
            rnd: the round, from 1.
            state: the global state before the round.

        Returns:
            The global state after the round (``state`` itself when it did not aggregate).

        Raises:
            RunFailed: when the round's global evaluation is non-finite or too many rounds in a row
                aggregated nothing (after the round's line is committed).
        """
        record = RoundRecord(rnd)
        online, sampled = self._sample(rnd)
        instructions = self._configure(rnd, state, sampled)
        gone = self.population.dropouts(rnd, sampled)  # {cid: why}
        record.configured(sampled, gone)
        declared = {c.cid: c.num_examples for c in sampled}
        folder = self._folder(rnd, state, instructions, max(declared.values(), default=1))
        res = self._exchange(rnd, instructions, gone, declared, folder, record)
        self._close_clients(rnd, record, instructions, gone, res)
        state, aggregated, trust = self._aggregate(rnd, state, folder, res.secure)
        record.mark("aggregate")
        evaluations = self._evaluate(rnd, state, record)
        line = record.line(aggregated, evaluations, trust, self._round_fields(online, folder, res))
        self._commit(rnd, state, line, aggregated)
        return state

    def _round_fields(self, online: list[ClientInfo], folder: ReplyFolder, res: FitResults) -> dict[str, Any]:
        """The round's own fields of its line: ``online`` (how many, when not every client is),
        ``replies`` (ReplyFolder.facts, when replies were folded or more were held than
        ``hold_replies``), then the transport's (FitResults.round_info)."""
        out: dict[str, Any] = {}
        if self.population.availability < 1:
            out["online"] = len(online)
        if folder.count > self.hold_replies or folder.folded:
            out["replies"] = folder.facts()
        out.update(res.round_info)
        return out

    def _sample(self, rnd: int) -> tuple[list[ClientInfo], list[ClientInfo]]:
        """(the clients online in round ``rnd``, those sampled among them, as this round runs them:
        the elastic ranks applied)."""
        online = self.population.online(rnd, self.clients)
        sample = sample_clients(online, self.fraction, self.seed, rnd, self.sampling, len(self.clients))
        return online, self.population.this_round(rnd, sample)

    def _configure(self, rnd: int, state: GlobalState, sampled: list[ClientInfo]) -> dict[int, Instruction]:
        """The strategy's instructions {cid: Instruction}, each told the federation's length
        (``rounds``: a schedule over the federation's steps needs it)."""
        instructions = self.strategy.configure(rnd, state, sampled)
        for ins in instructions.values():
            ins.config.setdefault("rounds", self.rounds)
        return instructions

    def _folder(self, rnd: int, state: GlobalState, instructions: dict[int, Instruction], n_max: int) -> ReplyFolder:
        """The round's ReplyFolder: the default screen when ``validation.norm_ratio`` > 0, folding
        past ``hold_replies``; n_max: the largest n_k declared."""
        ratio = self.safeguards.validation.norm_ratio
        return ReplyFolder(
            self.strategy,
            self.safeguards,
            rnd,
            state,
            instructions,
            self.hold_replies,
            n_max,
            screen=RelativeScreen(ratio, round_blocks(instructions)) if ratio > 0 else None,
            secure=Capability.SECURE_AGGREGATION in self.capabilities,
        )

    def _exchange(
        self,
        rnd: int,
        instructions: dict[int, Instruction],
        gone: Mapping[int, str],
        declared: dict[int, int],
        folder: ReplyFolder,
        record: RoundRecord,
    ) -> FitResults:
        """Deliver the instructions of the clients still there; screen and fold each reply as it
        arrives (``_take_reply``; in id order from a transport that collected them), then the
        default screen over the round's replies (ReplyFolder.settle), whose rejections are recorded."""

        def take(cid: int, reply: Reply) -> None:
            self._take_reply(rnd, cid, reply, instructions[cid], declared[cid], folder, record)

        delivered = {c: ins for c, ins in instructions.items() if c not in gone}
        res = self.transport.fit(rnd, delivered, take) if delivered else FitResults()
        for cid in sorted(res.replies):  # a transport that collected its replies instead
            take(cid, res.replies[cid])
        for cid, why in folder.settle().items():
            record.reject(cid, why)
            self._say(f"round {rnd}: client {cid} update rejected: {why}")
        record.exchanged()
        return res

    def _take_reply(
        self,
        rnd: int,
        cid: int,
        reply: Reply,
        ins: Instruction,
        declared: int,
        folder: ReplyFolder,
        record: RoundRecord,
    ) -> None:
        """One reply as it arrives: validated against its instruction, screened (Safeguards.screen:
        n_k against the ``declared``, the norm bound, clipping) and folded; or rejected, with its
        reason recorded and said."""
        t = time.perf_counter()
        record.received(cid, reply)
        try:
            validate_reply(ins, reply)
            norms = folder.block_norms(cid, reply)
            screened, checks = self.safeguards.screen(ins, reply, declared, norms)
            record.checked(cid, checks)
            if norms is not None and "clipped_to" in checks:  # scaled as a whole: every block alike
                norms = {b: x * checks["clipped_to"] / checks["update_norm"] for b, x in norms.items()}
            folder.add(cid, screened, norms)
            record.accept(cid)
        except UpdateRejected as exc:
            record.reject(cid, str(exc))
            self._say(f"round {rnd}: client {cid} update rejected: {exc}")
        record.replied(cid, reply, time.perf_counter() - t)
        self._emit("client_done", round=rnd, cid=cid)

    def _close_clients(
        self,
        rnd: int,
        record: RoundRecord,
        instructions: dict[int, Instruction],
        gone: Mapping[int, str],
        res: FitResults,
    ) -> None:
        """Every instructed client's fields and status (RoundRecord.close); say each client that
        gave no reply, and warn when most of the sample dropped out."""
        in_sum = res.secure.clients if res.secure is not None else ()
        for cid, reason in record.close(instructions, gone, res.info, res.dropped, in_sum).items():
            self._say(f"round {rnd}: client {cid} dropped: {reason}")
        n, lost = len(record.sampled), len(record.dropped)
        if n and lost * 2 > n:
            self._say(
                f"round {rnd}: WARNING {lost} of the {n} sampled clients dropped out; the round "
                "aggregates the others only"
            )

    def _aggregate(
        self, rnd: int, state: GlobalState, folder: ReplyFolder, secure: SecureSum | None
    ) -> tuple[GlobalState, bool, dict[str, Any]]:
        """(the global state after the round, whether it aggregated, the trust facts). With at least
        ``min_clients`` accepted updates, the strategy's rule (or its rebuild from the secure sums)
        and the server optimiser's step; a non-finite result is refused (``_refuse_non_finite``).
        Otherwise the state is kept. The trust facts end with the privacy spent so far."""
        count = len(secure.clients) if secure is not None else folder.count
        trust: dict[str, Any] = {}
        aggregated = count >= self.min_clients
        if not aggregated:
            self._say(f"round {rnd}: {count} accepted updates < min_clients {self.min_clients}; global state kept")
        elif secure is not None:  # the strategy rebuilds its rule from the sums alone
            new_state, trust = self.safeguards.aggregate_secure(self.strategy, rnd, state, secure)
            state, aggregated = self._refuse_non_finite(rnd, state, new_state, trust)
        else:
            new_state, trust = folder.aggregate()
            state, aggregated = self._refuse_non_finite(rnd, state, new_state, trust)
        trust.update(self.safeguards.privacy_spent(rnd, self.fraction))
        return state, aggregated, trust

    def _refuse_non_finite(
        self, rnd: int, state: GlobalState, new_state: GlobalState, trust: dict[str, Any]
    ) -> tuple[GlobalState, bool]:
        """(``new_state``, True) when its arrays and the server optimiser's state (kept or refused
        with them) are finite; else (``state``, False), with ``aggregate_rejected`` in ``trust``:
        a non-finite aggregate is never accepted as the global state."""
        bad = non_finite_keys(new_state.arrays) + non_finite_keys(new_state.optimizer)
        if not bad:
            return new_state, True
        trust["aggregate_rejected"] = f"non-finite values in {bad[:3]}{' ...' if len(bad) > 3 else ''}"
        self._say(
            f"round {rnd}: the aggregate has non-finite values in {len(bad)} arrays ({bad[0]}, ...); global state kept"
        )
        return state, False

    def _evaluate(self, rnd: int, state: GlobalState, record: RoundRecord) -> dict[str, Any]:
        """The round's evaluations: ``eval`` (held out, of the clients the plan evaluates this round,
        as each runs ``state``) and, where the server measures itself this round, ``eval_global``."""
        out: dict[str, Any] = {}
        cids = self.evaluation.clients(rnd, self.rounds, [c.cid for c in self.clients])
        evaluation = self.transport.evaluate(rnd, Deployments(self.strategy, state, cids)) if cids else None
        record.mark("evaluate")
        if evaluation is not None:
            out["eval"] = evaluation
        if self.server_evaluate is not None and self.evaluation.evaluates(rnd, self.rounds):
            out["eval_global"] = self.server_evaluate(rnd, state)
        return out

    def _commit(self, rnd: int, state: GlobalState, line: dict[str, Any], aggregated: bool) -> None:
        """Commit the round (its line, then its checkpoint with the clients' kept state), hand the
        line to the sinks, then check the outcome (RunFailed once the line is on disk)."""
        self._summarise(line)
        t_commit = time.perf_counter()
        self._track(self.run_dir.commit(rnd, state, self.transport.client_state(), line, self.keep_checkpoints))
        self._emit("round_done", round=rnd, line=line, commit_s=time.perf_counter() - t_commit)
        self._stalled = 0 if aggregated else self._stalled + 1
        self._check_outcome(line)

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
        line keeps of them (nestfed.federation.round_record.summarise_clients)."""
        if not self.run_dir.inline:
            summarise_clients(line, self._ranks)
