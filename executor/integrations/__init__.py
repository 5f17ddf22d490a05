"""Adapters that run third-party models under DCP plans, one module per library.

- ``hf_transformers``: Hugging Face ``transformers`` causal LMs through the library's attention
  plugin (``AttentionInterface``), plus per-sample checkpoint policies on the decoder layers.
- ``hf_diffusers``: the ``diffusers`` Latte video transformer through attention processors
  (spatial and temporal Ulysses self-attention, per-sample cross-attention) and a forward over
  the rank's tokens that calls the model's own modules.

Each needs its library (``pip install 'dcp-planner[hf]'``); importing this package does not.
"""
