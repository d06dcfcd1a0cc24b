"""The token-mean loss and its gradients do not depend on how the batch is split: whole, in micro-batches with
gradient accumulation, or over 2 data-parallel ranks (real gloo process group). Normalising by the global token
count is what makes this true; a per-micro-batch mean is shown to differ."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from algorithms.ppo import policy_loss
from common.net import free_port


def make_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, H = 8, 6, 5
    x = torch.randn(B, T, H, generator=g)
    lengths = torch.tensor([1, 6, 2, 5, 3, 6, 1, 4])  # very uneven token counts per row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, T, generator=g)
    weight = torch.randn(H, generator=g) * 0.1
    return x, mask, old, adv, weight


def loss_and_grad(w0, x, mask, old, adv, normalizer=None):
    w = w0.clone().requires_grad_(True)
    logp = old + x @ w  # a stand-in policy whose log-probs depend on the parameters
    loss, _ = policy_loss(logp, old, adv, mask, normalizer=normalizer)
    loss.backward()
    return loss.detach(), w.grad


def test_micro_batches_equal_whole_batch():
    x, mask, old, adv, w = make_problem()
    full_loss, full_grad = loss_and_grad(w, x, mask, old, adv)
    n_tokens = mask.sum().item()
    acc_loss, acc_grad = 0.0, torch.zeros_like(w)
    naive_grad = torch.zeros_like(w)
    for rows in torch.arange(8).split(2):
        l, g = loss_and_grad(w, x[rows], mask[rows], old[rows], adv[rows], normalizer=n_tokens)
        acc_loss, acc_grad = acc_loss + l, acc_grad + g
        naive_grad += loss_and_grad(w, x[rows], mask[rows], old[rows], adv[rows])[1] / 4
    assert torch.allclose(acc_loss, full_loss, atol=1e-6)
    assert torch.allclose(acc_grad, full_grad, atol=1e-6)
    assert not torch.allclose(naive_grad, full_grad, atol=1e-4)  # per-micro-batch means would be wrong


def _rank_main(rank: int, world: int, port: int, out: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, mask, old, adv, w = make_problem()
    rows = torch.arange(8).view(world, -1)[rank]
    n_tokens = torch.tensor(float(mask[rows].sum()))
    dist.all_reduce(n_tokens)  # the global token count
    # Each rank accumulates 2 micro-batches; the loss is scaled by world size because DP averages gradients.
    grad = torch.zeros_like(w)
    for micro in rows.split(2):
        _, g = loss_and_grad(w, x[micro], mask[micro], old[micro], adv[micro], normalizer=n_tokens.item() / world)
        grad += g
    dist.all_reduce(grad)
    grad /= world
    out[rank] = grad
    dist.destroy_process_group()


def test_two_data_parallel_ranks_equal_whole_batch():
    x, mask, old, adv, w = make_problem()
    _, full_grad = loss_and_grad(w, x, mask, old, adv)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), out), nprocs=2, join=True)
        grads = [out[0], out[1]]
    assert torch.equal(grads[0], grads[1])
    assert torch.allclose(grads[0], full_grad, atol=1e-6)
