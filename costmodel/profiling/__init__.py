"""The profiling stage: measure real transformer blocks and collectives, write JSON Lines profiles.

Modules:
  * ``format``: the documented, versioned profile record format (pydantic only, no torch), read
    by ``costmodel.fit`` so that the service can fit an uploaded profile without torch;
  * ``real_classes``: the models' own layer classes (transformers Llama / Qwen2 / Qwen3 / Mistral
    decoder layers, diffusers Wan and HunyuanVideo blocks) built from a ``config.json``;
  * ``module_count``: what a stack of any ``nn.Module`` blocks saves for backward (exact, unique
    storages), its live and peak bytes and time, per checkpoint policy and token count;
  * ``coefficients``: counts every family's classes and fits the activation-bytes table
    (``costmodel/presets/activation_bytes.json``);
  * ``real_layers``: the sweep's layers from a config's own class (``dcp profile --model-config``);
  * ``blocks``: look-alike torch blocks (LLaMA-style 1D layer, STDiT-style spatial+temporal 2D
    layer, DiT 3D block, heads): profiled for the presets, and as the fallback of a config whose
    class cannot be imported;
  * ``measure``: timing (warm-up, repeats, median and spread) and exact activation bytes;
  * ``sweep``: the compute/memory sweep over token counts, packings and checkpoint policies;
  * ``comm``: the all-to-all / all-reduce profiler run under ``torchrun``.

Importing this package does not import torch; its torch modules (all but ``format``) do.
"""
