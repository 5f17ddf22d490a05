"""The input limits the service and the CLI share: one leaf module both read (no api -> cli -> api).

The service's settings may lower the batch and manifest limits (``DCP_MAX_SAMPLES_PER_BATCH``,
``DCP_MAX_MANIFEST_SAMPLES``); the CLI applies the defaults. Each check raises ``ValueError``
naming the value and the limit, so the CLI exits 2 and the API answers 422 with the same words.
"""

from __future__ import annotations

MAX_SAMPLES_PER_REQUEST = 16384
"""Hard cap on the samples of one batch: a plan request, an epoch step, ``dcp plan -b``."""
DEFAULT_MAX_SAMPLES_PER_BATCH = 4096
"""The service's default for one synchronous plan request (``Settings.max_samples_per_batch``)."""
MAX_MANIFEST_SAMPLES = 10_000_000
"""Most samples of one manifest: an epoch job's, ``dcp epoch``'s, ``dcp manifest --num-samples``."""
MAX_SAMPLE_TOKENS = 2**31 - 1
"""Longest sample accepted (tokens, or frames x height x width)."""
MAX_SAMPLE_DIM = 2**20
"""Largest frames, height or width of a 2D sample."""
MAX_ID_CHARS = 256
"""Longest id or name."""
MAX_SEED = 2**31 - 1
"""Largest seed (CP-SAT takes a 32-bit seed)."""


def check_batch_size(num_samples: int, *, name: str = "batch size",
                     limit: int = MAX_SAMPLES_PER_REQUEST) -> int:
    """``num_samples`` when it is within 1..``limit``.

    Raises:
        ValueError: naming ``name``, the value and the limit.
    """
    if not 1 <= num_samples <= limit:
        raise ValueError(f"{name} {num_samples:,} is outside 1..{limit:,} samples (the service's limit "
                         "for one batch)")
    return num_samples


def check_manifest_size(num_samples: int, *, name: str = "manifest",
                        limit: int = MAX_MANIFEST_SAMPLES) -> int:
    """``num_samples`` when it is within 1..``limit``.

    Raises:
        ValueError: naming ``name``, the value and the limit.
    """
    if not 1 <= num_samples <= limit:
        raise ValueError(f"{name} {num_samples:,} samples is outside 1..{limit:,} (the service's limit "
                         "for one manifest)")
    return num_samples
