"""Llama from Hugging Face transformers (rotary positions, grouped-query attention, RMSNorm), random
weights, trained on a local text file over three stages (the rotary table computed on each).

    python examples/hf_llama.py corpus.txt --steps 100 --shape 1,1,1
"""

from __future__ import annotations

import argparse

from bundle.api import train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_file", help="any UTF-8 text file (byte-level tokens)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--shape", default="1,1,1", help="bundle shape, e.g. 1,1,1 or 2,1")
    args = parser.parse_args()
    result = train(
        "transformers:LlamaForCausalLM",
        model_args="num_hidden_layers=4,hidden_size=128,intermediate_size=256,num_attention_heads=4,num_key_value_heads=2",
        dataset="text",
        data_file=args.data_file,
        seq_len=128,
        bundle_shape=args.shape,
        micro_batches=4,
        batch_size=32,
        optimizer="adamw",
        lr=3e-4,
        itr=args.steps,
    )
    print("exit", result.exit_code, "final loss", (result.summary or {}).get("final_loss"))
