"""Flax NNX decoder models (Llama 3.x, Qwen2/2.5, Qwen3) and HF checkpoint I/O.

Nothing RL-specific lives here; ``models`` never imports ``sparse_rl_jax``.
"""

from models.versions import check_jax_flax

check_jax_flax()  # before anything imports flax: a bad pair fails with both versions named

from models.attention import visibility  # noqa: E402
from models.attention_backends import AttentionBackend, attention, register_backend
from models.cache import KVCache, init_cache
from models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from models.decoder import Decoder, DecoderOutput
from models.export import save_adapter, save_pretrained
from models.gguf import checkpoint_dir, convert_gguf, find_gguf, smollm2_gguf
from models.kv_view import Causal, ExpiryRecord, KVView, MaskRecord
from models.loading import hf_name, load_pretrained, read_config
from models.lora import LORA_TARGETS, add_lora, has_lora, merge_lora, split_trainable
from models.page_sparse import PageReplay, PageSparseCache
from models.paged_cache import PagedKVCache, init_paged_cache
from models.partitioning import (MESH_AXES, PARTITION_RULES, make_mesh, param_shardings,
                                 partition_spec)
from models.tokenizer import Tokenizer

__all__ = [
    "LORA_TARGETS", "MESH_AXES", "PARTITION_RULES", "SUPPORTED_MODEL_TYPES", "Causal",
    "Decoder", "DecoderOutput", "ExpiryRecord", "KVCache", "KVView", "MaskRecord",
    "AttentionBackend", "ModelConfig", "PageReplay", "PageSparseCache", "PagedKVCache", "RopeScaling", "Tokenizer", "attention",
    "checkpoint_dir", "convert_gguf",
    "find_gguf", "has_lora", "hf_name", "init_cache", "init_paged_cache", "smollm2_gguf", "add_lora",
    "load_pretrained", "make_mesh", "merge_lora", "param_shardings", "partition_spec",
    "read_config", "register_backend", "save_adapter", "save_pretrained", "split_trainable", "visibility",
]
