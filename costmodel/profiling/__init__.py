"""The profiling stage: measure real transformer blocks and collectives, write JSON Lines profiles.

Modules:
  * ``format``: the documented, versioned profile record format (pydantic only, no torch), read
    by ``costmodel.fit`` so that the service can fit an uploaded profile without torch;
  * ``blocks``: torch blocks (LLaMA-style 1D layer, STDiT-style spatial+temporal 2D layer, heads);
  * ``measure``: timing (warm-up, repeats, median and spread) and exact activation bytes;
  * ``sweep``: the compute/memory sweep over token counts, packings and checkpoint policies;
  * ``comm``: the all-to-all / all-reduce profiler run under ``torchrun``.

Importing this package does not import torch; only ``blocks``, ``measure``, ``sweep`` and
``comm`` do.
"""
