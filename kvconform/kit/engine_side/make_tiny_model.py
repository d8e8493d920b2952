"""Write a tiny Llama-shaped model directory: config plus a word-level tokenizer, and with
--weights SEED seeded random weights (model.safetensors; needs torch and safetensors).

Runs inside an engine environment (needs the `tokenizers` package). No model hub. Without
--weights the engine loads a dummy format, whose weights (uniform in +-1e-3, norms included)
make every answer the same whatever the prompt: an answer served from a wrong cached block
could not differ. The seeded weights are scaled so attention mixes the context and the
logits spread, so the greedy answer depends on the KV it attends to.
Words w0..w{vocab-1} map one-to-one to token ids, so a prompt's token count is its word count.

usage: python make_tiny_model.py OUT_DIR [--vocab N] [--layers N] [--heads N] [--head-dim N]
       [--weights SEED]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--weights", type=int, default=None, metavar="SEED")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), args.vocab):
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    hidden = args.heads * args.head_dim
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if args.weights is not None:
        write_weights(out, config, args.weights)
    print(json.dumps({"model_dir": str(out), "shape": config}))


def write_weights(out: Path, config: dict, seed: int) -> None:
    """Llama weights, HF names: projections scaled by 1/sqrt(fan_in) (queries and keys of unit
    variance: attention neither flat nor one-hot), values and outputs twice that and token
    embeddings at 0.3, so what attention reads from the KV outweighs the current token in the
    residual stream; norms at 1. Measured with transformers on 300-token prompts, one 16-token
    block replaced: the 8-token greedy answer changed in 30 of 30 (6 of 12 at unit scales, 0
    of 10 with the dummy format's weights)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]

    def linear(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * scale / cols**0.5).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": (0.3 * torch.randn(vocab, hidden, generator=gen)).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": linear(vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            layer + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            layer + "self_attn.q_proj.weight": linear(q_out, hidden),
            layer + "self_attn.k_proj.weight": linear(kv_out, hidden),
            layer + "self_attn.v_proj.weight": linear(kv_out, hidden, 2.0),
            layer + "self_attn.o_proj.weight": linear(hidden, q_out, 2.0),
            layer + "mlp.gate_proj.weight": linear(inter, hidden),
            layer + "mlp.up_proj.weight": linear(inter, hidden),
            layer + "mlp.down_proj.weight": linear(hidden, inter),
        }
    save_file(tensors, str(out / "model.safetensors"))


if __name__ == "__main__":
    main()
