"""GPT-2 from Hugging Face transformers, random weights, trained on a local text file with its
token embedding tied to its head across two stages (their gradients summed every step).

    python examples/hf_gpt2.py corpus.txt --steps 100 --shape 2,1
"""

from __future__ import annotations

import argparse

from bundle.api import train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_file", help="any UTF-8 text file (byte-level tokens)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--shape", default="2,1", help="bundle shape, e.g. 2,1 or 1,1,1")
    args = parser.parse_args()
    result = train(
        "transformers:GPT2LMHeadModel",
        model_args="n_layer=4,n_embd=128,n_head=4,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
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
