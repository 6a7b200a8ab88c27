"""Build small, deterministic Llama-architecture models for tests, the demo and benchmarks.

No model can be downloaded where rlfleet is tested, so the project makes its own:
a byte-level BPE tokenizer trained on a fixed synthetic corpus plus a seeded
``LlamaForCausalLM``, written with ``save_pretrained`` into a directory that both
vLLM (by path) and ``transformers`` load.

Guarantees: the same preset and seed give the same bytes (weights, config,
tokenizer). A build writes into a temporary sibling directory and renames it into
place, so a crash never leaves a half-written model behind; an existing complete
build with a matching fingerprint is left alone (a second build is a no-op).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.fleet.errors import ConfigError

FINGERPRINT_FILE = "rlfleet-model.json"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# The chat template (Jinja, as Hugging Face tokenizers carry it): Qwen2.5-Instruct's, with its default system
# line made generic. It renders what agent transcripts hold the way real templates do: the request's tools
# in a system block (``<tools>``), an assistant's tool calls as ``<tool_call>`` JSON (the format vLLM's
# ``hermes`` tool parser reads back), tool results as ``<tool_response>`` in a user turn, consecutive ones
# together. The HTTP front (``rlfleet serve``) renders chat requests with it through vLLM's own renderer,
# as ``vllm serve`` would. The ``<|im_start|>`` markers are plain text to this tokenizer (several tokens).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' }}{{- tool_call.name }}"
    "{{- '\\\", \\\"arguments\\\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    """Architecture of one preset. ``head_dim = hidden // heads`` must be >= 32 (vLLM CPU attention)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False


PRESETS: dict[str, ModelPreset] = {
    # 0.4M parameters: an engine starts in seconds; used by tests and the demo.
    "tiny": ModelPreset(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256),
    # About 100M parameters: the transfer benchmark's large model.
    "100m": ModelPreset(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
    # Several hundred small tensors: the benchmark's worst case for per-tensor transfer.
    "many-small": ModelPreset(hidden_size=64, num_layers=48, num_heads=2, intermediate_size=128),
}


def _corpus() -> list[str]:
    """A fixed text the tokenizer is trained on: words, digits and simple patterns."""
    words = (
        "the a an of to in is it and or not yes no one two three four five six seven "
        "eight nine ten answer question model reward token engine weight update "
        "red green blue cat dog sun moon star tree river stone fire water earth air "
        "count say repeat copy next after before up down left right small large"
    ).split()
    lines = []
    for i in range(400):
        w = [words[(i * 7 + k * 13) % len(words)] for k in range(8)]
        lines.append(" ".join(w) + f" {i} {i * 3 % 97}.")
    lines.extend(" ".join(str(d) for d in range(n, n + 10)) for n in range(0, 100, 10))
    lines.extend(chr(c) * 4 for c in range(ord("a"), ord("z") + 1))
    return lines


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer deterministically; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=PRESETS["tiny"].max_position_embeddings,
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def _fingerprint(preset_name: str, seed: int) -> dict:
    return {"preset": preset_name, "seed": seed, "arch": asdict(PRESETS[preset_name]), "format": 3}  # 3: a chat template with tools


def is_built(path: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> bool:
    """True if ``path`` holds a complete build of (preset, seed)."""
    fp = Path(path) / FINGERPRINT_FILE
    try:
        return json.loads(fp.read_text()) == _fingerprint(preset, seed)
    except (OSError, ValueError):
        return False


def build_model(path: str | os.PathLike, preset: str = "tiny", seed: int = 0, force: bool = False) -> Path:
    """Write model + tokenizer for ``preset`` into ``path`` (float32 safetensors).

    Raises ConfigError (a ValueError) for an unknown preset. Returns the directory. Idempotent.
    """
    if preset not in PRESETS:
        raise ConfigError("preset", f"unknown model preset; allowed: {sorted(PRESETS)}", preset)
    out = Path(path).resolve()
    if not force and is_built(out, preset, seed):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = PRESETS[preset]
    tokenizer = build_tokenizer(arch.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(_fingerprint(preset, seed), sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def digest(path: str | os.PathLike) -> str:
    """SHA-256 over every file's name and bytes in a model directory (for determinism checks)."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def default_model_dir(preset: str = "tiny") -> Path:
    """Where set-up, tests and the demo keep built models (``RLFLEET_MODEL_CACHE`` overrides)."""
    root = os.environ.get("RLFLEET_MODEL_CACHE") or Path.home() / ".cache" / "rlfleet" / "models"
    return Path(root) / preset
