"""Non-IID MMLU by domain: FedNL's five clients, each holding the questions of one domain.

The setting of arXiv 2605.16350, section 5.1 (docs/methods.md section 3), capped at 2000 train / 200
test questions per client.

docs/methods.md names the domains' subjects in words; the mapping to MMLU's 57 subject files is ours
where the words are a family:

- history: high-school European, US and world history, and prehistory;
- politics: high-school government and politics, and US foreign policy;
- economics: high-school macro- and microeconomics, and econometrics;
- religion: world religions;
- biology, chemistry: their high-school and college files;
- physics: high-school, college and conceptual physics.

professional_accounting is in no domain (the paper lists it nowhere) and is left out. Check: the
Math/CS domain has 1,098 questions, which a 1/6 test fraction splits into the paper's 915 train /
183 test (tested).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nestfed.data.corpora import MultipleChoice, mmlu

DOMAINS: dict[str, tuple[str, ...]] = {
    "law_ethics": (
        "professional_law",
        "moral_scenarios",
        "moral_disputes",
        "logical_fallacies",
        "formal_logic",
        "international_law",
        "jurisprudence",
        "business_ethics",
    ),
    "humanities": (
        "miscellaneous",
        "high_school_european_history",
        "high_school_us_history",
        "high_school_world_history",
        "prehistory",
        "high_school_government_and_politics",
        "us_foreign_policy",
        "high_school_macroeconomics",
        "high_school_microeconomics",
        "econometrics",
        "high_school_geography",
        "sociology",
        "philosophy",
        "world_religions",
        "management",
        "marketing",
        "public_relations",
        "security_studies",
        "global_facts",
    ),
    "stem": (
        "elementary_mathematics",
        "high_school_biology",
        "college_biology",
        "high_school_chemistry",
        "college_chemistry",
        "high_school_physics",
        "college_physics",
        "conceptual_physics",
        "astronomy",
        "anatomy",
        "electrical_engineering",
    ),
    "math_cs": (
        "high_school_mathematics",
        "high_school_statistics",
        "machine_learning",
        "college_mathematics",
        "high_school_computer_science",
        "college_computer_science",
        "computer_security",
        "abstract_algebra",
    ),
    "medical_psychology": (
        "professional_psychology",
        "high_school_psychology",
        "virology",
        "nutrition",
        "professional_medicine",
        "clinical_knowledge",
        "human_aging",
        "college_medicine",
        "human_sexuality",
        "medical_genetics",
    ),
}
TEST_FRACTION = 1 / 6  # 1,098 Math/CS questions -> 915 train / 183 test, as in the paper


def domain_of(subject: str) -> str | None:
    """The FedNL domain of an MMLU subject name.

    Args:
        subject: the MMLU subject (its file's stem).

    Returns:
        The domain, or None for a subject in no domain.
    """
    for dom, subjects in DOMAINS.items():
        if subject in subjects:
            return dom
    return None


def domain_items(root: str | Path, split: str = "test", seed: int = 0) -> tuple[list[MultipleChoice], list[str]]:
    """Every question of the five domains from ``<root>/<split>/`` and its domain label.

    The items come in a seeded random order, so that capping a client's sorted item indices takes a
    random sample of its subjects, not the alphabetically first ones.

    Args:
        root: MMLU's folder.
        split: the split's subfolder (``test``, ``dev``, ``val``).
        seed: the seed of the order.

    Returns:
        The items and one domain label per item.

    Raises:
        DataError: when the folder or a domain's subject file is missing or malformed (from
            `nestfed.data.corpora.mmlu`).
    """
    subjects = [s for subs in DOMAINS.values() for s in subs]
    items = mmlu(root, split, subjects)
    order = np.random.default_rng(seed).permutation(len(items))
    items = [items[i] for i in order]
    return items, [domain_of(x.subject) or "" for x in items]
