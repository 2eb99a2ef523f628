"""``torchvision.datasets.MNIST`` stand-in: 28 x 28 uint8 images of ten classes, each a fixed
random stroke pattern plus per-image noise and a small shift, so a small MLP learns it to well
over 90 % test accuracy. 6,000 training and 1,000 test images (deterministic)."""
import numpy as np
import torch

_TRAIN, _TEST = 6000, 1000


def _prototypes():
    rng = np.random.default_rng(1234)
    protos = np.zeros((10, 28, 28), np.float32)
    for k in range(10):
        for _ in range(6):  # six random strokes per class
            r, c = rng.integers(4, 24, size=2)
            dr, dc = rng.integers(-1, 2, size=2)
            for step in range(10):
                rr, cc = np.clip(r + dr * step, 0, 27), np.clip(c + dc * step, 0, 27)
                protos[k, rr, cc] = 1.0
    return protos


def _images(n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    protos = _prototypes()
    imgs = protos[labels]
    shifts = rng.integers(-1, 2, size=(n, 2))
    imgs = np.stack([np.roll(im, tuple(s), axis=(0, 1)) for im, s in zip(imgs, shifts)])
    imgs = np.clip(imgs * 0.8 + rng.random(imgs.shape) * 0.35, 0, 1)
    return (imgs * 255).astype(np.uint8), labels.astype(np.int64)


class MNIST(torch.utils.data.Dataset):
    """Args as torchvision's; ``root`` and ``download`` are accepted and unused."""

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        self.data, self.targets = _images(_TRAIN if train else _TEST, 1 if train else 2)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        img, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
