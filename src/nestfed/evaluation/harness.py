"""MMLU through EleutherAI's lm-evaluation-harness, as FlowerTune's LLM leaderboard asks it.

FlowerTune's General-NLP track (Flower's ``benchmarks/flowertune-llm/evaluation/general-nlp``:
``benchmarks.py``, ``utils.py``) scores a model on the MMLU test split in three category groups
(`CATEGORIES`: STEM, social sciences, humanities; its fourth, "other", is not on the
leaderboard). Each question is one zero-shot prompt (`prompt`)::

    <|im_start|>question
    Answer the following multiple choice question.
    Question: <question, "?" appended unless it ends in "?" or ".">

    Options:
    A. <choice 0>
    ...
    D. <choice 3>
    The answer is:
    <|im_end|>
    <|im_start|>answer

the model generates greedily as many tokens as the gold letter has (one, for the tokenizers we
ship), and `extract_answer` turns the text into a letter (lower-cased, non-alphanumerics
dropped, first character) or leaves it as it is; a category's accuracy is the fraction of its
questions whose extraction equals the gold letter (micro average over its subjects).

A small model may answer none of them: SmolLM2-135M-Instruct's first token after the "answer"
turn is ``<|im_end|>`` on nearly every question, which the protocol scores as wrong. So each
category is also scored by log-likelihood (`SCORINGS`): the same prompt, the answer taken as
the letter A-D with the highest log-probability as the next token (lm-eval's ``multiple_choice``,
as its own MMLU tasks score), which separates models that generation scores alike.

Here the protocol is an lm-eval ``generate_until`` task per category (`tasks`) built
from the local MMLU files (``<root>/test/<subject>_test.csv``, read by
`nestfed.data.corpora.mmlu`; nothing is downloaded), and the model is lm-eval's Hugging Face
model (``HFLM``) with a PEFT adapter on top (`evaluate`). ``fraction`` < 1 takes a seeded
sample of that fraction of every subject (at least one question), which keeps the subjects' mix.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np

from nestfed.config import ModelConfig
from nestfed.data.corpora import MultipleChoice, mmlu
from nestfed.errors import ConfigError
from nestfed.nn.placement import resolve_device, resolve_dtype
from nestfed.nn.quantization import bnb_config

#: FlowerTune's MMLU category groups (benchmarks.py, MMLU_CATEGORY), the three on the leaderboard
CATEGORIES: dict[str, tuple[str, ...]] = {
    "stem": (
        "abstract_algebra",
        "anatomy",
        "astronomy",
        "college_biology",
        "college_chemistry",
        "college_computer_science",
        "college_mathematics",
        "college_physics",
        "computer_security",
        "conceptual_physics",
        "electrical_engineering",
        "elementary_mathematics",
        "high_school_biology",
        "high_school_chemistry",
        "high_school_computer_science",
        "high_school_mathematics",
        "high_school_physics",
        "high_school_statistics",
        "machine_learning",
    ),
    "social_sciences": (
        "econometrics",
        "high_school_geography",
        "high_school_government_and_politics",
        "high_school_macroeconomics",
        "high_school_microeconomics",
        "high_school_psychology",
        "human_sexuality",
        "professional_psychology",
        "public_relations",
        "security_studies",
        "sociology",
        "us_foreign_policy",
    ),
    "humanities": (
        "formal_logic",
        "high_school_european_history",
        "high_school_us_history",
        "high_school_world_history",
        "international_law",
        "jurisprudence",
        "logical_fallacies",
        "moral_disputes",
        "moral_scenarios",
        "philosophy",
        "prehistory",
        "professional_law",
        "world_religions",
    ),
}
INSTRUCTION = "Answer the following multiple choice question."
LETTERS = "ABCD"
TASK_PREFIX = "flowertune_mmlu_"
#: the two scorings of one prompt: FlowerTune's greedy generation, and the letters' log-likelihood
SCORINGS = ("generation", "loglik")


def prompt(question: str, choices: tuple[str, ...] | list[str]) -> str:
    """FlowerTune's prompt for one MMLU question, as one string.

    utils.format_example inside benchmarks.py's instruction and the chat wrapper of its
    ``inference``.

    Args:
        question: the question ("?" appended unless it ends in "?" or ".").
        choices: the four options, A-D.

    Returns:
        The prompt (module docstring).
    """
    if not question.endswith("?") and not question.endswith("."):
        question += "?"
    options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    body = f"{INSTRUCTION}\nQuestion: {question}\n\nOptions:\n{options}\nThe answer is:\n"
    return f"<|im_start|>question\n{body}<|im_end|>\n<|im_start|>answer\n"


def extract_answer(output: str) -> str:
    r"""FlowerTune's answer extraction for a multiple-choice generation.

    utils.format_answer with ``answer_type="mcq"``: lower-case; the line after a ``"\n##"`` if there
    is one; every non-alphanumeric character to a space, spaces collapsed and stripped; then the
    first character.

    Args:
        output: the generated text.

    Returns:
        The first character if it is a letter it accepts (a-e, or the words yes / no), else the
            whole lower-cased output (which then matches no gold letter).
    """
    text = output.lower()
    full = text
    if "\n##" in text:
        text = text.split("\n##")[1].split("\n")[0].strip().lower()
    text = re.sub(r"[^a-zA-Z0-9]", " ", text).strip()
    text = re.sub(" +", " ", text)
    text = text.encode("ascii", "ignore").decode("ascii")
    text = text[0] if text else text
    return text if text in ("a", "b", "c", "d", "e", "yes", "no") else full


def sample_subjects(items: list[MultipleChoice], fraction: float, seed: int) -> list[MultipleChoice]:
    """A seeded sample of ``fraction`` of each subject's questions (ceil, at least one).

    Args:
        items: the questions.
        fraction: the share kept, in (0, 1]; 1 keeps every item.
        seed: the sample's seed.

    Returns:
        The sample, in file order within each subject.

    Raises:
        ConfigError: for a fraction outside (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ConfigError(f"--fraction {fraction}: must be in (0, 1]")
    if fraction == 1:
        return list(items)
    by_subject: dict[str, list[int]] = {}
    for i, x in enumerate(items):
        by_subject.setdefault(x.subject, []).append(i)
    rng = np.random.default_rng(seed)
    keep: list[int] = []
    for subject in sorted(by_subject):
        idx = by_subject[subject]
        n = max(1, math.ceil(fraction * len(idx)))
        keep.extend(sorted(rng.choice(idx, size=n, replace=False).tolist()))
    return [items[i] for i in sorted(keep)]


def _docs(items: list[MultipleChoice]) -> list[dict]:
    """lm-eval documents: question, choices, subject, the gold letter (lower case) and the prompt."""
    return [
        {
            "question": x.question,
            "choices": list(x.choices),
            "subject": x.subject,
            "answer": x.answer,
            "gold": LETTERS[x.answer].lower(),
            "prompt": prompt(x.question, x.choices),
            "doc_id": i,
        }
        for i, x in enumerate(items)
    ]


def _extract_filter(resps, docs):
    """lm-eval ``custom`` filter: `extract_answer` on every generation of every document."""
    return [[extract_answer(r) for r in doc_resps] for doc_resps in resps]


@dataclass(frozen=True)
class Protocol:
    """Which MMLU questions to score and how.

    Attributes:
        mmlu_root: the local MMLU root folder.
        categories: the categories (`CATEGORIES`); default all three.
        fraction: the share of each subject sampled, in (0, 1]; default 1.
        seed: the sample's seed.
        batch_size: lm-eval's batch size (prompts per forward); default 16.
        device: where the model runs (``model.device``'s names: nestfed.nn.placement); default
            ``auto``.
        dtype: the model's dtype (``model.dtype``'s names); ``auto`` = float32 on the CPU, bfloat16
            on CUDA.
        quantization: the backbone held ``nf4`` or ``int8`` by bitsandbytes
            (``model.quantization``'s names; FlowerTune's leaderboard scores on a 4-bit base);
            ``none`` (the default) = at dtype.
    """

    mmlu_root: str
    categories: tuple[str, ...] = tuple(CATEGORIES)
    fraction: float = 1.0
    seed: int = 0
    batch_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"

    def placement(self) -> tuple[str, str]:
        """The device and dtype resolved, e.g. ("cpu", "float32") or ("cuda:0", "bfloat16").

        Returns:
            The device's and the dtype's names.

        Raises:
            ConfigError: as nestfed.nn.placement raises it.
        """
        device = resolve_device(self.device)
        return str(device), str(resolve_dtype(self.dtype, device)).removeprefix("torch.")


#: ``nestfed eval --quantization``'s values (FlowerTune's bit widths, or model.quantization's names)
QUANTIZATION_NAMES = {"4": "nf4", "nf4": "nf4", "8": "int8", "int8": "int8", "none": "none", "16": "none", "32": "none"}


def quantization_name(value: str) -> str:
    """``model.quantization``'s name for a ``--quantization`` value (4 -> nf4, 8 -> int8, none).

    Args:
        value: the command line's value (`QUANTIZATION_NAMES`).

    Returns:
        ``nf4``, ``int8`` or ``none``.

    Raises:
        ConfigError: naming the values it takes, or when bitsandbytes is missing for a quantised
            one.
    """
    name = QUANTIZATION_NAMES.get(str(value).strip().lower())
    if name is None:
        raise ConfigError(f"--quantization: '{value}' is not 4, 8 or none")
    if name != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"--quantization {value}: needs bitsandbytes (scripts/setup.sh installs it)")
    return name


