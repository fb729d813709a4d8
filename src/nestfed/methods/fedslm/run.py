"""FedSLM's run on a prepared experiment (the method is declared in nestfed.methods.fedslm): the
compressed groups' trainers, the strategy, and the recipe after the last round: the weak model W_g,
its evaluation, weak-to-strong elicitation."""

from __future__ import annotations

from typing import Any

from nestfed.config import ExperimentConfig
from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import Exports
from nestfed.methods.compressed.evaluation import (
    client_columns,
    client_fields,
    client_memory,
    compressed_clients,
    core_train,
    evaluate_server,
    mean_ppl,
)
from nestfed.methods.compressed.groups import GroupedTrainer
from nestfed.methods.compressed.setup import CompressedSetup, prepare_compressed
from nestfed.methods.fedslm.elicitation import elicit
from nestfed.methods.fedslm.strategy import FedSLM, SLMGroups
from nestfed.methods.fedslm.weak_model import weak_model, weak_views
from nestfed.methods.implementation import Implementation, MethodRun
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.frozen_prefix import CachedText
from nestfed.nn.lora import get_adapter_state, init_adapter_state, lora_modules
from nestfed.seeds import stream_seed


def elicitation(
    prep: Prepared, cfg: ExperimentConfig, setup: CompressedSetup, weak, weak_text: CachedText
) -> tuple[Arrays, float, dict[str, Any]]:
    """Step 4 for every variant; the variant ``alpha = elicitation.alpha`` is the reported server model.

    Args:
        prep: the prepared experiment (the backbone is the student).
        cfg: the experiment (``[elicitation]``, ``[lora]``).
        setup: the compressed side (the server text as the backbone sees it).
        weak (nn.Module): the weak model f_w.
        weak_text: the server text as the weak model sees it.

    Returns:
        The reported variant's LoRA arrays, its scale s, and the summary fields.
    """
    e = cfg.section("elicitation")
    scale = cfg.lora.lora_alpha / e.rank
    init = init_adapter_state(prep.shapes, e.rank, cfg.lora.init_seed)
    student = prep.backbone.model
    variants: list[tuple[str, float | None]] = [("none", None)]
    for a in list(e.compare_alphas) + [e.alpha]:
        name = f"alpha={a:g}"
        if all(v[0] != name for v in variants):
            variants.append((name, a))
    results, evals, chosen = {}, {}, {}
    for name, a in variants:
        apply_arrays(student, init, scale)
        info: dict[str, float] = {}
        if a is not None:
            params = [p for m in lora_modules(student).values() for p in (m.lora_A.weight, m.lora_B.weight)]
            info = elicit(
                student,
                params,
                weak,
                setup.public["strong"],
                weak_text,
                a,
                e.steps,
                e.batch_size,
                e.lr,
                stream_seed(e.seed, 0, 0, "elicitation"),
            )
        adapter = get_adapter_state(student)
        evals[name] = evaluate_server(prep, cfg, adapter, scale)
        results[name] = {**info, "mean_ppl": mean_ppl(evals[name])}
        if a == e.alpha:
            chosen = adapter
    key = f"alpha={e.alpha:g}"
    return (
        chosen,
        scale,
        {
            "elicitation": results,
            "server_eval_variants": evals,
            "server_eval": evals[key],
            "server_mean_ppl": results[key]["mean_ppl"],
            "server_variant": key,
        },
    )


def build(prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
    """FedSLM set up on a prepared experiment.

    The compressed groups' trainers (cores trained at compression.core_lr), the FedSLM strategy, and
    the recipe after the last round: the weak model, its evaluation, elicitation.

    Args:
        prep: the prepared experiment.
        cfg: the experiment.

    Returns:
        The method run.
    """
    setup = prepare_compressed(prep, cfg)
    c = cfg.section("compression")
    groups = SLMGroups(
        setup.ratios,
        [setup.ranks(g) for g in range(len(setup.ratios))],
        setup.client_group,
        {n: setup.bases[n].S for n in setup.trained},
    )
    strategy = FedSLM(groups, c.fusion, cfg.federation.seed)
    trainers = {
        g: ClientTrainer(m, setup.data[g], core_train(cfg), privacy=cfg.privacy, attack=cfg.attack)
        for g, m in setup.models.items()
    }
    grouped = GroupedTrainer(trainers, setup.client_group, setup.initial)

    def finish(state: GlobalState) -> Exports:
        for g, m in setup.models.items():  # leave the group models at their initial cores
            apply_arrays(m, setup.initial[g], 1.0)
        weak = weak_model(setup, prep, state.arrays, c.fusion)
        weak_text, weak_data = weak_views(setup, prep, weak, cfg)
        weak_eval = {
            str(cid): ClientTrainer(weak, weak_data, cfg.train).evaluate(cid, {}, 1.0) for cid in sorted(weak_data)
        }
        adapter, scale, extra = elicitation(prep, cfg, setup, weak, weak_text)
        extra.update(
            {
                "weak_eval": weak_eval,
                "weak_mean_ppl": mean_ppl(weak_eval),
                "client_memory": client_memory(setup),
                "fusion": c.fusion,
                **client_fields(setup),
                "trained_layers": len(setup.trained),
                "server_text_blocks": int(setup.server_text.input_ids.shape[0]),
                "prefix_shared_with_backbone": setup.shared_prefix,
                "frozen_prefix_layers": setup.start,
                "round0": "compressed clients",
            }
        )
        return Exports(
            (adapter, scale),
            prep.backbone.source,
            {"weak_model_cores.safetensors": {k: v.clone() for k, v in state.arrays.items()}},
            extra,
        )

    return MethodRun(strategy, grouped, compressed_clients(prep), {}, False, finish, client_columns(setup))


IMPLEMENTATION = Implementation(
    build, check_model=lambda prep, cfg: prepare_compressed(prep, cfg) and None
)  # the fused cores M_l keep their shape: the fusion minus M_l is an update
