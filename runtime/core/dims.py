"""The model's dimensions: one frozen dataclass built from a Hugging Face config, validated."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.fields import Fields

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_hf_config(config: Any, source: str = "config.json") -> ModelDims:
        f = Fields(Path(source), config, "restore the original config.json of the checkpoint")
        archs = config.get("architectures") or []
        if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise RefusionError(
                f"{source}: architectures={archs!r} is not supported; refusion-trt exports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (ReFusion is Qwen3-based). "
                "Point the exporter at a ReFusion checkpoint directory."
            )
        for flag in ("attention_bias", "use_sliding_window"):
            if config.get(flag):
                raise RefusionError(f"{source}: {flag}=true is not supported by the ReFusion graphs; expected false.")
        rope_parameters = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
        rope_scaling = config.get("rope_scaling") or rope_parameters.get("rope_type")
        if rope_scaling not in (None, "default") and not (isinstance(rope_scaling, dict) and rope_scaling.get("rope_type") == "default"):
            raise RefusionError(f"{source}: rope scaling {rope_scaling!r} is not supported; expected plain RoPE.")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise RefusionError(f"{source}: hidden_act={act!r} is not supported; expected 'silu'.")

        def optional(key: str, default: Any, read: Any) -> Any:
            return read(key) if config.get(key) is not None else default

        hidden, heads = f.positive_int("hidden_size"), f.positive_int("num_attention_heads")
        if config.get("rope_theta") is not None:
            rope_theta = f.float("rope_theta", 0.0, low_open=True)
        elif rope_parameters.get("rope_theta") is not None:
            rope_theta = f.float("rope_parameters.rope_theta", 0.0, low_open=True)
        else:
            raise RefusionError(f"{source}: no rope_theta (nor rope_parameters.rope_theta); a Qwen3 config.json carries it.")
        dims = ModelDims(
            num_layers=f.positive_int("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            kv_heads=optional("num_key_value_heads", heads, f.positive_int),
            head_dim=optional("head_dim", hidden // heads, f.positive_int),
            intermediate_size=f.positive_int("intermediate_size"),
            vocab_size=f.positive_int("vocab_size"),
            rms_norm_eps=optional("rms_norm_eps", 1e-6, lambda k: f.float(k, 0.0, low_open=True)),
            rope_theta=rope_theta,
            tie_word_embeddings=optional("tie_word_embeddings", False, f.bool),
            max_position_embeddings=optional("max_position_embeddings", 40960, f.positive_int),
        )
        dims.validate(source)
        return dims

    @staticmethod
    def read(f: Fields, at: str) -> ModelDims:
        """The dims as refusion.json records them (the `model` section), every field type-checked."""
        dims = ModelDims(
            num_layers=f.positive_int(f"{at}.num_layers"),
            hidden_size=f.positive_int(f"{at}.hidden_size"),
            num_heads=f.positive_int(f"{at}.num_heads"),
            kv_heads=f.positive_int(f"{at}.kv_heads"),
            head_dim=f.positive_int(f"{at}.head_dim"),
            intermediate_size=f.positive_int(f"{at}.intermediate_size"),
            vocab_size=f.positive_int(f"{at}.vocab_size"),
            rms_norm_eps=f.float(f"{at}.rms_norm_eps", 0.0, low_open=True),
            rope_theta=f.float(f"{at}.rope_theta", 0.0, low_open=True),
            tie_word_embeddings=f.bool(f"{at}.tie_word_embeddings"),
            max_position_embeddings=f.positive_int(f"{at}.max_position_embeddings"),
        )
        try:
            dims.validate(f"{f.file}: field {at}")
        except RefusionError as e:  # the same rules as for a HF config, with the manifest's fix
            raise RefusionError(f"{e} {f.fix[0].upper()}{f.fix[1:]}.") from e
        return dims

    def validate(self, source: str) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "kv_heads", "head_dim", "intermediate_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise RefusionError(f"{source}: {name}={getattr(self, name)} must be positive.")
        if self.num_heads % self.kv_heads:
            raise RefusionError(
                f"{source}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.kv_heads}; grouped-query attention needs it to be."
            )
        if self.head_dim % 2:
            raise RefusionError(f"{source}: head_dim={self.head_dim} must be even for rotary embeddings.")


def expected_weights(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3ForCausalLM checkpoint must hold, with its shape."""
    h, d, q, kv, inter = dims.hidden_size, dims.head_dim, dims.q_size, dims.kv_size, dims.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (dims.vocab_size, h)}
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not dims.tie_word_embeddings:
        shapes["lm_head.weight"] = (dims.vocab_size, h)
    return shapes


def is_linear_weight(name: str) -> bool:
    """Linear weights are stored [in, out] so the graphs multiply without a Transpose."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"
