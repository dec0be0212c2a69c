"""Train a tiny Llama with the ColossalAI plugin llmem plans for it.

    torchrun --standalone --nproc_per_node 2 examples/colossalai_booster.py --gpu h100-sxm
    python examples/colossalai_booster.py --gpu h100-sxm          # one process

On a machine without CUDA this plans TorchDDPPlugin (gloo) alone and trains
on the CPU; on GPUs it plans over every ColossalAI plugin (docs/colossalai.md).
Needs ColossalAI: pip install --no-deps colossalai==0.5.0 galore_torch==1.0 bitsandbytes==0.50.2
"""

from __future__ import annotations

import argparse
import logging
import os
import socket


def _single_process_env() -> None:
    """What torchrun sets, for a plain ``python`` run (one rank)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default=None, help="catalog GPU to plan for (default: this CUDA device)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    _single_process_env()
    import torch
    import torch.distributed as dist
    import transformers
    from llmem_plugin.integrations.colossalai import auto_booster

    logging.basicConfig(level=logging.WARNING)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    booster, plan = auto_booster(model, optimizer, seq_len=args.seq_len, global_batch=args.global_batch,
                                 precision=args.precision, gpu=args.gpu, seed=0, return_plan=True)
    rank = dist.get_rank()  # auto_booster planned, then launched ColossalAI
    c = plan.choice
    if rank == 0:
        print(f"plugin: {type(booster.plugin).__name__} for {c.label()} "
              f"({c.device_total_bytes / 2**30:.2f} GiB per GPU predicted on {plan.gpu.name})")
    model, optimizer, *_ = booster.boost(model, optimizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, config.vocab_size, (c.micro_batch, args.seq_len), generator=gen).to(device)
    for step in range(args.steps):
        for _ in range(c.grad_accum):
            loss = model(input_ids=batch, labels=batch).loss / c.grad_accum
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item() * c.grad_accum:.4f}")


if __name__ == "__main__":
    main()
