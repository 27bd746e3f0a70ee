"""Load an exported adapter with PEFT and answer a question with it.

    python examples/load_with_peft.py runs/demo/lightning_logs/version_0/adapters/trial-7

The base is the one the export names (`base_model_name_or_path` in its adapter_config.json), built as the run built it
(`base` in the export's multilora_export.json: its `config_overrides`, `dtype`, 4-bit `quantization`, and a quantized
base given to the module its bitsandbytes settings whole, `quantization_config`). A built-in
tiny base ("tiny-llama"...) was never saved: it is random and frozen, so it is rebuilt from its config with the run's
seed. Any other base is loaded from its checkpoint with `AutoModelForCausalLM.from_pretrained` (a 4-bit one with
`build_base_model`, which keeps bitsandbytes from repacking it on the CPU), with its tokenizer where the checkpoint
holds one (else the byte tokenizer, the data module's default).
"""

import json
import sys
from pathlib import Path

import torch
from peft import PeftModel

from lightning_multilora.base_model import TINY_CONFIGS, build_base_model
from lightning_multilora.data import ByteTokenizer
from lightning_multilora.data.tokenizer import holds_tokenizer

if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "adapter_config.json").is_file():
    sys.exit(f"usage: python {sys.argv[0]} <an exported adapter's folder, holding adapter_config.json>")
adapter_dir = Path(sys.argv[1])
named = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
info = adapter_dir / "multilora_export.json"  # what the folder holds: how the run built its base too
built = json.loads(info.read_text()).get("base", {}) if info.is_file() else {}
dtype = built.get("dtype", "float32")
quantization = built.get("quantization_config") or built.get("quantization")  # (the settings whole, where given)
if not named or named in TINY_CONFIGS:
    base = build_base_model(named or "tiny-llama", built.get("config_overrides"), dtype, seed=built.get("base_seed", 0),
                            quantization=quantization)
    tok = ByteTokenizer()
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quantization:  # (a quantized base: its weights as the run's, kept from bitsandbytes' CPU repacking)
        base = build_base_model(named, built.get("config_overrides"), dtype, quantization=quantization)
    else:
        base = AutoModelForCausalLM.from_pretrained(named, dtype=dtype, **built.get("config_overrides", {}))
    tok = ByteTokenizer()  # (a checkpoint saved without a tokenizer: trained on bytes, the data module's default; a
    if not Path(named).is_dir() or holds_tokenizer(named):  # folder without one gave one with no vocabulary)
        try:
            tok = AutoTokenizer.from_pretrained(named)
        except (OSError, ValueError):
            pass
model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()

prompt = "Q: Ada has 7 apples and gets 5 more. How many apples does Ada have?\nA:"
prompt_ids = tok.encode(prompt)  # (with the tokenizer's BOS, where it adds one, as the training rows began)
ids = torch.tensor([prompt_ids])
with torch.no_grad():
    for _ in range(4):  # greedy decoding of a short answer
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        if next_id.item() == tok.eos_token_id:
            break
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
print(prompt + tok.decode(ids[0, len(prompt_ids):].tolist()))
