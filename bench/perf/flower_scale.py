"""Flower's simulation engine with many virtual clients: memory bounded by the Ray actors (the CPUs),
not by the population; no client dropped; the embedded runner's adapter bit for bit (issue 22).

The experiment: the tiny random Llama on real BBC News, ``--clients`` virtual SuperNodes (default
100), IID over blocks, ranks drawn 50/25/25% at 2/4/8, ``federation.fraction`` 0.1, 2 rounds of
PreLort, one torch thread, one CPU per client (Ray runs as many actors as the machine has CPUs).
Measured: the run's wall time, the QUERY round's time (``query_s`` of metrics.jsonl's round 0),
the peak over the run of the resident memory of every process the SuperLink started (sampled
every 0.5 s; psutil) and the machine's used memory above what it was before, the processes alive at
the peak, the dropped clients, and whether the final adapter equals the embedded runner's. Prints
one JSON object (and writes it with ``--out``).

    .venv/bin/python bench/perf/flower_scale.py [--clients 100] [--out bench/results/flower_scale.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from nestfed import methods
from nestfed.experiments.prepare import prepare
from nestfed.experiments.run import run_method
from nestfed.testing.flower_deployment import LocalDeployment

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
APP_DIR = ROOT / "flower_app"


def embedded_run(run_dir: Path, overrides) -> Path:
    """The embedded runner on the same experiment, into ``run_dir`` (returned): the reference whose
    final adapter the simulation must equal bit for bit."""
    cfg = methods.load_config(TINY, list(overrides))
    run_method(prepare(cfg), cfg, run_dir)
    return run_dir


def adapter_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final PEFT adapter's tensors of a run directory, by PEFT key."""
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


class TreeMemory:
    """The peak, sampled every ``period`` s, of the summed RSS of ``root`` and its descendants, and of
    the machine's used memory."""

    def __init__(self, root: int, period: float = 0.5):
        self.root, self.period = root, period
        self.peak = self.peak_used = 0
        self.procs_at_peak = 0
        self.base_used = psutil.virtual_memory().used
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [psutil.Process(self.root)] + psutil.Process(self.root).children(recursive=True)
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        continue
                if total > self.peak:
                    self.peak, self.procs_at_peak = total, len(procs)
            except psutil.Error:
                pass
            self.peak_used = max(self.peak_used, psutil.virtual_memory().used)
            time.sleep(self.period)

    def __enter__(self) -> TreeMemory:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    k = args.clients
    overrides = (
        f"data.num_clients={k}",
        "data.partition=iid",
        "data.unit=block",
        "lora.ranks=[2]",
        "population.rank_shares={2=0.5,4=0.25,8=0.25}",
        "federation.fraction=0.1",
        "strategy.name=prelort",
        "federation.rounds=2",
        "train.threads=1",
        "output.plots=false",
        "train.client_cache=off",
        "evaluation.clients=0",
        "output.client_detail=inline",
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        reference = embedded_run(tmp / "embedded", overrides)
        embedded_s = time.perf_counter() - t0
        run_dir = tmp / "sim"
        with LocalDeployment(tmp / "flower", simulation=True) as d:
            link = d.start_superlink()
            t0 = time.perf_counter()
            with TreeMemory(link.popen.pid) as mem:
                run_id = d.submit(
                    APP_DIR,
                    {
                        "experiment": str(TINY),
                        "overrides": ";".join(overrides),
                        "run-dir": str(run_dir),
                        "connect-timeout-s": 900.0,
                        "round-timeout-s": 900.0,
                    },
                    {"num-supernodes": k, "client-resources-num-cpus": 1, "client-resources-num-gpus": 0.0},
                )
                status = d.wait_run(run_id, 1800)
            wall = time.perf_counter() - t0
            workers = len(list(d.worker_dir.iterdir()))
        lines = (
            [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if run_dir.exists() else []
        )
        a, b = adapter_tensors(reference), adapter_tensors(run_dir) if (run_dir / "adapter").exists() else {}
        same = sorted(a) == sorted(b) and all(a[key].shape == b[key].shape and (a[key] == b[key]).all() for key in a)
    out = {
        "bench": "flower_scale",
        "clients": k,
        "status": status["status"],
        "wall_s": round(wall, 1),
        "embedded_s": round(embedded_s, 1),
        "query_s": round(lines[0].get("query_s", float("nan")), 1) if lines else None,
        "nodes_answered": len(lines[0].get("nodes", {})) if lines else 0,
        "dropped": sum(len(ln.get("dropped", {})) for ln in lines[1:]),
        "sampled": [len(ln.get("sampled", [])) for ln in lines[1:]],
        "peak_tree_rss_mb": round(mem.peak / 2**20),
        "processes_at_peak": mem.procs_at_peak,
        "peak_used_above_start_mb": round((mem.peak_used - mem.base_used) / 2**20),
        "worker_sockets": workers,
        "same_adapter_as_embedded": bool(same),
        "cpus": psutil.cpu_count(),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
