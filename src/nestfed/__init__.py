"""nestfed: federated fine-tuning of LLMs under data and resource heterogeneity."""

__version__ = "0.1.0"