def questions(protocol: Protocol) -> dict[str, list[MultipleChoice]]:
    """The questions of each category under a protocol.

    Args:
        protocol: the categories, root folder, fraction and seed.

    Returns:
        {category: its questions}.

    Raises:
        ConfigError: for an unknown category.
        DataError: naming the file, for a missing or malformed MMLU file.
    """
    unknown = [c for c in protocol.categories if c not in CATEGORIES]
    if unknown:
        raise ConfigError(f"--categories: unknown {', '.join(unknown)} (known: {', '.join(CATEGORIES)})")
    return {
        c: sample_subjects(mmlu(protocol.mmlu_root, "test", CATEGORIES[c]), protocol.fraction, protocol.seed)
        for c in protocol.categories
    }


def task_name(category: str, scoring: str) -> str:
    """lm-eval's name for one category and scoring.

    Args:
        category: the category.
        scoring: ``generation`` or ``loglik`` (`SCORINGS`).

    Returns:
        ``flowertune_mmlu_<category>`` (generation) or ``flowertune_mmlu_<category>_loglik``.
    """
    return TASK_PREFIX + category + ("" if scoring == "generation" else "_" + scoring)


def tasks(items_by_category: dict[str, list[MultipleChoice]]) -> list:
    """Two lm-eval ``ConfigurableTask`` per category.

    FlowerTune's (greedy generation of one token, `extract_answer` as a custom filter, exact
    match against the gold letter) and the log-likelihood one (``multiple_choice`` over the letters
    A-D after the same prompt, accuracy).

    Args:
        items_by_category: {category: its questions}.

    Returns:
        The tasks, two per category in order.
    """
    import datasets
    from lm_eval.api.task import ConfigurableTask

    out = []
    for category, items in items_by_category.items():
        docs = _docs(items)

        def dataset(docs=docs, **_):
            return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})

        common = {
            "custom_dataset": dataset,
            "test_split": "test",
            "doc_to_text": "{{prompt}}",
            "num_fewshot": 0,
            "metadata": {"version": 1.0},
        }
        out.append(
            ConfigurableTask(
                config={
                    **common,
                    "task": task_name(category, "generation"),
                    "doc_to_target": "{{gold}}",
                    "output_type": "generate_until",
                    "generation_kwargs": {"until": ["<|im_end|>"], "max_gen_toks": 1, "do_sample": False},
                    "filter_list": [
                        {"name": "flowertune", "filter": [{"function": "custom", "filter_fn": _extract_filter}]}
                    ],
                    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
                }
            )
        )
        out.append(
            ConfigurableTask(
                config={
                    **common,
                    "task": task_name(category, "loglik"),
                    "doc_to_target": "{{answer}}",
                    "output_type": "multiple_choice",
                    "doc_to_choice": list(LETTERS),
                    "target_delimiter": "",
                    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                }
            )
        )
    return out


