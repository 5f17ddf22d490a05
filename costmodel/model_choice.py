"""Which model a request plans for (a preset name or a config, exactly one) and whether its
samples are of the model's kind (text samples for a text model, videos for a video model)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from costmodel.model_config import model_spec_from_config
from costmodel.presets import load_model
from costmodel.specs import ModelSpec, Sample


def select_model(*, model: str | None, model_config: str | Path | Mapping[str, Any] | None,
                 model_option: str = "--model", config_option: str = "--model-config") -> ModelSpec | None:
    """The model named by a preset or a config, or None when neither is given.

    Args:
        model: A model preset name.
        model_config: A transformers / diffusers ``config.json`` (path or parsed object).
        model_option: How errors name the preset option (``--model`` or ``model``).
        config_option: How errors name the config option (``--model-config`` or ``model_config``).

    Raises:
        ValueError: when both are given, for an unknown preset, or a bad config (naming it).
    """
    if model is not None and model_config is not None:
        raise ValueError(f"give one of {model_option} and {config_option}, not both "
                         f"({model_option} {model!r})")
    if model is not None:
        try:
            return load_model(model)
        except ValueError as exc:
            raise ValueError(f"{model_option}: {exc}") from None
    if model_config is not None:
        source = None if isinstance(model_config, str | Path) else config_option
        return model_spec_from_config(model_config, source=source)
    return None


KIND_WORDS = {"1d": "a text decoder", "2d": "a 2D video DiT: spatial + temporal attention",
              "3d": "a 3D video DiT: full attention over frames x height x width"}
"""What each model kind is, for messages."""


def _describe(sample: Sample) -> str:
    if sample.is_2d:
        return f"a video sample ({sample.frames}x{sample.height}x{sample.width} frames x height x width)"
    return f"a text sample ({sample.tokens} tokens, no frames, height and width)"


def check_samples_kind(samples: Iterable[Sample], model: ModelSpec, *, source: str = "") -> None:
    """Refuse samples of the other kind than the model's: video samples (frames, height, width)
    under a text model (kind ``1d``) or text samples under a video model (``2d``, ``3d``).

    Args:
        samples: The samples (a manifest or a batch), in order.
        model: The model they are planned for.
        source: What holds them, for the message (``MANIFEST x.jsonl``, ``samples``).

    Raises:
        ValueError: naming the first offending sample, its position and the model's kind.
    """
    for index, sample in enumerate(samples):
        if sample.is_2d != model.is_video:
            want = "video samples (frames, height, width)" if model.is_video else "text samples (tokens)"
            where = f"{source}: " if source else ""
            raise ValueError(f"{where}sample {sample.id!r} (#{index}) is {_describe(sample)} but model "
                             f"{model.name!r} is kind {model.kind!r} ({KIND_WORDS[model.kind]}) and plans "
                             f"{want}; name a "
                             f"{'text' if sample.is_2d else 'video'} model or use a matching manifest")


def with_loss_chunk(model: ModelSpec, loss_chunk_tokens: int | None, *, max_sample_tokens: int | None = None,
                    option: str = "loss_chunk_tokens") -> ModelSpec:
    """``model`` with its ``loss_chunk_tokens`` set (unchanged when None).

    Args:
        model: The model planned for.
        loss_chunk_tokens: Tokens per chunk of the LM loss, 0 for whole logits, None to keep the model's.
        max_sample_tokens: The longest sample planned, when known: a chunk longer than it never
            chunks anything and charges more bytes than the loss holds, so it is refused.
        option: How errors name the option (``--loss-chunk-tokens`` or ``loss_chunk_tokens``).

    Raises:
        ValueError: for a negative chunk, a chunk longer than the longest sample, or a chunk for a
            video model (which has no LM loss), naming ``option`` and the value.
    """
    if loss_chunk_tokens is None:
        return model
    if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 0:
        raise ValueError(f"{option}={loss_chunk_tokens!r} must be a positive number of tokens "
                         "(or 0 for whole logits)")
    if model.is_video:
        raise ValueError(f"{option}={loss_chunk_tokens}: model {model.name!r} is kind {model.kind!r} "
                         "(a video model, no vocabulary): the LM loss chunk is for text models")
    if max_sample_tokens is not None and loss_chunk_tokens > max_sample_tokens:
        raise ValueError(f"{option}={loss_chunk_tokens} is larger than the longest sample "
                         f"({max_sample_tokens} tokens): give a chunk of at most that many tokens, "
                         "or 0 for whole logits")
    return model.model_copy(update={"loss_chunk_tokens": loss_chunk_tokens})
