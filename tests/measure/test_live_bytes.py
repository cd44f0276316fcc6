"""LivePeak counts each storage once while a tensor on it lives, and nothing from before."""

from __future__ import annotations

import torch

from megalite.measure.live_bytes import LivePeak

KIB = 1024


def test_peak_counts_storages_once_while_alive():
    before = torch.ones(4096)  # 16 KiB, made before the block: not counted
    with LivePeak() as live:
        a = before * 2  # 16 KiB
        view = a.view(64, 64)  # a view of a's storage: nothing new
        b = view.t() + 1  # 16 KiB: 32 alive
        a.mul_(3)  # in place: nothing new
        del a, view
        c = b * 2  # 16 KiB: 32 alive again (a's storage freed with its last tensor)
        del b, c
        d = torch.empty(8 * KIB)  # 32 KiB alone
    assert live.peak == 32 * KIB
    assert live.current == 8 * KIB * 4  # d alone is alive
    del d
    assert live.current == 0


def test_saved_tensors_live_until_backward_frees_them():
    w = torch.randn(256, 256, requires_grad=True)  # made before: not counted
    x = torch.randn(64, 256)
    with LivePeak() as live:
        y = (x @ w).relu()  # [64, 256] 64 KiB; relu's output saved by itself
        y.sum().backward()  # w.grad 256 KiB
    assert live.peak >= 64 * KIB + 256 * KIB
    assert live.current == 64 * KIB + 256 * KIB  # y and w.grad are still alive
