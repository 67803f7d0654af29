"""TEST-ONLY: a tiny random BERT written as a Hugging Face folder (config, safetensors weights, WordPiece
tokenizer), the stand-in for a pretrained text tower (``text_cfg.hf_model_name``) without downloads. Importable
from every test folder (pytest puts tests/, the folder of the top conftest.py, on sys.path)."""
from __future__ import annotations

from pathlib import Path

import torch

#: the vocabulary beyond the special tokens: the words of the test captions (train_helpers' shard captions too)
WORDS = ("a an the of red green blue circle square big small emoji cat dog with and stripe dot bright dark left "
         "right shape").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4
POSITIONS = 24


def write_tiny_bert(folder: Path, layers: int = 3, seed: int = 0) -> Path:
    """A random BERT (width 32, 4 heads, ``layers`` layers, POSITIONS positions) and a word-level WordPiece
    tokenizer, saved to ``folder``; returns it."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [*SPECIAL, *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=layers,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=POSITIONS)
    transformers.BertModel(cfg).save_pretrained(folder)
    if int(transformers.__version__.split(".")[0]) >= 5:  # 5.x takes the vocabulary itself; 4.x a vocab.txt file
        tok = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    else:
        tok = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    tok.save_pretrained(folder)
    return folder
