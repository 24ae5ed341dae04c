"""Architecture hyper-parameters of a decoder model, read from / written to HF `config.json`."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x RoPE frequency scaling (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        _require(self.factor > 0, "rope_scaling.factor", f"must be > 0, got {self.factor}")
        _require(self.low_freq_factor > 0, "rope_scaling.low_freq_factor",
                 f"must be > 0, got {self.low_freq_factor}")
        _require(self.high_freq_factor > self.low_freq_factor, "rope_scaling.high_freq_factor",
                 f"must be > low_freq_factor={self.low_freq_factor}, got {self.high_freq_factor}")
        _require(self.original_max_position_embeddings > 0,
                 "rope_scaling.original_max_position_embeddings",
                 f"must be > 0, got {self.original_max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters for the Llama 3.x / Qwen2 / Qwen3 families.

    The families differ only in flags: Qwen2 has q/k/v biases (`attention_bias`), Qwen3 has
    RMSNorm over `head_dim` on queries and keys before RoPE (`qk_norm`), Llama 3.x may use
    `rope_scaling`. `o_proj_bias` and `mlp_bias` exist for HF configs that set
    `attention_bias` (llama/qwen3: all four projections) or `mlp_bias` (llama).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        _require(self.model_type in SUPPORTED_MODEL_TYPES, "model_type",
                 f"unsupported {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name,
                     f"must be a positive int, got {value!r}")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
                 "rope_scaling", f"must be a RopeScaling or None, got {self.rope_scaling!r}")
        _require(isinstance(self.eos_token_ids, tuple), "eos_token_ids",
                 f"must be a tuple of ints, got {self.eos_token_ids!r}")
        # What each family's HF implementation can express (so export round-trips).
        if self.model_type == "qwen2":
            _require(self.attention_bias and not self.o_proj_bias, "attention_bias",
                     "qwen2 has q/k/v biases and no o_proj bias "
                     "(attention_bias=True, o_proj_bias=False)")
        else:
            _require(self.o_proj_bias == self.attention_bias, "o_proj_bias",
                     f"{self.model_type} biases all four attention projections or none; "
                     f"got attention_bias={self.attention_bias}, o_proj_bias={self.o_proj_bias}")
        _require(self.qk_norm == (self.model_type == "qwen3"), "qk_norm",
                 f"must be {self.model_type == 'qwen3'} for model_type {self.model_type!r}")
        _require(not self.mlp_bias or self.model_type == "llama", "mlp_bias",
                 f"only llama supports mlp_bias, got model_type {self.model_type!r}")

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """From a `transformers` config object (`AutoConfig`), transformers 4.x or 5.x spelling."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: unsupported {model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window: sliding-window attention is not supported "
                             "(only use_sliding_window=False)")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: unsupported {act!r}; supported: 'silu'")
        theta, scaling = _rope_from_hf(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        eos = getattr(hf_config, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
            or hf_config.num_attention_heads,
            head_dim=getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            attention_bias=True if model_type == "qwen2" else bias,
            o_proj_bias=False if model_type == "qwen2" else bias,
            qk_norm=model_type == "qwen3",
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos,
            pad_token_id=getattr(hf_config, "pad_token_id", None),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for `transformers.AutoConfig.for_model` (transformers 5.x spelling)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta,
                    **dataclasses.asdict(self.rope_scaling)}
        out: dict[str, Any] = dict(
            model_type=self.model_type,
            architectures=[_ARCHITECTURES[self.model_type]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) > 1
            else (self.eos_token_ids[0] if self.eos_token_ids else None),
            pad_token_id=self.pad_token_id,
        )
        if self.model_type != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        else:
            out["use_sliding_window"] = False
        return out


def _rope_from_hf(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_parameters`` (transformers 5) or the 4.x attributes
    ``rope_theta`` / ``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type: unsupported {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor: only 1.0 is supported, got "
                         f"{params['partial_rotary_factor']}")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
