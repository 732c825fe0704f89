"""Convert one GGUF file (qwen2, qwen3 or llama architecture) into a Hugging Face model folder.

The folder gets config.json, generation_config.json, model.safetensors (in ``dtype``, default bfloat16) and,
when the GGUF carries a tokenizer, the tokenizer files saved by transformers (chat template included).

Invariants:
  * ``out_dir`` appears only by an atomic rename of a fully written sibling staging folder: any error
    (unreadable / truncated GGUF -> ModelFormatError, unsupported architecture -> ModelFormatError) leaves
    neither ``out_dir`` nor the staging folder behind.
  * Tensors are dequantized one at a time and cast to ``dtype`` at once: no fp32 copy of the whole model.
  * Every GGUF tensor maps to exactly one HF name, with the shape the config implies; an unknown or
    missing tensor is a ModelFormatError, never a silently random-initialised weight.
  * For ``llama`` the q/k rows that llama.cpp permuted into its interleaved rotary layout are put back into
    HF's rotate_half layout (``unpermute_rotary``); qwen2/qwen3 GGUFs are stored unpermuted.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from specpilot.errors import ModelFormatError

HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
BLOCK_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
QWEN_CHAT_EOS = ("<|im_end|>", "<|endoftext|>")
TOKENIZER_CHECK_TEXTS = ("Hello, world!", "def add(a, b):\n    return a + b  # sum\n", "  héllo\t日本語 <|im_end|>")
_MISSING = object()


def hf_tensor_name(gguf_name: str) -> str:
    """The HF state-dict name of a GGUF tensor name (ModelFormatError if it has none)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.match(gguf_name)
    if match and match.group(2) in BLOCK_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{int(layer)}.{BLOCK_TENSORS[part]}.{kind}"
    raise ModelFormatError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (per head, rows (i, i+d/2) were interleaved as rows (2i, 2i+1))."""
    head_dim = weight.shape[0] // n_heads
    return (weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32: give back the shortest decimal that is that float32 (1e-05, not 9.99e-06)."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


class _Metadata:
    def __init__(self, reader) -> None:
        self.reader = reader
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=_MISSING):
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelFormatError(f"GGUF metadata has no {key!r}")
            return default
        return field.contents()

    def arch_get(self, key: str, default=_MISSING):
        return self.get(f"{self.arch}.{key}", default)


def _open_reader(gguf_path: Path):
    import gguf

    try:
        return gguf.GGUFReader(gguf_path)
    except Exception as exc:  # a bad magic, a truncated header or tensor table: all the file's fault
        raise ModelFormatError(f"{gguf_path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def build_config(meta: _Metadata, vocab_size: int, tied: bool, dtype: torch.dtype) -> dict:
    """config.json contents for the GGUF's architecture."""
    hidden = int(meta.arch_get("embedding_length"))
    heads = int(meta.arch_get("attention.head_count"))
    kv_heads = int(meta.arch_get("attention.head_count_kv", heads))
    head_dim = int(meta.arch_get("attention.key_length", hidden // heads))
    rope_dims = int(meta.arch_get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFormatError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    scaling = meta.arch_get("rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ModelFormatError(f"rope scaling {scaling!r} is not supported")
    rope_theta = _float32_value(meta.arch_get("rope.freq_base", 10000.0))
    config = {
        "architectures": [HF_ARCHITECTURES[meta.arch]],
        "model_type": meta.arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(meta.arch_get("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta.arch_get("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if meta.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if meta.arch == "qwen3":
        config.update(attention_bias=False)
    if meta.arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])
    return config


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for every tensor the config implies (lm_head only when untied)."""
    h, ff, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    per_layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff)}
    if config["model_type"] == "qwen2":
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if config["model_type"] == "qwen3":
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _dequantize(tensor, dtype: torch.dtype) -> torch.Tensor:
    import gguf

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelFormatError(f"tensor {tensor.name}: unsupported type {tensor.tensor_type.name}") from exc
    except Exception as exc:
        raise ModelFormatError(f"tensor {tensor.name} is corrupt or truncated ({exc})") from exc
    if array.size != math.prod(shape):
        raise ModelFormatError(f"tensor {tensor.name} has {array.size} values, its shape {shape} needs "
                               f"{math.prod(shape)} (truncated file?)")
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable or not array.flags.owndata:
        array = array.copy()  # never keep a view of the GGUF's memory map
    return torch.from_numpy(array).to(dtype)


def _convert_tensors(reader, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    expected = expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name not in expected:
            raise ModelFormatError(f"GGUF tensor {tensor.name!r} does not belong in a {config['model_type']} model")
        value = _dequantize(tensor, dtype)
        if tuple(value.shape) != expected[name]:
            raise ModelFormatError(f"tensor {tensor.name} has shape {tuple(value.shape)}, expected {expected[name]}")
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            value = unpermute_rotary(value, heads)
        state[name] = value
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelFormatError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return state


def build_generation_config(meta: _Metadata, config: dict) -> dict:
    eos = [config["eos_token_id"]] if config["eos_token_id"] is not None else []
    if meta.arch in ("qwen2", "qwen3") and "tokenizer.ggml.tokens" in meta.reader.fields:
        tokens = meta.get("tokenizer.ggml.tokens")
        index = {tok: i for i, tok in enumerate(tokens) if tok in QWEN_CHAT_EOS}
        eos += [index[tok] for tok in QWEN_CHAT_EOS if tok in index and index[tok] not in eos]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else eos or None}
    pad = meta.get("tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        generation["pad_token_id"] = pad
    return generation


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """Save the GGUF's tokenizer through transformers and check the saved one encodes exactly like it."""
    from transformers import AutoTokenizer

    try:
        source = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if chat_template and source.chat_template != chat_template:
            source.chat_template = chat_template
        source.save_pretrained(out_dir)
        saved = AutoTokenizer.from_pretrained(str(out_dir))
    except Exception as exc:
        raise ModelFormatError(f"could not convert the tokenizer of {gguf_path.name} ({exc})") from exc
    if chat_template and saved.chat_template != chat_template:
        raise ModelFormatError("the chat template did not survive saving the tokenizer")
    for text in TOKENIZER_CHECK_TEXTS:
        if source(text)["input_ids"] != saved(text)["input_ids"]:
            raise ModelFormatError(f"saved tokenizer encodes {text!r} differently from the GGUF's")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders (and safetensors 0600 files): give them the umask's usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
                 tokenizer: bool | None = None) -> None:
    """Write the HF folder ``out_dir`` (which must not exist, or be empty) from ``gguf_path``.

    ``tokenizer``: True requires the GGUF's tokenizer, False skips it, None (default) converts it when present.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    reader = _open_reader(gguf_path)
    meta = _Metadata(reader)
    if meta.arch not in HF_ARCHITECTURES:
        raise ModelFormatError(f"GGUF architecture {meta.arch!r} is not supported (supported: "
                               f"{', '.join(HF_ARCHITECTURES)})")
    has_tokenizer = "tokenizer.ggml.tokens" in reader.fields
    if tokenizer and not has_tokenizer:
        raise ModelFormatError(f"{gguf_path.name} carries no tokenizer")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelFormatError(f"{gguf_path.name} has no token_embd.weight tensor")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = build_config(meta, int(embed.shape[-1]), tied, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        state = _convert_tensors(reader, config, dtype)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        del state
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = build_generation_config(meta, config)
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if has_tokenizer and tokenizer is not False:
            _save_tokenizer(gguf_path, staging, meta.get("tokenizer.chat_template", None))
        _make_readable(staging)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
