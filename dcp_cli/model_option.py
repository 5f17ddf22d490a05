"""``--model NAME`` and ``--model-config PATH``: the model a command plans, costs or profiles.

One of the two (or neither, for the command's default): a preset (``dcp presets models``) or a
transformers / diffusers ``config.json`` (``costmodel.model_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from costmodel.specs import ModelSpec

MODEL_HELP = "Model preset (dcp presets models)."
CONFIG_HELP = ("A transformers (Llama, Qwen2/3, Mistral) or diffusers (Wan, HunyuanVideo) config.json "
               "instead of --model (or its model folder).")


def model_option(default: str | None = None, *, help_text: str = MODEL_HELP) -> str | None:
    """The ``--model`` option (a typer default)."""
    result: str | None = typer.Option(default, "--model", help=help_text)
    return result


def model_config_option() -> Path | None:
    """The ``--model-config`` option (a typer default)."""
    result: Path | None = typer.Option(None, "--model-config", exists=True, help=CONFIG_HELP)
    return result


def resolve_model(model: str | None, model_config: Path | None, *, default: str | None = None) -> ModelSpec | None:
    """The model the options name, else the ``default`` preset (None without one).

    Raises:
        typer.BadParameter: both given, an unknown preset, or a bad config (naming the field).
    """
    from costmodel.model_choice import select_model

    try:
        spec = select_model(model=model, model_config=model_config)
        if spec is None and default is not None:
            spec = select_model(model=default, model_config=None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return spec


LOSS_CHUNK_HELP = ("Tokens per chunk of the LM loss (text models; default: the model's, "
                   "4096): a rank never holds more logits than this; 0 holds whole logits.")


def loss_chunk_option() -> int | None:
    """The ``--loss-chunk-tokens`` option (a typer default)."""
    result: int | None = typer.Option(None, "--loss-chunk-tokens", help=LOSS_CHUNK_HELP)
    return result


def apply_loss_chunk(spec: ModelSpec, loss_chunk_tokens: int | None, *,
                     max_sample_tokens: int | None = None) -> ModelSpec:
    """``spec`` with ``--loss-chunk-tokens`` applied (``costmodel.model_choice.with_loss_chunk``).

    Raises:
        typer.BadParameter: naming the option and the value.
    """
    from costmodel.model_choice import with_loss_chunk

    try:
        return with_loss_chunk(spec, loss_chunk_tokens, max_sample_tokens=max_sample_tokens,
                               option="--loss-chunk-tokens")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
