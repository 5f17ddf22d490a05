"""The executor: the runtime in each training rank that runs DCP plans.

Imports only the plan schema (``planner.plan``, ``costmodel.specs``), torch, httpx and the
standard library -- never the solver or the web framework.

- ``client``: ``PlannerClient`` (retry with backoff until a deadline) and ``PlanPrefetcher``
  (next K steps in the background, optional injected local fallback).
- ``groups``: ``GroupRegistry``, every SP process group created once at start-up.
- ``consistency``: digest agreement before each step (``PlanMismatchError`` on every rank).
- ``layout`` / ``ulysses`` / ``attention``: per-sample sharding, the differentiable all-to-all
  and sample-bounded 1D causal and 2D spatial/temporal attention.
- ``checkpointing``: per-sample checkpoint policy ``k`` of ``L`` layers (non-reentrant).
- ``runtime``: ``Executor`` (begin_step, micro_batches with loss weights, sync_gradients).
- ``models``: ``Llama1D`` and ``STDiT2D`` reference models; ``data``: ``PlanBatchSampler``,
  ``SyntheticDataset``; ``memory``: ``ActivationMeter``.
"""
