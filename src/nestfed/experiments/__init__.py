"""Recipes: prepare an experiment once, run methods on it into run directories, compare them.

- `nestfed.experiments.prepare`: backbone, LoRA layers, client data (once per experiment).
- `nestfed.experiments.run`: one method, embedded, into its run directory.
- `nestfed.experiments.report`: finished runs side by side (tables and a plot).
- `nestfed.experiments.compressed_comparison`: FedSLM against FedMKT, FedAvg and HetLoRA.
"""
