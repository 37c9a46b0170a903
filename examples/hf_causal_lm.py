"""A Hugging Face causal language model (GPT-2 or Llama), random weights, trained on a local
text file: GPT-2 cut across its embedding tied to its head (their gradients summed every step),
Llama over three stages (its rotary table computed again on each).

    python examples/hf_causal_lm.py corpus.txt --model gpt2 --steps 100 --shape 2,1
    python examples/hf_causal_lm.py corpus.txt --model llama --steps 100 --shape 1,1,1
"""

from __future__ import annotations

import argparse

from bundle.api import train

MODELS = {  # --model -> (transformers class, config fields)
    "gpt2": (
        "GPT2LMHeadModel",
        "n_layer=4,n_embd=128,n_head=4,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
    ),
    "llama": (
        "LlamaForCausalLM",
        "num_hidden_layers=4,hidden_size=128,intermediate_size=256,"
        "num_attention_heads=4,num_key_value_heads=2",
    ),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_file", help="any UTF-8 text file (byte-level tokens)")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--shape", default="2,1", help="bundle shape, e.g. 2,1 or 1,1,1")
    parser.add_argument("--port", type=int, default=29500, help="the job's rendezvous port")
    args = parser.parse_args()
    cls, fields = MODELS[args.model]
    result = train(
        f"transformers:{cls}",
        model_args=fields,
        dataset="text",
        data_file=args.data_file,
        seq_len=128,
        bundle_shape=args.shape,
        micro_batches=4,
        batch_size=32,
        optimizer="adamw",
        lr=3e-4,
        itr=args.steps,
        portNum=args.port,
    )
    print("exit", result.exit_code, "final loss", (result.summary or {}).get("final_loss"))
