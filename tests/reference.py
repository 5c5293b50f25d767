"""Slow exact references: tiny models built from configs and one-example-per-backward gradients."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from dattri_ds.layers import kind_for


def tiny_gpt2(seed: int = 0, *, n_layer: int = 2, n_embd: int = 32, vocab: int = 97,
              n_positions: int = 64, tie: bool = False, dtype: torch.dtype = torch.float32):
    """A random-init GPT-2 from a config (no hub); dropout off so forward is deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    model = GPT2LMHeadModel(cfg).to(dtype)
    model.eval()
    return model


def token_losses(model, ids, attention_mask=None, labels=None):
    """Per-token causal LM losses ``[B, T-1]`` and the valid mask (label != -100)."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits
    labels = ids if labels is None else labels
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    valid = shift_labels != -100
    if attention_mask is not None and labels is ids:
        valid = valid & (attention_mask[:, 1:] != 0)
    ll = nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                     shift_labels.clamp_min(0).reshape(-1), reduction="none")
    return ll.view(shift_labels.shape) * valid, valid


def reference_grads(model, ids, attention_mask=None, labels=None, per_example_loss="sum",
                    layers=None):
    """``{layer: [B, D]}`` canonical per-example gradients, one backward per example."""
    mods = {n: m for n, m in model.named_modules() if kind_for(m) is not None
            and any(p.requires_grad for p in m.parameters(recurse=False))}
    if layers is not None:
        mods = {n: mods[n] for n in layers}
    out = {n: [] for n in mods}
    for b in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        am = None if attention_mask is None else attention_mask[b:b + 1]
        lb = None if labels is None else labels[b:b + 1]
        ll, valid = token_losses(model, ids[b:b + 1], am, lb)
        loss = ll.sum()
        if per_example_loss == "mean":
            loss = loss / valid.sum().clamp_min(1)
        loss.backward()
        for n, m in mods.items():
            grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p))
                     for k, p in m.named_parameters(recurse=False)}
            out[n].append(kind_for(m).canonical(m, grads).detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def ref_kfac_factors(lg, p_out=None, p_in=None):
    """Plain-torch K-FAC factors of one factorized LayerGrad (float64): ``A`` = sum over
    contributing tokens ``a a^T / M``, ``S`` = sum ``g g^T / N`` (index inputs one-hot;
    ``p_out``/``p_in``: Kronecker sides applied first)."""
    a, g = lg.data.a, lg.data.g.double()
    mask = (g != 0).any(-1).double()
    a = F.one_hot(a, lg.shape[1]).double() if not a.is_floating_point() else a.double()
    if p_in is not None:
        a, g = a @ p_in.double().T, g @ p_out.double().T
    A = torch.einsum("bti,btj,bt->ij", a, a, mask) / mask.sum()
    S = torch.einsum("bto,btp->op", g, g) / g.shape[0]
    return A, S


def ref_kron_eigenbasis(A, S):
    """``(l_s, l_a, Q)``: eigenvalues of ``S`` and ``A`` and the Kronecker eigenbasis
    ``Q = Q_S kron Q_A`` (a diagonal ``A``, e.g. an embedding's, keeps the identity basis)."""
    l_s, q_s = torch.linalg.eigh(S)
    if torch.equal(A, torch.diag(torch.diagonal(A))):
        l_a, q_a = torch.diagonal(A), torch.eye(A.shape[0], dtype=A.dtype)
    else:
        l_a, q_a = torch.linalg.eigh(A)
    return l_s, l_a, torch.kron(q_s.contiguous(), q_a.contiguous())


def perturbed(model: nn.Module, scale: float, gen: torch.Generator) -> nn.Module:
    """A copy of ``model`` with ``scale * N(0, 1)`` (from ``gen``) added to every parameter:
    a stand-in for a later checkpoint of a training run."""
    snap = copy.deepcopy(model)
    with torch.no_grad():
        for p in snap.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return snap
