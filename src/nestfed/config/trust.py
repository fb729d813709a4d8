"""The trust sections of an experiment config: what the server accepts (``[validation]``), how it
aggregates against byzantine clients (``[robust]``), differential privacy (``[privacy]``) and the
attacks a test federation stages (``[attack]``). Core sections, like ``[federation]``: they apply to
every method whose home supports them (nestfed.methods refuses the rest). docs/trust.md explains
each rule and the privacy derivation.
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_EXAMPLES_POLICIES = ("reject", "cap")
NORM_ACTIONS = ("reject", "clip")
RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum")
PRIVACY_MODES = ("off", "central", "local")
ACCOUNTANTS = ("pld", "rdp")
ATTACKS = ("none", "sign_flip", "scale", "noise", "free_rider", "constant", "nans", "float64", "shuffle", "random_text")
#: attacks that change the client's training data (applied when the data is prepared)
DATA_ATTACKS = ("shuffle", "random_text")


@dataclass(frozen=True)
class ValidationConfig:
    """What a client reply must satisfy besides keys, shapes, dtype and finiteness.

    An update whose squared norm overflows float32 is always rejected; a non-finite global
    evaluation always stops the run.

    Attributes:
        num_examples: a reply's n_k above what the client declared when it joined is ``reject``ed
            or ``cap``ped to the declared value.
        max_update_norm: a bound on the L2 norm of a client's update (its reply minus what it was
            sent, over all arrays); 0 = no bound.
        on_norm: ``reject`` an update above ``max_update_norm``, or ``clip`` it to the bound (norm
            bounding, Sun et al. 2019).
        norm_ratio: the default screen (nestfed.federation.relative_screen): an update whose norm in
            any rank block exceeds this many times the lower median of its peers' norms in that
            block is rejected; 0 = off.
        stall_rounds: a run in which no round has aggregated for this many rounds in a row stops
            with an error naming the round (0 = never).
    """

    num_examples: str = "reject"
    max_update_norm: float = 0.0
    on_norm: str = "clip"
    norm_ratio: float = 10.0
    stall_rounds: int = 3


@dataclass(frozen=True)
class RobustConfig:
    """The server's aggregation rule in update space, applied per rank block (docs/trust.md).

    Attributes:
        rule: ``mean`` (the method's own aggregation), ``median`` (coordinate-wise),
            ``trimmed_mean`` (coordinate-wise, dropping the ``trim_fraction`` largest and
            smallest), ``krum`` / ``multi_krum`` (Blanchard et al. 2017: the update(s) closest to
            their m - f - 2 nearest neighbours).
        trim_fraction: the fraction ``trimmed_mean`` drops at each end, in [0, 0.5).
        byzantine: f, the byzantine clients Krum tolerates (m >= 2f + 3).
        multi_krum_keep: how many of the best updates multi_krum averages; 0 = m - f.
    """

    rule: str = "mean"
    trim_fraction: float = 0.1
    byzantine: int = 1
    multi_krum_keep: int = 0


@dataclass(frozen=True)
class PrivacyConfig:
    """Client-level differential privacy (DP-FedAvg, McMahan et al. 2018) on the update.

    Attributes:
        mode: ``off``, ``central`` (the server clips each update to ``clip_norm`` and adds Gaussian
            noise of std ``noise_multiplier * clip_norm`` to each block's sum) or ``local`` (each
            client clips and noises its own update before sending).
        clip_norm: C, the L2 bound on an update (the sensitivity); > 0 when privacy is on.
        noise_multiplier: the noise's std in units of ``clip_norm``, >= 0.
        delta: the target delta of the reported epsilon, in (0, 1).
        accountant: ``pld`` or ``rdp`` (Google's dp-accounting).
    """

    mode: str = "off"
    clip_norm: float = 0.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    accountant: str = "pld"


@dataclass(frozen=True)
class AttackConfig:
    """Byzantine clients for robustness experiments: ``clients`` run ``kind``.

    Seeded by the seed rule.

    Attributes:
        kind: ``none``; the attacks ``sign_flip`` (sends sent - update), ``scale`` (sent + scale *
            update), ``noise`` (sent + N(0, noise_std^2) per entry), ``free_rider`` (trains nothing,
            returns what it received), ``shuffle`` (trains on its text with each block's tokens
            permuted), ``random_text`` (trains on uniformly random token ids: text foreign to every
            client); the faults ``constant`` (every entry ``value``), ``nans``, ``float64`` (the
            reply in float64).
        clients: the attacking clients' ids.
        scale: the factor of ``scale``.
        noise_std: the std of ``noise``, >= 0.
        value: every entry of ``constant``.
    """

    kind: str = "none"
    clients: tuple[int, ...] = ()
    scale: float = 100.0
    noise_std: float = 1.0
    value: float = 1e9


def check_trust(
    v: ValidationConfig,
    r: RobustConfig,
    p: PrivacyConfig,
    a: AttackConfig,
    num_clients: int,
    sampled: int,
    fraction: float,
    sampling: str,
) -> None:
    """Check the trust sections, in the order validation, robust, privacy, attack.

    Args:
        v: ``[validation]``.
        r: ``[robust]``.
        p: ``[privacy]``.
        a: ``[attack]``.
        num_clients: K.
        sampled: clients per round (Krum's m must allow its f).
        fraction: ``federation.fraction``.
        sampling: ``federation.sampling`` (DP with subsampling needs Poisson sampling for its
            accountant).

    Raises:
        ValueError: "<section.key>: <reason>", for the first value at fault.
    """
    _check_validation(v)
    if p.noise_multiplier < 0:  # refused whether privacy is on or not: a value that would be wrong if it were
        raise ValueError(f"privacy.noise_multiplier must be >= 0, got {p.noise_multiplier}")
    _check_robust(r, sampled)
    _check_privacy(p, r, fraction, sampling)
    _check_attack(a, num_clients)


def _check_validation(v: ValidationConfig) -> None:
    if v.num_examples not in NUM_EXAMPLES_POLICIES:
        raise ValueError(f"validation.num_examples must be 'reject' or 'cap', got '{v.num_examples}'")
    if v.max_update_norm < 0:
        raise ValueError(f"validation.max_update_norm must be >= 0 (0 = no bound), got {v.max_update_norm}")
    if v.on_norm not in NORM_ACTIONS:
        raise ValueError(f"validation.on_norm must be 'reject' or 'clip', got '{v.on_norm}'")
    if not (v.norm_ratio == 0 or v.norm_ratio >= 1):
        raise ValueError(
            f"validation.norm_ratio must be 0 (off) or >= 1 (a multiple of the peers' median), got {v.norm_ratio}"
        )
    if v.stall_rounds < 0:
        raise ValueError(f"validation.stall_rounds must be >= 0 (0 = never stop), got {v.stall_rounds}")


def _check_robust(r: RobustConfig, sampled: int) -> None:
    if r.rule not in RULES:
        raise ValueError(f"robust.rule: unknown rule '{r.rule}' (known: {', '.join(RULES)})")
    if not 0 <= r.trim_fraction < 0.5:
        raise ValueError(
            f"robust.trim_fraction must be in [0, 0.5) (it drops that fraction at each end), got {r.trim_fraction}"
        )
    if r.byzantine < 0:
        raise ValueError(f"robust.byzantine must be >= 0, got {r.byzantine}")
    if r.rule in ("krum", "multi_krum") and sampled < 2 * r.byzantine + 3:
        raise ValueError(
            f"robust.byzantine: Krum tolerates f byzantine clients among m >= 2f + 3; {sampled} clients "
            f"per round tolerate at most f = {max(0, (sampled - 3) // 2)}, got f = {r.byzantine}"
        )
    if r.multi_krum_keep < 0 or r.multi_krum_keep > sampled:
        raise ValueError(f"robust.multi_krum_keep must be in [0, {sampled}] (0 = m - f), got {r.multi_krum_keep}")


def _check_privacy(p: PrivacyConfig, r: RobustConfig, fraction: float, sampling: str) -> None:
    if p.mode not in PRIVACY_MODES:
        raise ValueError(f"privacy.mode must be off, central or local, got '{p.mode}'")
    if p.accountant not in ACCOUNTANTS:
        raise ValueError(f"privacy.accountant must be 'pld' or 'rdp', got '{p.accountant}'")
    if p.mode == "off":
        return
    if p.clip_norm <= 0:
        raise ValueError("privacy.clip_norm: differential privacy needs a clip norm C > 0 (the sensitivity)")
    if not 0 < p.delta < 1:
        raise ValueError(f"privacy.delta must be in (0, 1), got {p.delta}")
    if p.mode == "central" and r.rule != "mean":
        raise ValueError(
            f"privacy.mode: central DP replaces the aggregation rule by its noisy mean; "
            f"robust.rule = '{r.rule}' cannot be combined with it"
        )
    if p.mode == "central" and fraction < 1 and sampling != "poisson":
        raise ValueError(
            "federation.sampling: central DP with federation.fraction < 1 needs "
            "sampling = 'poisson' (the accountant's subsampling amplification assumes it)"
        )


def _check_attack(a: AttackConfig, num_clients: int) -> None:
    if a.kind not in ATTACKS:
        raise ValueError(f"attack.kind: unknown attack '{a.kind}' (known: {', '.join(ATTACKS)})")
    bad = [c for c in a.clients if not 0 <= c < num_clients]
    if bad:
        raise ValueError(f"attack.clients: client {bad[0]} does not exist ({num_clients} clients)")
    if a.kind != "none" and not a.clients:
        raise ValueError(f"attack.clients: attack '{a.kind}' names no client")
    if a.noise_std < 0:
        raise ValueError(f"attack.noise_std must be >= 0, got {a.noise_std}")
