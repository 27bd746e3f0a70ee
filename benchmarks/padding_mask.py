"""The frozen base's forward + backward on right-padded rows, with their attention mask and without it.

    PYTHONPATH=. python benchmarks/padding_mask.py --out benchmarks/results/padding_mask_h100.json

`MultiLoRAMixin.adapter_loss_terms` runs a Hugging Face base on `MultiLoRADataModule`'s right-padded rows without
their attention mask (the causal mask alone keeps every real token from the padding after it). With the mask, a
batch holding padding takes another attention path (transformers materialises a (rows, 1, T, T) mask for SDPA, and
reads the mask on the host to decide), which is what this measures: a Llama-shaped bf16 base (``--layers``,
``--hidden``; SDPA attention), ``--rows`` rows of ``--seq`` tokens, one row in ``--padded`` of them ending in padding
(half its length), the loss's backward reaching the input embeddings (the adapters' gradients flow through every
layer, as in training; no weight gradients). Each time is the median of ``--reps`` steps after ``--warmup``. The
logits of the real tokens are compared between the two (they agree to bf16 rounding: the attention kernels differ).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import torch  # noqa: E402
import transformers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--padded", type=int, default=2, help="one row in this many ends in padding")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/padding_mask_h100.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/padding_mask.py measures on a CUDA GPU: torch finds none here")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=max(1, args.hidden // 512), max_position_embeddings=max(args.seq),
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    rows = []
    for n in args.rows:
        for seq in args.seq:
            ids = torch.randint(0, config.vocab_size, (n, seq), device="cuda")
            mask = torch.ones(n, seq, dtype=torch.long, device="cuda")
            mask[::args.padded, seq // 2:] = 0
            times, logits = {}, {}
            for name, given in (("mask", mask), ("none", None)):
                def step():
                    embeds = model.get_input_embeddings()(ids).requires_grad_()
                    out = model(inputs_embeds=embeds, attention_mask=given, use_cache=False).logits
                    out.float().logsumexp(-1).sum().backward()
                    return out
                for _ in range(args.warmup):
                    step()
                measured = []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = step()
                    torch.cuda.synchronize()
                    measured.append((time.perf_counter() - start) * 1e3)
                times[name], logits[name] = statistics.median(measured), out.detach()
            real = mask.bool()
            diff = (logits["mask"][real].float() - logits["none"][real].float()).abs().max().item()
            rows.append(dict(rows=n, seq=seq, masked_ms=round(times["mask"], 2), unmasked_ms=round(times["none"], 2),
                             speedup=round(times["mask"] / times["none"], 3), real_logits_max_abs_diff=diff))
            print(rows[-1], flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), date=datetime.now(timezone.utc).date().isoformat(),
                layers=args.layers, hidden=args.hidden, padded_every=args.padded, reps=args.reps)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
