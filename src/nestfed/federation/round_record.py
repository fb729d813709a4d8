"""The record of one round as the loop runs it (nestfed.federation.loop), and the metrics line it
ends in.

Per client: the bytes, parameters and dtypes sent (``*_down``) and received (``*_up``; bytes are
serialised payload bytes, nestfed.federation.payload), the rank sent, n_k as replied, the checks of
the screen (nestfed.federation.safeguards: the update's norm, a clip), the status (``accepted``,
``rejected``, ``dropped``, or ``secure``: in a secure sum, never seen alone) and the client's own
metrics in their own namespace. Per round: the rejections and the drops with their reasons, and
the phases' wall-clock seconds (``timing``: configure, exchange less validation, validate,
aggregate, evaluate; ``time_s``: the whole round up to its line).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from nestfed.federation.messages import ClientInfo, Instruction, Reply
from nestfed.federation.payload import payload_stats
from nestfed.federation.rank_groups import summarise_metrics


class RoundRecord:
    """One round's record, filled phase by phase; ``line`` builds its metrics line.

    The clock starts at construction; ``configured``, ``exchanged`` and ``mark`` take the phases'
    ends (``configure``, ``exchange``, ``aggregate``, ``evaluate``, in that order).

    Args:
        rnd: the round.
    """

    def __init__(self, rnd: int) -> None:
        self.rnd = rnd
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.sampled: list[int] = []
        self.clients: dict[str, dict[str, Any]] = {}  # {str(cid): the client's fields}
        self.rejected: dict[str, str] = {}  # {str(cid): why}
        self.dropped: dict[str, str] = {}  # {str(cid): why}
        self.validate_s = 0.0

    def mark(self, phase: str) -> None:
        """Take the end of a phase (now).

        Args:
            phase: ``configure``, ``exchange``, ``aggregate`` or ``evaluate``.
        """
        self.marks[phase] = time.perf_counter()

    def configured(self, sampled: Sequence[ClientInfo], gone: Mapping[int, str]) -> None:
        """Record the round's sample: the end of the configure phase.

        Args:
            sampled: the clients sampled.
            gone: {cid: why} of the clients that dropped out after sampling.
        """
        self.mark("configure")
        self.sampled = [c.cid for c in sampled]
        self.dropped = {str(c): gone[c] for c in sorted(gone)}

    # -- replies, as they arrive ---------------------------------------------------------------
    def received(self, cid: int, reply: Reply) -> None:
        """Record what came up from a client: its payload's size and the n_k it replied.

        Args:
            cid: the client's id.
            reply: its reply.
        """
        up = payload_stats(reply.arrays)
        self.clients.setdefault(str(cid), {}).update(
            {
                "bytes_up": up["bytes"],
                "params_up": up["params"],
                "dtypes_up": up["dtypes"],
                "num_examples": reply.num_examples,
            }
        )

    def checked(self, cid: int, checks: Mapping[str, Any]) -> None:
        """Record the screen's checks of a client's update (Safeguards.screen).

        Args:
            cid: the client's id.
            checks: {check: value}, e.g. the update's norm, a clip.
        """
        self.clients[str(cid)].update(checks)

    def accept(self, cid: int) -> None:
        """Mark a client's update accepted.

        Args:
            cid: the client's id.
        """
        self.clients[str(cid)]["status"] = "accepted"

    def reject(self, cid: int, why: str) -> None:
        """Mark a client's update rejected (also when it was first accepted, by a screen over the round's replies).

        Args:
            cid: the client's id.
            why: the reason, for the line's ``rejected``.
        """
        self.rejected[str(cid)] = why
        self.clients[str(cid)]["status"] = "rejected"

    def replied(self, cid: int, reply: Reply, seconds: float) -> None:
        """Record that a client's reply is screened.

        Its own numeric metrics are kept under ``metrics`` (they never touch the server's fields).

        Args:
            cid: the client's id.
            reply: its reply.
            seconds: the screening's wall-clock time, added to the round's ``validate_s``.
        """
        self.clients[str(cid)]["metrics"] = {k: v for k, v in reply.metrics.items() if isinstance(v, (int, float))}
        self.validate_s += seconds

    def exchanged(self) -> None:
        """The end of the exchange: every reply came back and was screened."""
        self.mark("exchange")

    # -- every client, once the exchange is over ----------------------------------------------
    def close(
        self,
        instructions: Mapping[int, Instruction],
        gone: Collection[int],
        transport_info: Mapping[int, Mapping[str, Any]],
        no_reply: Mapping[int, str],
        in_sum: Collection[int] = (),
    ) -> dict[int, str]:
        """Give every instructed client its full fields, in id order.

        The fields: what was sent, the transport's fields, what came up, and a status for those
        without one: ``dropped`` (gone after sampling: nothing sent; or no reply) or ``secure``
        (in the secure sum).

        Args:
            instructions: {cid: instruction} of every instructed client.
            gone: the clients that dropped out after sampling.
            transport_info: {cid: the transport's fields} (FitResults.info).
            no_reply: {cid: why} of the clients the transport got no reply from; a client missing
                here and without a status drops for "no reply".
            in_sum: the clients in the secure sum.

        Returns:
            {cid: why} of the clients that dropped for want of a reply.
        """
        lost: dict[int, str] = {}
        for cid, ins in instructions.items():
            down = payload_stats(ins.arrays)
            info: dict[str, Any] = {
                "bytes_down": down["bytes"],
                "params_down": down["params"],
                "dtypes_down": down["dtypes"],
                "rank_sent": ins.config.get("rank"),
            }
            info.update(transport_info.get(cid, {}))
            info.update(self.clients.get(str(cid), {}))
            if cid in gone:
                info.update({"status": "dropped", "bytes_up": 0, "bytes_down": 0})
            elif cid in in_sum:  # nothing to validate
                info.setdefault("bytes_up", 0)
                info["status"] = "secure"
            elif "status" not in info:
                lost[cid] = no_reply.get(cid, "no reply")
                self.dropped[str(cid)] = lost[cid]
                info.update({"status": "dropped", "bytes_up": 0})
            self.clients[str(cid)] = info
        self.clients = {str(c): self.clients[str(c)] for c in sorted(instructions)}
        return lost

    # -- the line ------------------------------------------------------------------------------
    def timing(self) -> dict[str, float]:
        """The phases' wall-clock seconds.

        Returns:
            {configure_s, exchange_s (less validation), validate_s, aggregate_s, evaluate_s}.
        """
        m = self.marks
        return {
            "configure_s": m["configure"] - self.t0,
            "exchange_s": m["exchange"] - m["configure"] - self.validate_s,
            "validate_s": self.validate_s,
            "aggregate_s": m["aggregate"] - m["exchange"],
            "evaluate_s": m["evaluate"] - m["aggregate"],
        }

    def line(
        self,
        aggregated: bool,
        evaluations: Mapping[str, Any],
        trust: Mapping[str, Any],
        extra: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Build the round's metrics line.

        Args:
            aggregated: whether the round aggregated.
            evaluations: ``eval``, ``eval_global`` where measured.
            trust: the trust facts (robust rule, privacy spent, a refused aggregate).
            extra: the loop's and the transport's round fields.

        Returns:
            The line: round, sampled, aggregated, clients, rejected, dropped, then the
            evaluations, the trust facts, the bytes down and up summed over the clients, the
            extra fields, ``timing`` and ``time_s`` (the whole round, in seconds).
        """
        line: dict[str, Any] = {
            "round": self.rnd,
            "sampled": self.sampled,
            "aggregated": aggregated,
            "clients": self.clients,
            "rejected": self.rejected,
            "dropped": self.dropped,
        }
        line.update(evaluations)
        line.update(trust)
        line.update(
            {
                "bytes_down": sum(c["bytes_down"] for c in self.clients.values()),
                "bytes_up": sum(c["bytes_up"] for c in self.clients.values()),
            }
        )
        line.update(extra)
        line["timing"] = self.timing()
        line["time_s"] = time.perf_counter() - self.t0
        return line


def summarise_clients(line: dict[str, Any], ranks: Mapping[str, int]) -> None:
    """Add to a metrics line what it keeps of its per-client numbers when they have their own file.

    With RunDir.inline False: the evaluation by rank group (``eval_summary``,
    nestfed.federation.rank_groups), the number sampled (``num_sampled``) and the statuses' counts
    (``statuses``, {status: clients}).

    Args:
        line: the metrics line, changed in place.
        ranks: {str(cid): r_k} of every client.
    """
    if "eval" in line:
        line["eval_summary"] = summarise_metrics(line["eval"], ranks)
    if "sampled" in line:
        line["num_sampled"] = len(line["sampled"])
        statuses: dict[str, int] = {}
        for info in line["clients"].values():
            statuses[info["status"]] = statuses.get(info["status"], 0) + 1
        line["statuses"] = statuses
