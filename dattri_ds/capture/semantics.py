"""What "the per-example gradient" means in dattri-ds, defined in this one place.

Let ``l[b, t]`` be the token loss of example b at position t and ``V_b`` its valid
(loss-bearing) positions, ``n_b = |V_b|``. The per-example loss is

* ``per_example_loss="sum"`` (default): ``L_b = sum_{t in V_b} l[b, t]``
* ``per_example_loss="mean"``:          ``L_b = (1 / n_b) sum_{t in V_b} l[b, t]``

and the per-example gradient is ``dL_b / dtheta``. It does not depend on what else is in
the batch, on padding, on gradient accumulation, on data-parallel world size or on loss
scaling. The training loop's backward, however, is on ``c * R`` where ``c`` is the
backward scale (``loss_scale / grad_accum`` under DeepSpeed, ``1/grad_accum`` in loops
that divide manually) and ``R`` is the loop's reduction of the micro-batch:

* ``loss_reduction="token_mean"`` (Hugging Face default): ``R = sum_b S_b / N``, ``N = sum_b n_b``,
  or ``N = num_items_in_batch`` when the call passes it (Hugging Face models then divide
  the summed token loss by it: Trainer counts the loss tokens of every micro-batch of the
  accumulated step, on every data-parallel rank)
* ``loss_reduction="sum"``:                               ``R = sum_b S_b``
* ``loss_reduction="example_mean"``:                      ``R = (1/B) sum_b S_b / n_b``

with ``S_b = sum_{t in V_b} l[b, t]``. So the captured output-grad of example b is
``c * w_b * dS_b/dout`` with ``w_b = 1/N``, ``1`` or ``1/(B n_b)``, and
``example_scale`` returns ``1 / (c * w_b)`` (divided by ``n_b`` for the mean). Examples
with ``n_b = 0`` get scale 0: padded or fully masked rows contribute exactly zero.

Valid positions follow the causal-LM convention: with ``shift_labels`` given (labels
already shifted, as padding-free collators pass them) position t is valid when
``shift_labels[b, t] != ignore_index``; with ``labels``, when
``labels[b, t + shift] != ignore_index``; else when
``attention_mask[b, t + shift] == 1``; else all ``T - shift`` positions are valid.
"""

from __future__ import annotations

import hashlib

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.sample_id import SampleId

__all__ = ["BatchInfo", "batch_info", "example_scale", "content_id", "read_once",
           "LOSS_REDUCTIONS", "PER_EXAMPLE_LOSSES"]

LOSS_REDUCTIONS = ("token_mean", "sum", "example_mean")
PER_EXAMPLE_LOSSES = ("sum", "mean")


class BatchInfo:
    """What the root forward call tells about its examples.

    Sample ids are content hashes of the tokens, so they need the tokens on the host. The
    call's tensors are kept as they are (on the model's device) and hashed when the ids are
    first read, or when the capture brings them to the host together with its own
    per-batch flag (``host_sources`` / ``resolve``: one copy, one host sync per batch).

    Attributes:
        rows: examples ``B`` (known without reading any tensor).
        token_counts: ``[B]`` valid (loss-bearing) positions ``n_b``, on the call's device.
        num_items: the call's ``num_items_in_batch`` (the token-mean denominator ``N``: a
            float, or a 0-d tensor left on its device), or None when the model divides by
            its own token count.
    """

    __slots__ = ("rows", "token_counts", "num_items", "_ids", "_sources", "_rule")

    def __init__(self, sample_ids: tuple[str, ...] | None, token_counts: torch.Tensor,
                 num_items: float | torch.Tensor | None = None, *,
                 sources: tuple[torch.Tensor | None, ...] | None = None,
                 rule: tuple | None = None) -> None:
        self.token_counts = token_counts
        self.num_items = num_items
        self._ids = None if sample_ids is None else tuple(sample_ids)
        self._sources, self._rule = sources, rule
        self.rows = len(self._ids) if self._ids is not None else int(token_counts.shape[0])

    @property
    def sample_ids(self) -> tuple[str, ...]:
        """One content-hash id per example (brings the tokens to the host on first use)."""
        if self._ids is None:
            self.resolve(read_once(self.host_sources()))
        return self._ids

    def host_sources(self) -> list[torch.Tensor]:
        """The int64 tensors the ids are hashed from, still to be brought to the host (none
        once the ids are known); ``resolve`` takes their host copies, in this order."""
        if self._ids is not None:
            return []
        return [t for t in self._sources if t is not None]

    def resolve(self, host: list[torch.Tensor | None]) -> None:
        """Hash the ids from host copies of ``host_sources()`` (``None`` entries keep the
        order of an absent tensor when given the full source tuple)."""
        if self._ids is not None:
            return
        it = iter(host)
        parts = [None if t is None else next(it) for t in self._sources] \
            if len(host) != len(self._sources) else list(host)
        self._ids = _hash_rows(*parts, *self._rule)
        self._sources = None

    def with_num_items(self, num_items: float | torch.Tensor | None) -> BatchInfo:
        """The same call with another token-mean denominator."""
        out = BatchInfo(self._ids, self.token_counts, num_items, sources=self._sources,
                        rule=self._rule)
        return out


