"""The memory's capability tests must fail when the memory is cut out: each of three faults is
injected (the read disconnected from the output, the read's queries replaced by random ones, the
gate held at issue 24's 0.05) and both training tests of tests/nn/test_memory_capability.py are
run under it; every one must fail, at the assertion named. Prints one JSON object.

    .venv/bin/python bench/fednl_capability_faults.py --json bench/results/fednl_capability_faults.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def faults(M, T, normalize):
    """{name: (install, restore)} of the injected faults (MemoryRule's methods, the test's settings)."""
    mix, inputs, settings = M.MemoryRule.mix, M.MemoryRule.inputs, T.MemorySettings

    def random_queries(self, q, k, v, valid=None, state=None):
        q_lin, k_lin, v_lin = inputs(self, q, k, v, valid, state)
        return normalize(torch.randn_like(q_lin), dim=-1), k_lin, v_lin

    def restore():
        M.MemoryRule.mix, M.MemoryRule.inputs, T.MemorySettings = mix, inputs, settings

    return {
        "the read disconnected from the output": lambda: setattr(M.MemoryRule, "mix", lambda self, *a: a[4]),
        "the read's queries random": lambda: setattr(M.MemoryRule, "inputs", random_queries),
        "the gate held at 0.05": lambda: setattr(
            T, "MemorySettings", lambda **kw: settings(**{**kw, "gate": "constant", "alpha_init": 0.05})
        ),
    }, restore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests" / "nn"), str(ROOT / "tests")]
    torch.set_num_threads(1)
    import test_memory_capability as T
    from torch.nn.functional import normalize

    from nestfed.data.mqar import vocabularies
    from nestfed.experiments.mqar_training import MqarTask
    from nestfed.nn import memory as M
    from nestfed.nn.backbone import byte_tokenizer

    (vocab,), fillers = vocabularies(byte_tokenizer(), 1, 32, 32)
    task = MqarTask(vocab, fillers)
    tests = (
        T.test_a_memory_trained_from_scratch_recalls_past_the_window,
        T.test_lora_and_memory_on_a_frozen_backbone_reach_full_attention,
    )
    installs, restore = faults(M, T, normalize)
    res = {"bench": "fednl_capability_faults", "results": []}
    for name, install in installs.items():
        install()
        for test in tests:
            try:
                test(task)
                outcome = "passed: the fault went unnoticed"
            except AssertionError:
                line = [ln.strip() for ln in traceback.format_exc().splitlines() if ln.strip().startswith("assert")]
                outcome = f"failed at: {line[-1] if line else '?'}"
            res["results"].append({"fault": name, "test": test.__name__, "outcome": outcome})
            print(json.dumps(res["results"][-1]), flush=True)
        restore()
    res["all_caught"] = all(r["outcome"].startswith("failed") for r in res["results"])
    print(json.dumps({"all_caught": res["all_caught"]}))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
