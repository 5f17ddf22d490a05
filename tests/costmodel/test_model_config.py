"""Model specs from transformers / diffusers ``config.json`` files: the shipped example configs
give their presets, the field names are the real libraries', bad configs are refused by name."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from costmodel.model_choice import check_samples_kind, select_model
from costmodel.model_config import known_architectures, model_spec_from_config
from costmodel.presets import load_model
from costmodel.specs import Sample

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
NAMES = ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen3-8b", "wan2.1-1.3b", "wan2.1-14b",
         "hunyuanvideo-13b"]
TEXT = [n for n in NAMES if not n.startswith(("wan", "hunyuan"))]


def _config(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / name / "config.json").read_text())
    return data


@pytest.mark.parametrize("name", NAMES)
def test_example_config_gives_its_preset(name: str) -> None:
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(NAMES)
    spec = model_spec_from_config(CONFIGS / name / "config.json")
    assert spec == load_model(name)
    # The folder, and the parsed object with a name, give the same spec.
    assert model_spec_from_config(CONFIGS / name) == spec
    assert model_spec_from_config(_config(name), name=name) == spec


def test_public_shapes_of_the_presets() -> None:
    llama = load_model("llama-3.1-8b")
    assert (llama.kv_heads, llama.head_size, llama.ffn_hidden, llama.vocab) == (8, 128, 14336, 128256)
    assert llama.allowed_group_sizes(max_size=64) == [1, 2, 4, 8, 16, 32]
    qwen = load_model("qwen2.5-7b")  # 28 query heads over 4 KV heads: 7, 14 neither divide nor multiply 4
    assert qwen.allowed_group_sizes(max_size=64) == [1, 2, 4, 28]
    wan = load_model("wan2.1-14b")
    assert (wan.kind, wan.hidden, wan.num_heads, wan.cross_attention_tokens, wan.causal) == ("3d", 5120, 40, 512, False)
    assert (wan.patch_size, wan.vae_stride, wan.latent_channels, wan.mlp_kind) == ((1, 2, 2), (4, 8, 8), 16, "gelu")
    hunyuan = load_model("hunyuanvideo-13b")
    assert (hunyuan.num_layers, hunyuan.hidden, hunyuan.ffn_hidden) == (60, 3072, 12288)
    assert (hunyuan.joint_attention_tokens, hunyuan.cross_attention_tokens) == (256, 0)


@pytest.mark.parametrize("name", TEXT)
def test_text_configs_read_by_transformers_agree(name: str) -> None:
    """transformers itself reads the example config (from the folder, nothing downloaded) and
    finds the same layers, heads, KV heads, head size, MLP and vocabulary."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(CONFIGS / name))
    spec = load_model(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim, config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (
        spec.num_layers, spec.hidden, spec.num_heads, spec.kv_heads, spec.head_size, spec.ffn_hidden, spec.vocab,
        spec.tied_embeddings)


@pytest.mark.parametrize("name", ["wan2.1-1.3b", "wan2.1-14b", "hunyuanvideo-13b"])
def test_video_config_fields_are_the_diffusers_class_arguments(name: str) -> None:
    """Every field of the example diffusers config is an argument of the real class."""
    diffusers = pytest.importorskip("diffusers")
    data = _config(name)
    cls = getattr(diffusers, data["_class_name"])
    params = set(inspect.signature(cls.__init__).parameters)
    assert set(data) - {"_class_name"} <= params, set(data) - params


def test_tiny_wan_built_by_diffusers_has_the_spec_shape() -> None:
    """A tiny Wan config: diffusers builds the model from it, and its block count, heads and MLP
    width are what the spec says."""
    diffusers = pytest.importorskip("diffusers")
    data = {**_config("wan2.1-1.3b"), "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8,
            "ffn_dim": 24, "text_dim": 16, "freq_dim": 8}
    spec = model_spec_from_config(data, name="tiny-wan")
    model = diffusers.WanTransformer3DModel.from_config({k: v for k, v in data.items() if k != "_class_name"})
    assert len(model.blocks) == spec.num_layers
    block = model.blocks[0]
    assert block.attn1.heads == spec.num_heads
    assert block.attn1.to_q.out_features == spec.hidden
    linears = [m for m in block.ffn.modules() if m.__class__.__name__ == "Linear"]
    assert linears[0].out_features == spec.ffn_hidden


def test_defaults_and_normalisation() -> None:
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    spec = model_spec_from_config(base)
    assert (spec.name, spec.kv_heads, spec.num_kv_heads, spec.head_dim, spec.tied_embeddings) == (
        "llama-2l-64", 4, None, None, False)
    # head_dim equal to hidden // heads is stored as the default; another one is kept.
    assert model_spec_from_config({**base, "head_dim": 16}).head_dim is None
    odd = model_spec_from_config({**base, "head_dim": 32, "_name_or_path": "org/My Model"})
    assert (odd.head_dim, odd.head_size, odd.name) == (32, 32, "My-Model")
    assert model_spec_from_config({**base, "tie_word_embeddings": True}).tied_embeddings
    # architectures alone is enough.
    by_arch = {k: v for k, v in base.items() if k != "model_type"} | {"architectures": ["MistralForCausalLM"]}
    assert model_spec_from_config(by_arch).name == "mistral-2l-64"
    # A Qwen2 window that is switched off is fine.
    qwen = {**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert model_spec_from_config(qwen).kind == "1d"


def test_wan_image_conditioned_adds_image_tokens(tmp_path: Path) -> None:
    folder = tmp_path / "Wan2.1-I2V" / "transformer"
    folder.mkdir(parents=True)
    data = {**_config("wan2.1-14b"), "image_dim": 1280, "added_kv_proj_dim": 5120, "in_channels": 36}
    (folder / "config.json").write_text(json.dumps(data))
    spec = model_spec_from_config(tmp_path / "Wan2.1-I2V")  # the pipeline folder
    assert (spec.name, spec.cross_attention_tokens, spec.latent_channels) == ("Wan2.1-I2V", 512 + 257, 16)


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "deepseek_v3"}, "unknown architecture model_type='deepseek_v3'; known: llama, qwen2"),
    ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, "unknown architecture architectures="),
    ({"num_key_value_heads": 6}, "num_attention_heads=32 is not divisible by num_key_value_heads=6"),
    ({"hidden_size": 4100}, "hidden_size=4100 is not divisible by num_attention_heads=32"),
    ({"intermediate_size": None}, "missing field 'intermediate_size'"),
    ({"num_hidden_layers": "32"}, "field 'num_hidden_layers' must be a positive integer, got '32'"),
    ({"num_hidden_layers": True}, "field 'num_hidden_layers' must be a positive integer, got True"),
    ({"tie_word_embeddings": "no"}, "field 'tie_word_embeddings' must be true or false"),
    ({"model_type": "mistral", "sliding_window": 0}, "field 'sliding_window' must be a positive integer, got 0"),
    ({"model_type": "gpt_oss", "layer_types": ["full_attention"] * 31},
     "field 'layer_types' has 31 entries but num_hidden_layers=32"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 6},
     "field 'num_experts_per_tok'=6 is above num_local_experts=4"),
])
def test_bad_text_config_names_file_and_field(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    data = {k: v for k, v in {**_config("llama-3.1-8b"), **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="^" + str(path).replace(".", r"\.")) as info:
        model_spec_from_config(path)
    assert message in str(info.value)


@pytest.mark.parametrize(("change", "message"), [
    ({"_class_name": "LatteTransformer3DModel"}, "unknown architecture _class_name='LatteTransformer3DModel'"),
    ({"patch_size": [1, 2]}, "field 'patch_size' must be three positive integers"),
    ({"ffn_dim": 0}, "field 'ffn_dim' must be a positive integer, got 0"),
    ({"attention_head_dim": None}, "missing field 'attention_head_dim'"),
])
def test_bad_video_config_names_field(change: dict[str, Any], message: str) -> None:
    data = {k: v for k, v in {**_config("wan2.1-14b"), **change}.items() if v is not None}
    with pytest.raises(ValueError, match="^model_config: ") as info:
        model_spec_from_config(data)
    assert message in str(info.value)
    assert "WanTransformer3DModel" in str(info.value) or "unknown" not in message


def test_unreadable_configs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing.json: cannot read the model config"):
        model_spec_from_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"model_type": "llama",\n oops}')
    with pytest.raises(ValueError, match=r"bad.json: not JSON \(line 2"):
        model_spec_from_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json: a model config is a JSON object, got list"):
        model_spec_from_config(tmp_path / "list.json")
    with pytest.raises(ValueError, match="no 'model_type', 'architectures' or '_class_name'"):
        model_spec_from_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="a folder without config.json"):
        model_spec_from_config(tmp_path)
    assert "HunyuanVideoTransformer3DModel" in known_architectures()


