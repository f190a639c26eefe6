"""A tiny Llama-architecture model with random weights and a tokenizer trained on a few lines.

Made at test time, in seconds, so that a real vLLM serves it on a CPU: nothing is downloaded.
Head dim 64 (vLLM's CPU attention kernels reject smaller ones); 2 layers; bf16 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fleet of replicas serves the model behind one gateway.",
    "Prefix caching keeps the key and value blocks of a shared prompt.",
    "The router sends a repeated prefix to the replica that holds it.",
    "When a replica dies, the runtime restarts it and the gateway routes around it.",
    "Tokens stream back one chunk at a time, as server-sent events.",
    "system user assistant: hello, how can I help you today?",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    """Write the model (config, safetensors weights, tokenizer) into ``path``; return it."""
    import torch  # noqa: PLC0415 - only in the vLLM environment
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(LINES * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # head dim 128 / 2 = 64
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    (path / "gpufleet-tiny.json").write_text(json.dumps({"lines": LINES, "seed": seed}))
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_llama(Path(sys.argv[1])))


def make_tiny_lora(base: Path, path: Path, *, seed: int, rank: int = 8) -> Path:
    """A random rank-``rank`` LoRA adapter of the tiny model (``q_proj`` and ``v_proj``),
    made with ``peft`` into ``path``: its ``lora_B`` is drawn at random (peft starts it at
    zero, which would leave the model's answers unchanged). Return ``path``."""
    import torch  # noqa: PLC0415 - only in the vLLM environment
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)  # before get_peft_model, which draws lora_A
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    adapted.save_pretrained(path)
    return path
