"""Your own model and loop, trained with DP-AdamBC (Tang & Lecuyer 2023, arXiv 2304.11208) and DP-BandMF noise
(Ganesh, McMahan & Thakurta 2025, arXiv 2507.01129), using only the public API.

    python examples/own_loop_adambc_bandmf.py
"""

import torch
from torch import nn

import dp_adam_bench as dab

torch.manual_seed(0)
x = torch.randn(512, 20)
y = (x[:, :5].sum(1) > 0).long()  # a linearly separable toy problem
dataset = torch.utils.data.TensorDataset(x, y)
model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))

private = dab.make_private(
    model, dataset, nn.CrossEntropyLoss(reduction="none"),
    optimizer="adambc", noise="bandmf", noise_args={"bands": 4},
    clip=1.0, sigma=1.5, batch_size=32, epochs=3, lr=0.01,
)  # fmt: skip
for _ in range(private.steps):
    private.step()
    if private.steps_done % 16 == 0:
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        print(f"step {private.steps_done}/{private.steps}: train accuracy {acc:.3f}")
print("epsilon at delta = 1e-5:", {k: round(v, 3) for k, v in private.epsilon().items()})
