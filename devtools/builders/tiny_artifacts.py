"""Small, real Kiln artifacts for the runtime tests, made by the converter.

A tiny random Hugging Face model (transformers' own classes, so it doubles as the reference) is saved
as a checkpoint directory with a byte-level tokenizer and converted by services.convert.library.
Tests that need an odd artifact take a converted one and alter a copy (the helpers at the end).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from runtime.artifact.manifest import MANIFEST_NAME
from services.convert.library import ConversionRequest, convert

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte-level: every byte is a token (multi-byte chars span tokens)
BOS_ID, EOS_ID = 256, 258


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small random config: hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 259."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.15,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        common["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model_type = "llama"
    elif arch == "qwen2":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        model_type = "qwen2"
    elif arch == "mistral":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        common["sliding_window"] = 256
        model_type = "mistral"
    elif arch == "smollm2":  # Llama with tied embeddings
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
        common["tie_word_embeddings"] = True
        model_type = "llama"
    elif arch == "qwen3":  # RMSNorm on every q and k head
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        common["head_dim"] = 32
        model_type = "qwen3"
    else:
        raise ValueError(arch)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_checkpoint(model: PreTrainedModel, out: Path, *, lm_head_layer: bool = False) -> Path:
    """`model` as a Hugging Face checkpoint directory (weights in the model's dtype, config, generation
    config, tokenizer). With `lm_head_layer`, a tied model's checkpoint also stores lm_head.weight (as
    some real tied checkpoints do), which the converter turns into an lm_head linear layer."""
    model.save_pretrained(str(out))
    write_tokenizer(out)
    if lm_head_layer:
        weights = out / "model.safetensors"
        tensors = load_file(str(weights))
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"].clone())
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def write_artifact(
    model: PreTrainedModel,
    out_root: Path,
    *,
    tp: int = 1,
    target: str = "cpu",
    lm_head_layer: bool = False,
) -> Path:
    """Convert `model` with the converter into the store out_root and return the artifact's directory
    (out_root/<artifact_id>/). An untied model always gets an lm_head layer; a tied one only with
    `lm_head_layer`."""
    with tempfile.TemporaryDirectory(prefix="kiln-tiny-checkpoint-") as tmp:
        checkpoint = save_checkpoint(model, Path(tmp), lm_head_layer=lm_head_layer)
        (result,) = convert(ConversionRequest(str(checkpoint), [target], tp=tp, out=str(out_root)))
    return out_root / result.artifact_id


# ---- edited copies (tampering tests) ----------------------------------------------------------


def copy_artifact(artifact: Path, dest_root: Path) -> Path:
    """A copy of `artifact` under dest_root/<its name>/ (an edit never touches the shared original)."""
    out = dest_root / artifact.name
    shutil.copytree(artifact, out)
    return out


def edit_manifest(artifact: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the parsed manifest.json and write it back as JSON (NaN / Infinity as Python's
    json writes them: what an edited manifest can hold)."""
    doc = json.loads((artifact / MANIFEST_NAME).read_text())
    edit(doc)
    (artifact / MANIFEST_NAME).write_text(json.dumps(doc))


def list_file(artifact: Path, name: str, payload: bytes) -> None:
    """Write `payload` as `name` and list it in the manifest with its true size and sha256."""
    (artifact / name).write_bytes(payload)
    entry = {"name": name, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "rank": None}

    def relist(doc: dict[str, Any]) -> None:
        doc["files"] = [f for f in doc["files"] if f["name"] != name] + [entry]

    edit_manifest(artifact, relist)


def unlist_file(artifact: Path, name: str) -> None:
    """Leave `name` in the directory but take it off the manifest's file list."""
    edit_manifest(artifact, lambda doc: doc.update(files=[f for f in doc["files"] if f["name"] != name]))
