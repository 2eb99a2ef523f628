"""``torchvision.transforms`` stand-in: ``Compose``, ``ToTensor`` (uint8 H x W -> float
1 x H x W in [0, 1]) and ``Normalize``."""
import numpy as np
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, img):
        arr = np.asarray(img, np.float32) / 255.0
        return torch.from_numpy(arr[None] if arr.ndim == 2 else arr)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).reshape(-1, 1, 1)
        self.std = torch.tensor(std).reshape(-1, 1, 1)

    def __call__(self, t):
        return (t - self.mean) / self.std
