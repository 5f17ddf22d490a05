"""Adapters that run third-party models under DCP plans, one module per library.

- ``hf_transformers``: Hugging Face ``transformers`` causal LMs through the library's attention
  plugin (``AttentionInterface``), plus per-sample checkpoint policies on the decoder layers.

Each needs its library (``pip install 'dcp-planner[hf]'``); importing this package does not.
"""