def test_select_model_exactly_one() -> None:
    assert select_model(model=None, model_config=None) is None
    assert select_model(model="wan2.1-14b", model_config=None) == load_model("wan2.1-14b")
    config = CONFIGS / "llama-3.1-8b" / "config.json"
    assert select_model(model=None, model_config=config) == load_model("llama-3.1-8b")
    with pytest.raises(ValueError, match="give one of --model and --model-config, not both"):
        select_model(model="llama-7b", model_config=config)
    with pytest.raises(ValueError, match="model: unknown model preset 'llama-9b'"):
        select_model(model="llama-9b", model_config=None, model_option="model")
    with pytest.raises(ValueError, match="^model_config: missing field 'vocab_size'"):
        select_model(model=None, model_config={"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
                                               "num_attention_heads": 2, "intermediate_size": 8},
                     config_option="model_config")


def test_samples_of_the_wrong_kind_are_named() -> None:
    text = [Sample(id="a", tokens=10), Sample(id="b", tokens=20)]
    video = [Sample(id="v0", frames=2, height=3, width=4, tokens=24),
             Sample(id="v1", frames=1, height=2, width=2, tokens=4)]
    check_samples_kind(text, load_model("llama-3.1-8b"))
    check_samples_kind(video, load_model("wan2.1-14b"))
    check_samples_kind(video, load_model("stdit3-xl"))
    with pytest.raises(ValueError, match=r"^MANIFEST m.jsonl: sample 'v1' \(#1\) is a video sample \(1x2x2 "
                                         r".*model 'llama-3.1-8b' is kind '1d'"):
        check_samples_kind([text[0], video[1]], load_model("llama-3.1-8b"), source="MANIFEST m.jsonl")
    with pytest.raises(ValueError, match=r"sample 'a' \(#0\) is a text sample \(10 tokens.*kind '3d'"):
        check_samples_kind(text, load_model("wan2.1-14b"))