def read_once(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of int64 tensors, brought over in one copy (one host sync, none when
    they are on the host already), in order and shape."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 \
        else tensors[0].reshape(-1)
    host = flat.cpu()
    out, pos = [], 0
    for t in tensors:
        out.append(host[pos:pos + t.numel()].view(t.shape))
        pos += t.numel()
    return out


def content_id(tokens: torch.Tensor, valid: torch.Tensor | None = None,
               user_id: str | None = None) -> str:
    """16-hex-digit blake2b of an example's tokens (and its loss mask), stable across runs.

    Padding-invariant: pass ``tokens`` without pads. Two examples with the same tokens and
    the same loss-bearing positions have the same gradient and the same id.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(tokens.detach().to("cpu", torch.int64).numpy().tobytes())
    if valid is not None:
        h.update(b"|")
        h.update(valid.detach().to("cpu", torch.bool).numpy().tobytes())
    digest = h.hexdigest()
    return str(SampleId.of(user_id, digest))


def _find_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    ids = kwargs.get("input_ids")
    if ids is None and args and torch.is_tensor(args[0]) and not args[0].is_floating_point():
        ids = args[0]
    return ids


def _valid(labels: torch.Tensor | None, shifted: torch.Tensor | None,
           mask: torch.Tensor | None, b: int, t: int, label_shift: int,
           ignore_index: int) -> torch.Tensor | None:
    """``[B, T - shift]`` loss-bearing positions (module docstring), None: all of them."""
    if shifted is not None:
        return shifted != ignore_index
    if labels is not None:
        return labels[:, label_shift:] != ignore_index
    if mask is not None:
        return mask[:, label_shift:] != 0
    return None


def _int64(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as int64 for the host copy (a float mask becomes its ``!= 0`` pattern)."""
    if t is None or t.dtype == torch.int64:
        return t
    return (t != 0).long() if t.is_floating_point() else t.long()


def _hash_rows(ids: torch.Tensor, labels: torch.Tensor | None, shifted: torch.Tensor | None,
               mask: torch.Tensor | None, label_shift: int, ignore_index: int,
               user_ids: tuple[str, ...] | None) -> tuple[str, ...]:
    """Content-hash ids of every row, from host tensors (the tokens the mask keeps, and
    which of them carry a loss)."""
    b, t = ids.shape
    keep = mask != 0 if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    if labels is not None:
        valid_full = labels != ignore_index
    elif shifted is not None:  # label of position t + shift is shift_labels[t]
        valid_full = torch.zeros_like(ids, dtype=torch.bool)
        valid_full[:, label_shift:] = shifted[:, :t - label_shift] != ignore_index
    else:
        valid_full = keep
    return tuple(content_id(ids[i][keep[i]], valid_full[i][keep[i]],
                            None if user_ids is None else str(user_ids[i])) for i in range(b))


def batch_info(args: tuple, kwargs: dict, *, label_shift: int = 1, ignore_index: int = -100,
               user_ids: list[str] | None = None) -> BatchInfo | None:
    """Read ids, labels and attention mask from a model call (HF-style keyword names).

    Nothing is read back to the host here: the token counts stay on the call's device and
    the sample ids are hashed later (``BatchInfo``). Returns None when the call has no
    integer ``input_ids`` (first positional or keyword).
    """
    ids = _find_ids(args, kwargs)
    if ids is None or ids.dim() != 2:
        return None
    labels, mask = kwargs.get("labels"), kwargs.get("attention_mask")
    shifted = kwargs.get("shift_labels")
    b, t = ids.shape
    if user_ids is not None and len(user_ids) != b:
        raise ConfigError(f"capture.tag() got {len(user_ids)} user ids for a batch of {b}")
    valid = _valid(labels, shifted, mask, b, t, label_shift, ignore_index)
    counts = (valid.sum(1) if valid is not None else
              torch.full((b,), max(t - label_shift, 0), dtype=torch.long, device=ids.device))
    sources = (_int64(ids), _int64(labels), _int64(shifted), _int64(mask))
    rule = (label_shift, ignore_index, None if user_ids is None else tuple(map(str, user_ids)))
    return BatchInfo(None, counts, _num_items(kwargs.get("num_items_in_batch")),
                     sources=sources, rule=rule)


def _num_items(value) -> float | torch.Tensor | None:
    """``num_items_in_batch`` of a call: a float, or a 0-d float tensor left on its device
    (Trainer passes a tensor; reading it would sync)."""
    if value is None:
        return None
    return value.float().mean() if torch.is_tensor(value) else float(value)


def example_scale(token_counts: torch.Tensor, *, loss_reduction: str, per_example_loss: str,
                  backward_scale: float,
                  num_items: float | torch.Tensor | None = None) -> torch.Tensor:
    """``[B]`` factors turning captured output-grads into per-example-loss output-grads.

    ``scale_b = 1 / (c * w_b)``, divided by ``n_b`` for the mean loss; 0 where ``n_b = 0``
    (see the module docstring for ``c`` and ``w_b``). ``num_items`` replaces ``N`` of the
    token mean when the call passed ``num_items_in_batch``.
    """
    if backward_scale == 0:
        raise ConfigError("backward scale is 0: the loop's backward carries no gradient")
    n = token_counts.to(torch.float64)
    b = n.numel()
    if loss_reduction == "token_mean":
        if num_items is None:
            total = n.sum()
        elif torch.is_tensor(num_items):
            total = num_items.to(device=n.device, dtype=torch.float64)
        else:
            total = torch.tensor(num_items, dtype=torch.float64)
        inv_w = total.expand(b)
    elif loss_reduction == "sum":
        inv_w = torch.ones_like(n)
    elif loss_reduction == "example_mean":
        inv_w = b * n
    else:
        raise ConfigError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got '{loss_reduction}'")
    if per_example_loss == "mean":
        inv_w = inv_w / n.clamp_min(1)
    elif per_example_loss != "sum":
        raise ConfigError(
            f"per_example_loss must be one of {PER_EXAMPLE_LOSSES}, got '{per_example_loss}'")
    return torch.where(n > 0, inv_w / backward_scale, torch.zeros_like(n))
