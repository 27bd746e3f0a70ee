"""A learning-rate x rank x batch-size sweep of 8 LoRA adapters, and a ninth on its own data, trained together
from Python.

    python examples/python_api_sweep.py

Builds a tiny Llama from a config (no download), trains the adapters packed on generated arithmetic
word problems, prints the ranked table and writes every adapter in PEFT format under
runs/python_api/.../adapters (see examples/load_with_peft.py).
"""

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_multilora import AdapterSpec, MultiLoRADataModule, MultiLoRAModule, SweepGrid, SweepReport
from lightning_multilora.data import GeneratedArithmetic

grid = SweepGrid(axes={"lr": [1e-3, 4e-3], "rank": [4, 8], "batch_size": [2, 4]},
                 base={"max_steps": 60, "lr_schedule": "cosine", "warmup_steps": 5}, alpha_over_rank=2)
# One more adapter with its own dataset (multiplication only) and its own length, in epochs.
extra = AdapterSpec("mul-only", rank=8, alpha=16, lr=4e-3, batch_size=4, max_epochs=0.5, dataset="mul")

model = MultiLoRAModule("tiny-llama", adapters=[extra], grid=grid, max_running=6)
data = MultiLoRADataModule(
    sources={"arith": GeneratedArithmetic(2000), "mul": GeneratedArithmetic(800, seed=1, operations=("mul",))},
    max_val_examples=64,
)
report = SweepReport()
trainer = L.Trainer(devices=1, max_steps=-1, val_check_interval=20, check_val_every_n_epoch=None, log_every_n_steps=10,
                    logger=TensorBoardLogger("runs", name="python_api"), callbacks=[report],
                    enable_progress_bar=False)
trainer.fit(model, data)

best = report.rows[0]  # (ranked by the validation loss of the weights exported: here the last ones, no EarlyExit)
print(f"best adapter: {best['adapter']} (val loss {best['exported_val_loss']:.3f}) at {best['export_path']}")
