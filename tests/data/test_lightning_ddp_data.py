"""A real Lightning DDP run on CPU (gloo, 2 processes, 2 DataLoader workers each) over uneven shards:
equal batch counts, and every epoch reads each sample at most once with less than one global batch left out."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    import pytorch_lightning as pl
    from diffmm.data.image_text import image_text_loader

    PATTERN, OUT = sys.argv[1], sys.argv[2]

    def id_tokenizer(texts):
        return torch.tensor([[int(t)] for t in texts], dtype=torch.long)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.seen = []

        def train_dataloader(self):
            # no rank passed: detected from torch.distributed, which Lightning has initialised by now
            self.loader = image_text_loader(PATTERN, 3, num_workers=2, tokenizer=id_tokenizer, image_size=8)
            return self.loader

        def training_step(self, batch, i):
            images, tokens = batch
            self.seen.append(tokens[:, 0].tolist())
            return self.lin(images.mean(dim=(2, 3))).pow(2).mean()   # DDP all-reduces grads every step

        def on_train_epoch_end(self):
            stats = self.loader.dataset.stats.all_reduce()           # summed over both ranks
            with open(os.path.join(OUT, f"rank{self.global_rank}-epoch{self.current_epoch}.json"), "w") as f:
                json.dump({"batches": self.seen, "len": len(self.loader), "stats": stats,
                           "env_rank": os.environ.get("RANK")}, f)
            self.seen = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if __name__ == "__main__":
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny())
''')


def test_lightning_ddp_two_processes_read_different_data_with_equal_batches(tmp_path, dh):
    sizes = [5, 9, 3, 11, 6, 9]                      # uneven, 43 samples: 7 batches of 3 per rank, 1 left out
    pattern, all_ids = dh.write_id_shards(str(tmp_path / "shards"), sizes)
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), pattern, str(tmp_path)], capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected_batches = sum(sizes) // (3 * 2)
    for epoch in range(2):
        runs = [json.load(open(tmp_path / f"rank{r}-epoch{epoch}.json")) for r in range(2)]
        ids = [{i for b in run["batches"] for i in b} for run in runs]
        assert [len(run["batches"]) for run in runs] == [expected_batches] * 2 == [run["len"] for run in runs]
        assert ids[0] and ids[1] and not ids[0] & ids[1], "ranks read overlapping data"
        flat = [i for run in runs for b in run["batches"] for i in b]
        assert len(flat) == len(set(flat)), "a sample was seen twice in one epoch"
        assert set(flat) <= set(all_ids) and len(all_ids) - len(flat) < 2 * 3   # < one global batch left out
        assert runs[0]["env_rank"] is None           # the Lightning trap: no RANK variable in the workers' env
        stats = runs[0]["stats"]
        assert stats == runs[1]["stats"] and stats["samples_out"] >= 2 * 3 * expected_batches
