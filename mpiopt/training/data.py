"""A run's data: the dataset its settings name, and each rank's batch of each step."""

from __future__ import annotations

from typing import Tuple

import torch

from ..comm import Comm
from ..tasks.images import ImageDataset, ShardSampler, augment_cifar, batch_rng, load_dataset
from ..tasks.text import TextDataset, load_text
from .config import TrainConfig, agree_or_fail

__all__ = ["load_data", "Batches"]


def load_data(config: TrainConfig, world: Comm) -> ImageDataset | TextDataset:
    """The dataset of ``config``, loaded on every rank (a collective call: one rank's failure fails all)."""
    if config.dataset == "text":
        return agree_or_fail(world, "cannot load the dataset", lambda: load_text(config.data_dir, block_size=config.gpt_sizes()["block_size"]))
    return agree_or_fail(world, "cannot load the dataset", lambda: load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed))


class Batches:
    """This rank's shard of the training set and the batch of each step (a function of the step: nothing to checkpoint).

    An asynchronous run's shards are the workers' (world ranks 1..P-1).
    """

    def __init__(self, dataset: ImageDataset | TextDataset, batch_size: int, seed: int, augment: bool, world: Comm, asynchronous: bool,
                 device: torch.device) -> None:
        self.device = device
        workers = max(1, world.size - 1) if asynchronous else world.size
        self.worker_rank = max(0, world.rank - 1) if asynchronous else world.rank
        self.windows = None
        if isinstance(dataset, TextDataset):
            self.sampler = self.windows = dataset.sampler(rank=self.worker_rank, world_size=workers, batch_size=batch_size, seed=seed)
            return
        self.sampler = ShardSampler(len(dataset.y_train), rank=self.worker_rank, world_size=workers, batch_size=batch_size, seed=seed)
        self.dataset, self.seed, self.augment = dataset, seed, augment
        self.x, self.y = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)

    def __call__(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = self._host(step)
        return x.to(self.device), y.to(self.device)

    def _host(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.windows is not None:
            return self.windows(step)
        index = self.sampler.indices(step)
        if self.augment:
            x = torch.from_numpy(augment_cifar(self.dataset.x_train[index], batch_rng(self.seed, self.worker_rank, step)))
        else:
            x = self.x[index]
        return x, self.y[index]
