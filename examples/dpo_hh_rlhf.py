"""A DPO adapter on HH-RLHF harmlessness pairs, then its preference accuracy on held-out pairs.

    python examples/dpo_hh_rlhf.py ../shared/data/hh_rlhf_harmless/pairs.jsonl.gz

On a 2-core CPU with the tiny random Llama (byte tokenizer, 256 tokens, rank 32, 800 steps of 8 pairs):
about 160 s, held-out preference accuracy 0.54 on 460 pairs (chance 0.5, one standard error 0.023).
A base that knows language would do far better; the point here is the whole DPO path on real pairs.
"""

import sys

import lightning as L
import torch

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule
from lightning_multilora.data import PreferenceSource

path = sys.argv[1] if len(sys.argv) > 1 else "../shared/data/hh_rlhf_harmless/pairs.jsonl.gz"
dm = MultiLoRADataModule(sources={"hh": PreferenceSource(path, format="hh_rlhf")}, truncate=True, max_length=256,
                         val_fraction=0.2, max_val_examples=460, val_batch_size=50)
spec = AdapterSpec("harmless", rank=32, alpha=64, lr=3e-3, batch_size=8, max_steps=800, objective="dpo", dpo_beta=0.5)
module = MultiLoRAModule("tiny-llama", adapters=[spec], config_overrides={"max_position_embeddings": 256},
                         export_dir="runs/dpo_hh_rlhf", validate_on_finish=False)
L.Trainer(accelerator="cpu", devices=1, max_steps=-1, limit_val_batches=0, logger=False, enable_checkpointing=False,
          enable_progress_bar=False).fit(module, dm)

# held-out pairs with the trained adapter: the fraction where it prefers the chosen answer more than the base does
module.add_adapter(AdapterSpec("heldout", rank=32, alpha=64, objective="dpo", dpo_beta=0.5))
record = module.registry["heldout"]
module._create_weights(record)
record.state = record.state.RUNNING
from safetensors.torch import load_file  # noqa: E402

module.lora_layers.load_peft_state_dict("heldout", load_file("runs/dpo_hh_rlhf/harmless/adapter_model.safetensors"))
module.eval()
correct = total = 0
with torch.no_grad():
    for batch in dm.val_batches([record.spec]):
        with module.lora_layers.use(batch["layout"]):
            module.adapter_loss_terms(batch)
        pairs = batch["layout"].num_rows // 2
        correct += module._preference_accuracy["heldout"].item() * pairs
        total += pairs
print(f"held-out preference accuracy {correct / total:.3f} on {total} pairs")