def evaluate(
    backbone_dir: str | Path,
    adapter_dir: str | Path | None,
    protocol: Protocol,
    items_by_category: dict[str, list[MultipleChoice]] | None = None,
) -> dict[str, dict[str, list[int]]]:
    """Score a Hugging Face model (and a PEFT adapter on top) on FlowerTune's protocol.

    Runs ``lm_eval.simple_evaluate`` on the protocol's device in its dtype (fp32 on the CPU).

    Args:
        backbone_dir: the Hugging Face model directory.
        adapter_dir: the PEFT adapter directory, or None for the backbone alone.
        protocol: what to score and where.
        items_by_category: the questions; `questions` of the protocol when None.

    Returns:
        Per scoring (`SCORINGS`) and category, the per-question correctness (1 / 0) in the
            order of `questions`, so that two models can be compared question by question.

    Raises:
        ConfigError: when lm-eval is not installed or a directory is not a model / adapter.
        RuntimeError: when lm-eval scores fewer questions than asked.
    """
    try:
        import lm_eval
    except ImportError:
        raise ConfigError("nestfed eval needs lm-eval: pip install 'nestfed[eval]' (lm-eval==0.4.13)") from None
    if not (Path(backbone_dir) / "config.json").is_file():
        raise ConfigError(f"{backbone_dir}: not a Hugging Face model directory (no config.json)")
    if adapter_dir is not None and not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise ConfigError(f"{adapter_dir}: not a PEFT adapter directory (no adapter_config.json)")
    logging.getLogger("lm-eval").setLevel(logging.ERROR)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    items = items_by_category if items_by_category is not None else questions(protocol)
    model = lm_model(backbone_dir, adapter_dir, protocol)
    import lm_eval.evaluator

    # lm-eval records `git describe` of the working directory, whose "fatal: not a git repository"
    # reaches the terminal from any other folder: ask git quietly instead
    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", quiet_git_hash):
        res = _simple_evaluate(lm_eval, model, items, protocol)
    out: dict[str, dict[str, list[int]]] = {s: {} for s in SCORINGS}
    for scoring, metric in zip(SCORINGS, ("exact_match", "acc")):
        for category, its in items.items():
            samples = sorted(res["samples"][task_name(category, scoring)], key=lambda s: s["doc_id"])
            if len(samples) != len(its):
                raise RuntimeError(f"lm-eval scored {len(samples)} of {len(its)} {category} questions")
            out[scoring][category] = [int(s[metric]) for s in samples]
    return out


