"""Write a tiny random-weight Llama model in MLX format, for `omlx serve`.

Runs inside the omlx environment (needs `mlx`, `mlx_lm` and `tokenizers`); no model hub.
Unlike kvconform's shared tiny model, oMLX loads real weights, so they are written here
(random, seeded, small). The tokenizer is word-level: words w0..w{vocab-1} map one-to-one
to token ids, so a prompt's token count is its word count and block oracles apply exactly.
oMLX has no `ignore_eos`, so the end-of-sequence token's output row is zero: its logit is 0
while the greedy winner among 4,095 random logits is positive, so a reply runs to `max_tokens`
(a streamed request lasts as long as the suite asked, whatever the prompt).
The chat template only joins message contents with spaces (for /v1/chat/completions and the
admin cache probe); it adds no tokens of its own.

usage: python make_tiny_mlx_model.py OUT_DIR [--vocab N] [--layers N] [--heads N]
                                             [--kv-heads N] [--head-dim N] [--seed N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 16384,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    specials_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials_map))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, args.vocab)
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
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(args.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {}
    # Scaled as kvconform's shared tiny model (engine_side/make_tiny_model.py write_weights):
    # what attention reads from the KV outweighs the current token, so the greedy answer
    # depends on the KV it attends to.
    for key, value in tree_flatten(model.parameters()):
        if "norm" in key:
            weights[key] = mx.ones(value.shape, dtype=mx.float16)
        elif "embed_tokens" in key:
            weights[key] = (mx.random.normal(value.shape) * 0.3).astype(mx.float16)
        else:
            scale = (2.0 if "v_proj" in key or "o_proj" in key else 1.0) / value.shape[-1] ** 0.5
            weights[key] = (mx.random.normal(value.shape) * scale).astype(mx.float16)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate(
        [head[: config["eos_token_id"]], mx.zeros_like(head[:1]), head[config["eos_token_id"] + 1 :]]
    )
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    print(json.dumps({"wrote": str(out), "parameters": sum(v.size for v in weights.values())}))


if __name__ == "__main__":
    main()
