"""Build a small random-weight Llama model on disk, with a tokenizer and chat template.

Nothing is downloaded: the tests, the benchmarks and the local pool (``coserve
up``) run the real vLLM engine on CPUs with this model. Weights are drawn from
N(0, ``init_std``) and saved as safetensors. NOTE: vLLM's ``load_format=dummy``
weights are too weak for KV correctness tests (their outputs hardly depend on
the context, so corrupted KV still yields the "right" tokens); a larger spread
makes every token depend on the whole context.

Who calls it: ``tests/engine`` fixtures, ``benchmarks/`` and ``coserve up``,
each once per process; the build is cached by its parameters under ``root``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TinyModelSpec", "build_tiny_model"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape of the model; the defaults start in seconds on two CPU cores."""

    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 8192
    init_std: float = 0.05
    seed: int = 0

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def build_tiny_model(root: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write (once) and return the model folder for ``spec`` under ``root``."""
    spec = spec or TinyModelSpec()
    folder = Path(root) / f"tiny-llama-{spec.num_layers}l-{spec.hidden_size}h-{spec.digest()}"
    if (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(folder, spec.vocab_size)
    _write_weights(folder, spec)
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = [
        "the",
        "model",
        "serves",
        "tokens",
        "request",
        "conversation",
        "agent",
        "tool",
        "call",
        "result",
        "prefill",
        "decode",
        "cache",
        "layer",
        "deadline",
        "priority",
        "offline",
        "online",
        "batch",
    ]
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",  # noqa: S106 - a token, not a password
        eos_token="<|eos|>",  # noqa: S106
        pad_token="<|pad|>",  # noqa: S106
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def _write_weights(folder: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, spec.init_std)
    model.save_pretrained(str(folder), safe_serialization=True)
