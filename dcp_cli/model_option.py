"""``--model NAME`` and ``--model-config PATH``: the model a command plans, costs or profiles.

One of the two (or neither, for the command's default): a preset (``dcp presets models``) or a
transformers / diffusers ``config.json`` (``costmodel.model_config``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from costmodel.model_choice import select_model
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
    try:
        spec = select_model(model=model, model_config=model_config)
        if spec is None and default is not None:
            spec = select_model(model=default, model_config=None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return spec
