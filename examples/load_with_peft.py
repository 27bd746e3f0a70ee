"""Load an exported adapter with PEFT and answer a question with it.

    python examples/load_with_peft.py runs/demo/lightning_logs/version_0/adapters/trial-7

The tiny demo base is rebuilt from its config with the same seed (it was never saved: it is random and
frozen; a run's other `base_seed` or `config_overrides` are in the export's multilora_export.json); for a real
base, pass its checkpoint path to `AutoModelForCausalLM.from_pretrained` instead.
"""

import json
import sys
from pathlib import Path

import torch
from peft import PeftModel

from lightning_multilora.base_model import build_base_model
from lightning_multilora.data import ByteTokenizer

adapter_dir = sys.argv[1]
info = Path(adapter_dir) / "multilora_export.json"  # what the folder holds: a built-in base's seed and overrides too
built = json.loads(info.read_text()).get("base", {}) if info.is_file() else {}
base = build_base_model("tiny-llama", built.get("config_overrides"), seed=built.get("base_seed", 0))  # the run's
model = PeftModel.from_pretrained(base, adapter_dir).eval()
tok = ByteTokenizer()

prompt = "Q: Ada has 7 apples and gets 5 more. How many apples does Ada have?\nA:"
ids = torch.tensor([tok.encode(prompt)])
with torch.no_grad():
    for _ in range(4):  # greedy decoding of a short answer
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        if next_id.item() == tok.eos_token_id:
            break
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
print(prompt + tok.decode(ids[0, len(tok.encode(prompt)):].tolist()))
