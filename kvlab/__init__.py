"""kvlab: KV-cache compression for Llama-family LLMs, in plain PyTorch.

Data flow: config (YAML + flags) -> `config.CacheSpec` -> `build.build_caches` (one cache per layer,
layer budgets planned per prompt) -> `engine.generate`. The model is `model.py`; what a strategy is,
`cache.py`; each score, `scores.py`; the registry, `strategies.py`.
"""

__version__ = "0.2.0"
