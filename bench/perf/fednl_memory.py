"""Peak inference memory of streaming on SmolLM2-135M: FedNL (delta-rule memory on every layer,
softmax window bounded) against the backbone's plain attention (Hugging Face's KV cache, growing).

Each (method, length) runs in its own fresh Python process, so the peaks do not mix: the
process loads SmolLM2 (fp32), reads real text (Austen's novels, else gensim's Wikipedia),
then streams ``length`` tokens in chunks with torch.no_grad() and reports:

- ``base_rss_mib``: resident memory after loading (every weight page touched), before the
  stream (MiB);
- ``peak_rss_mib``: the highest resident memory seen while streaming (a thread samples
  /proc/self/status every 2 ms) -- what the inference needs in all, weights included;
- ``increment_mib`` = peak - base: the stream's own working set;
- ``state_mib``: the state carried between chunks after the last one (KV caches, memory S);
- ``time_s`` and the stream's mean next-token CE (nats), as a sanity check.

Acceptance (FedNL issue, section 3): FedNL's peak at 16K over its peak at 1K is at most 1.1.

    .venv/bin/python bench/perf/fednl_memory.py                 # 1K, 4K, 16K; about 10 minutes on 1 core
    .venv/bin/python bench/perf/fednl_memory.py --lengths 1024 4096 --chunk 256 --window 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path


def rss_mib() -> float:
    """Current resident set size of this process (MiB), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakSampler:
    """Samples the RSS every ``period_s`` in a thread; ``peak`` is the highest value seen (MiB)."""

    def __init__(self, period_s: float = 0.002):
        self.period_s, self.peak, self._stop = period_s, rss_mib(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(self.period_s)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mib())


def text_ids(tokenizer, n: int):
    """The first n tokens of real long text: Austen's novels (janeaustenr), else Wikipedia."""
    import torch

    from nestfed.data import corpora
    from nestfed.errors import DataError

    try:
        docs = corpora.austen_novels()
    except DataError:
        docs = corpora.wikipedia_articles(min_chars=50_000)
    ids: list[int] = []
    for d in docs:
        ids += tokenizer(d.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            break
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of long text, need {n}")
    return torch.tensor([ids[:n]]), docs[0].source


def one(method: str, length: int, chunk: int, window: int, threads: int) -> dict:
    """Measure one stream in this process (see the module docstring)."""
    import torch

    torch.set_num_threads(threads)
    from nestfed.config import ModelConfig
    from nestfed.evaluation.streaming import StreamStats, stream_nll, stream_nll_hf
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.memory import MemorySettings, install_memory, set_memory_enabled

    bb = load_backbone(ModelConfig(name="smollm2-135m"))
    ids, corpus = text_ids(bb.tokenizer, length)
    model = bb.model
    if method == "fednl":
        install_memory(model, MemorySettings(gate="learned", alpha_init=0.05, window=window))
        set_memory_enabled(model, True)
    import gc

    with torch.no_grad():  # fault in every weight page (safetensors maps them lazily) before the baseline
        for p in model.parameters():
            p.sum()
    gc.collect()
    base = rss_mib()
    stats = StreamStats()
    t0 = time.perf_counter()
    with PeakSampler() as s:
        if method == "fednl":
            nll = stream_nll(model, ids, chunk=chunk, mode="memory", window=window, stats=stats)
        else:
            nll = stream_nll_hf(model, ids, chunk=chunk, stats=stats)
    return {
        "method": method,
        "tokens": length,
        "chunk": chunk,
        "window": window if method == "fednl" else None,
        "text": corpus,
        "base_rss_mib": round(base, 1),
        "peak_rss_mib": round(s.peak, 1),
        "increment_mib": round(s.peak - base, 1),
        "state_mib": round(stats.state_bytes[-1] / 2**20, 2),
        "time_s": round(time.perf_counter() - t0, 1),
        "mean_ce_nats": round(float(nll.mean()), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--methods", nargs="+", default=["fednl", "attention"])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "results" / "fednl_memory.json"))
    ap.add_argument("--one", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), a.chunk, a.window, a.threads)))
        return
    rows = []
    for method in a.methods:
        for n in a.lengths:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                method,
                str(n),
                "--chunk",
                str(a.chunk),
                "--window",
                str(a.window),
                "--threads",
                str(a.threads),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                rows.append({"method": method, "tokens": n, "error": out.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    res = {
        "bench": "fednl_memory",
        "model": "SmolLM2-135M-Instruct fp32",
        "host": platform.node(),
        "cpu_threads": a.threads,
        "rows": rows,
    }
    for method in a.methods:
        by_n = {r["tokens"]: r for r in rows if r["method"] == method and "peak_rss_mib" in r}
        lo, hi = min(a.lengths), max(a.lengths)
        if lo in by_n and hi in by_n:
            res[f"{method}_peak_ratio_{hi}_over_{lo}"] = round(by_n[hi]["peak_rss_mib"] / by_n[lo]["peak_rss_mib"], 3)
            res[f"{method}_increment_ratio_{hi}_over_{lo}"] = round(
                by_n[hi]["increment_mib"] / max(by_n[lo]["increment_mib"], 1e-9), 3
            )
    res["target"] = "fednl peak ratio 16K/1K <= 1.1"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