def lm_model(backbone_dir: str | Path, adapter_dir: str | Path | None, protocol: Protocol) -> dict | object:
    """What lm-eval scores: ``hf`` model arguments, or an ``HFLM`` over a quantised backbone.

    The arguments load the backbone in the protocol's dtype on its device, the PEFT adapter on top.
    With ``protocol.quantization`` (``nf4`` / ``int8``, FlowerTune's ``--quantization 4`` / ``8``)
    the backbone is loaded through transformers' ``BitsAndBytesConfig``
    (nestfed.nn.quantization.bnb_config) with the adapter on it.

    Args:
        backbone_dir: the Hugging Face model directory.
        adapter_dir: the PEFT adapter directory, or None.
        protocol: the device, dtype, quantization and batch size.

    Returns:
        The ``hf`` model arguments (a dict), or the HFLM.
    """
    device, dtype = protocol.placement()
    if protocol.quantization == "none":
        args = {"pretrained": str(backbone_dir), "dtype": dtype, "device": device}
        return args if adapter_dir is None else {**args, "peft": str(adapter_dir)}
    from lm_eval.models.huggingface import HFLM
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    bnb = bnb_config(ModelConfig(quantization=protocol.quantization, device=device))
    model = AutoModelForCausalLM.from_pretrained(
        backbone_dir, quantization_config=BitsAndBytesConfig(**bnb), dtype=dtype, device_map=device
    )
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    tokenizer = AutoTokenizer.from_pretrained(backbone_dir)
    return HFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=protocol.batch_size)


def _simple_evaluate(lm_eval, model: dict | object, items, protocol) -> dict:
    from lm_eval.tasks import TaskManager

    as_args = isinstance(model, dict)
    return lm_eval.simple_evaluate(
        model="hf" if as_args else model,
        model_args=model if as_args else None,
        tasks=tasks(items),
        # the tasks are built here: no index of lm-eval's own (reading its YAML files took 10 s a call)
        task_manager=TaskManager(include_defaults=False),
        batch_size=protocol.batch_size,
        log_samples=True,
        bootstrap_iters=0,
        random_seed=protocol.seed,
        numpy_random_seed=protocol.seed,
        torch_random_seed=protocol.seed,
        fewshot_random_seed=protocol.seed,
    )


def quiet_git_hash() -> str | None:
    """``git describe --always`` of the working directory, its stderr kept off the terminal.

    Returns:
        The description, or None outside a git repository or without git.
    """
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() or None
