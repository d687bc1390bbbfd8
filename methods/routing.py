"""Training the domain router (stage 6A): the runtime's hashed n-gram features
(:func:`kibidango.addons.router.features`) into an MLP 128-64-32-K trained with torch, exported as the
runtime's :class:`kibidango.addons.router.Router` (numpy weights in JSON)."""

from __future__ import annotations

import numpy as np

from kibidango.addons.router import Router, features

__all__ = ["confusion", "train_router"]


def train_router(
    texts: list[str],
    labels: list[str],
    label_set: list[str],
    hidden: tuple[int, ...] = (64, 32),
    dim: int = 128,
    epochs: int = 30,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
    balanced: bool = True,
) -> Router:
    """An MLP ``dim``-``hidden``-K on the texts' features; ``balanced`` weights the loss by inverse
    class frequency (stage 0's domains are mostly general)."""
    import torch

    torch.manual_seed(seed)
    index = {name: i for i, name in enumerate(label_set)}
    x = torch.as_tensor(np.stack([features(t, dim) for t in texts]))
    y = torch.as_tensor([index[label] for label in labels])
    sizes = [dim, *hidden, len(label_set)]
    modules: list[torch.nn.Module] = []
    for i in range(len(sizes) - 1):
        modules.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            modules.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*modules)
    counts = torch.bincount(y, minlength=len(label_set)).float()
    weight = (counts.sum() / (len(label_set) * counts.clamp(min=1))) if balanced else None
    loss_fn = torch.nn.CrossEntropyLoss(weight=weight)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(64):
            opt.zero_grad()
            loss_fn(net(x[batch]), y[batch]).backward()
            opt.step()
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()) for m in linears]
    return Router(list(label_set), layers, dim)


def confusion(router: Router, texts: list[str], labels: list[str]) -> dict:
    """Accuracy and the confusion counts (true label -> predicted label -> n)."""
    predicted = [router.labels[i] for i in router.probabilities(texts).argmax(axis=1)] if texts else []
    table: dict[str, dict[str, int]] = {}
    for t, p in zip(labels, predicted):
        table.setdefault(t, {}).setdefault(p, 0)
        table[t][p] += 1
    correct = sum(1 for t, p in zip(labels, predicted) if t == p)
    return {"accuracy": correct / len(labels) if labels else 0.0, "confusion": table, "n": len(labels)}
