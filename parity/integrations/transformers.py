"""The block-sparse attention kernel as a Hugging Face ``transformers`` attention implementation.

One call registers two implementations that a model selects with ``attn_implementation=...``::

    from parity.integrations import transformers as parity_tf

    kernel, reference = parity_tf.register()          # "parity_sparse", "parity_sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=kernel)
    parity_tf.attach(model)                            # adds model.layers.N.self_attn.attn_core

``parity_sparse`` runs the Triton kernel (``parity.kernels.block_sparse_attention``);
``parity_sdpa`` runs PyTorch's ``scaled_dot_product_attention`` on the same mask. Both do their
math in the same child module, :class:`ParityAttention`, attached to every attention layer as
``attn_core``, so a golden captured with one and a comparison run with the other record the same
module names, and ``compare --isolate`` can replay the attention call alone on its golden
inputs and name it as the layer that introduces an error.

What each implementation receives from transformers, and what the kernel is given for it:

- ``attention_mask is None``: transformers found the mask purely causal. The kernel gets a
  *bottom-right* causal layout (a query at row ``i`` of ``Sq`` sees keys up to
  ``i + Sk - Sq``: decode with a KV cache has ``Sq < Sk``), with the model's
  ``sliding_window`` when it passes one; for a non-causal module (``is_causal=False``), every
  key. The mask function :func:`register` installs returns None only where top-left and
  bottom-right alignment agree (``Sq == Sk`` or ``Sq == 1``) and never for a bidirectional
  mask, so a None mask is never ambiguous.
- a 4-D mask ``[B or 1, H or 1, Sq, Sk]``, boolean (True: attend) or additive float (0 or the
  dtype's minimum): padded batches, packed batches (``position_ids`` that restart), sliding
  windows and decode with padding. Transformers builds it with the same mask function as for
  ``sdpa``. The kernel gets exactly that mask: as key padding (``padding_layout``) or documents
  (``document_layout``) where the mask is exactly that, else as an element mask
  (``layout_from_dense_mask``); see :func:`kernel_layout`. Without a registered mask function
  transformers gives a custom implementation no mask at all, padded batches included, and
  padding is silently ignored: :func:`register` always registers both, and the attention
  function refuses a None mask from an implementation without one.
- ``cu_seq_lens_q``/``cu_seq_lens_k`` (flattened batches, e.g. ``DataCollatorWithFlattening``)
  with no mask: document masking, causal within each document. When a 4-D mask is present it
  wins (transformers derived it from the same ``position_ids``).

A query row that sees no key (a left-padding position) gives 0 in both implementations: that
is the kernel's convention, and SDPA's output for such rows (NaN or an average, depending on
the backend) is replaced by 0 so that parity compares like with like.

GQA (fewer key/value heads than query heads) is passed to the kernel as is; the SDPA side
repeats key/value heads. Dropout, ``softcap``, attention sinks (``s_aux``) and position biases
are not supported and raise. Transformers itself is imported only when :func:`register` is
called (``pip install 'parity[transformers]'``); :class:`ParityAttention` works without it.

Recording. :func:`attach` must run before parity's recorder is created (a subject's
``build``): the recorder hooks the modules that exist then. The core's output is recorded as
``model.layers.N.self_attn.attn_core`` (``#k`` for the k-th call, e.g. decode steps); its inputs
(query, key, value, the mask, scaling, window, cu_seq_lens) are all tensors or plain values, so
``--isolate`` can replay it. The enclosing ``self_attn`` and decoder layers receive the KV cache
object, which cannot be stored, so they are compared end to end but not replayed.

One layout per forward. transformers builds a forward's mask once and hands the same tensor to
every layer; the kernel's layout is remembered on it (``_Plans``) and derived once, in the mask
function where the mask is causal AND key padding (from the 2-D padding mask, never reading the
4-D mask), else on the mask's first use. Every kernel call goes through
``ParityAttention._run_kernel``.

One step per forward. A layer's call through the attention function makes its decision once
(``ParityAttention._decide``: every check, the layout or the SDPA call's plan) and, for the
kernel, binds the launch plan to its description of q, k, v (``attention.bind_planned``); the
forward's later layers take that step (``_Step``) after comparing what the decision follows
from, without the module call (only where the core has no hook: the recorder's calls are module
calls) and without forward's checks. Anything that differs takes the full path.

Long because the module is the whole integration: the attention module, the reference, the
layouts the kernel gets for each mask transformers builds and their per-forward memory, and the
registration with transformers' two interfaces; split, each part would import the others.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from parity.base.errors import UsageError

__all__ = ["KERNEL_NAME", "REFERENCE_NAME", "CORE_NAME", "IMPLS", "ParityAttention", "register", "attach",
           "attention_cores", "kernel_layout"]

KERNEL_NAME = "parity_sparse"
REFERENCE_NAME = "parity_sdpa"
CORE_NAME = "attn_core"
IMPLS = ("kernel", "reference")
# The layout's block sizes. 64: under torch.compile the layout is an element (bit) mask
# (``_traced_layout``), which takes the architecture's small-tile row (64x64 w4 on sm_90); eager
# layouts on 64-row blocks take that same row (``configs.config_for_blocks``: the pinned tile
# does not fit them), so a compiled forward runs the config, and gives the bits, of the eager one.
# On 128-row blocks eager would run sm_90's pinned 128 x 128 tile and compiled the 64-row one.
DEFAULT_BLOCK = 64

# name -> (impl, block_m, block_n) of every implementation register() installed in this process
_REGISTERED: dict[str, tuple[str, int, int]] = {}
# SDPA's enable_gqa (torch 2.5 and later)
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
# transformers' own implementations: register() refuses to replace them.
_BUILTIN_NAMES = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                  "flash_attention_4", "paged|eager")


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise UsageError("parity.integrations.transformers needs transformers: "
                         "pip install 'parity[transformers]'") from err
    return transformers


# ---------------------------------------------------------------------------------------------
# The module that does the math


class ParityAttention(nn.Module):
    """Attention on ``[B, H, S, D]`` tensors with a transformers-style mask, by the kernel or by SDPA.

    forward(query [B, Hq, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, D], attention_mask
    (None, or 4-D bool / additive float [B|1, H|1, Sq, Sk]), *, scaling, sliding_window,
    is_causal, cu_seq_lens_q, cu_seq_lens_k) -> [B, Sq, Hq, D] (transformers' layout).

    ``impl`` (``"kernel"`` or ``"reference"``) and the layout's block sizes are attributes, set
    by the registered attention function before each call, never arguments: a replay of a
    recorded call (``compare --isolate``) runs this host's implementation on the golden inputs.
    It holds no parameters, so attaching it changes no state_dict.
    """

    def __init__(self, impl: str = "reference", *, block_m: int = DEFAULT_BLOCK, block_n: int = DEFAULT_BLOCK):
        super().__init__()
        self.configure(impl, block_m=block_m, block_n=block_n)
        # (head dim, dtype, device, layout) of the last kernel call: its launch config is looked
        # up when asked for (``parity_launch_config``), not in every layer's call
        self._last_call: tuple | None = None

    def configure(self, impl: str, *, block_m: int = DEFAULT_BLOCK, block_n: int = DEFAULT_BLOCK) -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        _check_block("block_m", block_m)
        _check_block("block_n", block_n)
        self.impl, self.block_m, self.block_n = impl, block_m, block_n

    @property
    def parity_launch_config(self) -> dict[str, Any] | None:
        """The launch config of the last kernel call (recorded in bundles), None before any."""
        if self._last_call is None:
            return None
        from parity.kernels import launch_config

        head_dim, dtype, device, layout = self._last_call
        return launch_config(device, head_dim, dtype, layout).to_dict()

    def extra_repr(self) -> str:
        return f"impl={self.impl}, block_m={self.block_m}, block_n={self.block_n}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        scaling: float | None = None,
        sliding_window: int | None = None,
        is_causal: bool = True,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decision = self._decide(query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window,
                                is_causal=is_causal, cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
        return self._execute(decision, query, key, value)

    def _decide(self, query, key, value, attention_mask, *, scaling, sliding_window, is_causal, cu_seq_lens_q,
                cu_seq_lens_k) -> tuple:
        """Every check of a call and what follows from its arguments but q's, k's and v's data:
        ("kernel", layout, scaling) or ("reference", the SDPA call's ``_SdpaPlan``). A call whose
        arguments are those of an earlier one but for q's, k's and v's data gets an equal
        decision (the per-forward step, ``_Step``, keeps it for a forward's later layers)."""
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seq, head_dim]")
        batch, heads_q, seq_q, _ = query.shape
        seq_k = key.shape[2]
        window = _window(sliding_window)
        visible = _visible(attention_mask, batch, heads_q, seq_q, seq_k)
        documents = None
        if visible is None and cu_seq_lens_q is not None:
            if batch != 1:
                raise ValueError(f"cu_seq_lens describe a flattened batch of one row, got batch={batch}")
            documents = _cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, seq_q, seq_k)
        if visible is None and window and not is_causal:
            raise NotImplementedError("a bidirectional sliding window without a mask is not supported")
        if self.impl == "kernel":
            return "kernel", _plan(attention_mask, visible, documents, seq_q, seq_k, is_causal, window, self.block_m,
                                   self.block_n, query.device), scaling
        if documents is not None:
            visible = _document_mask(*documents, batch, seq_q, seq_k, is_causal, window, query.device)
        return "reference", _sdpa_plan(query, key, visible, is_causal, window), scaling

    def _execute(self, decision: tuple, query, key, value) -> torch.Tensor:
        """The call ``decision`` (``_decide``) describes, on these q, k, v: [B, Sq, Hq, D]."""
        if decision[0] == "kernel":
            return self._run_kernel(query, key, value, decision[1], decision[2])
        return _sdpa_run(decision[1], query, key, value, decision[2]).transpose(1, 2).contiguous()

    def _run_kernel(self, query, key, value, layout, scaling, bound=None) -> torch.Tensor:
        """Every kernel call of the integration goes through here: [B, Sq, Hq, D] (transformers'
        layout, contiguous; the kernel's [B, Hq, Sq, D] output transposed).

        A plain call (no config): the launcher picks the pinned config itself and, for the
        layout a forward shares with every layer, reuses one launch plan. The config is only
        reported (``parity_launch_config``, recorded in bundles), looked up when asked for.
        ``bound``: (the plan bound for calls described as this one, ``attention.PlannedCall``;
        the ``_last_call`` such a call records), kept by the forward's step, never made under
        torch.compile; where the plan declines the call (anything the launch depends on
        differs), the call takes the path below."""
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            # the kernel has no backward: its output would be a leaf, and the projections before
            # it would silently get no gradient
            raise NotImplementedError("parity_sparse computes no gradients (a forward-only kernel): run it under "
                                      "torch.no_grad() or torch.inference_mode(), or train with parity_sdpa")
        if bound is not None:
            out = bound[0](query, key, value, heads_last=True)
            if out is not None:  # q's head dim, dtype and device are the bound ones
                self.__dict__["_last_call"] = bound[1]
                return out
        if torch.compiler.is_compiling() or isinstance(layout, tuple):
            # the report is host bookkeeping (a Python dict on the module): it stays what the
            # last eager call recorded, and the graph holds only the operator, on the layout's
            # arguments (_traced_layout; a test runs them eagerly too)
            from parity.kernels.op import operator_call

            return operator_call(query, key, value, layout, sm_scale=scaling).transpose(1, 2).contiguous()
        # holds the layout until the next call; a plain attribute (a tuple), set past nn.Module's
        # __setattr__, which looks for parameters, buffers and modules first (2 us a call)
        self.__dict__["_last_call"] = (query.shape[-1], query.dtype, query.device, layout)
        if type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor:
            out = _sparse_attention()(query, key, value, layout, sm_scale=scaling)  # the operator (a subclass)
            return out.transpose(1, 2).contiguous()
        # the operator's eager call without its wrappers: the launcher's plan for this layout,
        # its plan arguments made once per layout object (every layer of a forward shares it)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = _launcher().planned_attention(query, key, value, layout, _PLANS.arguments(layout), scale)
        return out.transpose(1, 2).contiguous()


@functools.lru_cache(maxsize=None)
def _sparse_attention():
    """``parity.kernels.op.sparse_attention``, imported once (the kernel package imports Triton,
    so not at this module's import; an import statement in every layer's call costs a lookup)."""
    from parity.kernels.op import sparse_attention

    return sparse_attention


@functools.lru_cache(maxsize=None)
def _launcher():
    """``parity.kernels.attention``, the launcher whose plans the integration calls and binds
    (``planned_attention``, ``bind_planned``, ``plan_arguments``), imported once (as ``_sparse_attention``)."""
    from parity.kernels import attention

    return attention


def _check_block(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")


def _window(sliding_window: Any) -> int:
    """transformers passes None (or 0) for full attention, else the window in tokens."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be a non-negative integer or None, got {sliding_window!r}")
    return sliding_window


def _visible(mask: Any, batch: int, heads: int, seq_q: int, seq_k: int) -> torch.Tensor | None:
    """A transformers attention mask as boolean visibility [B|1, H|1, Sq, Sk] (True: attend)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor or None, got {type(mask).__name__} (a flex "
                        "BlockMask? register the parity implementations with parity.integrations."
                        "transformers.register(), which installs their mask function)")
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D [batch, heads, seq_q, seq_k], got shape {list(mask.shape)}")
    mb, mh, mq, mk = mask.shape
    if mb not in (1, batch) or mh not in (1, heads) or mq != seq_q or mk != seq_k:
        raise ValueError(f"attention_mask of shape {list(mask.shape)} does not fit batch={batch}, heads={heads}, "
                         f"seq_q={seq_q}, seq_k={seq_k}")
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"attention_mask must be bool or an additive float mask, got {mask.dtype}")
    # Additive masks (eager): 0 where visible, the dtype's minimum (or -inf) where not; fp16's
    # minimum is the largest such value, also after a cast to a wider dtype. A score bias (any
    # other value) cannot be expressed as a layout: refuse it rather than drop it.
    blocked = mask <= torch.finfo(torch.float16).min
    if bool(((mask != 0) & ~blocked).any()):
        raise ValueError("attention_mask holds additive biases other than 0 and -inf; the kernel applies "
                         "no score bias")
    return ~blocked


def _document_mask(cu_q: torch.Tensor, cu_k: torch.Tensor | None, batch: int, seq_q: int, seq_k: int,
                   causal: bool, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Sq, Sk] visibility of a flattened batch of documents (cumulative lengths ``cu``):
    a query sees only keys of its own document, causally (bottom-right within each document,
    as FlashAttention's varlen API) and within ``window`` when given."""
    if batch != 1:
        raise ValueError(f"cu_seq_lens describe a flattened batch of one row, got batch={batch}")
    cu_q, cu_k = _cu_seq_lens(cu_q, cu_k, seq_q, seq_k)
    cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    q_idx = torch.arange(seq_q, device=device)
    k_idx = torch.arange(seq_k, device=device)
    doc_q = torch.bucketize(q_idx, cu_q[1:], right=True)
    doc_k = torch.bucketize(k_idx, cu_k[1:], right=True)
    visible = doc_q[:, None] == doc_k[None, :]
    if causal:
        # the query's position as a key index: bottom-right within its own document
        pos_q = (q_idx + cu_k[doc_q + 1] - cu_q[doc_q + 1])[:, None]
        visible &= k_idx[None, :] <= pos_q
        if window:
            visible &= k_idx[None, :] > pos_q - window
    return visible[None, None]


def _cu_seq_lens(cu_q: Any, cu_k: Any, seq_q: int, seq_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked cumulative lengths (int64, CPU): start at 0, never decrease, end at Sq / Sk."""
    cu_q = torch.as_tensor(cu_q).reshape(-1).to("cpu", torch.long)
    cu_k = cu_q if cu_k is None else torch.as_tensor(cu_k).reshape(-1).to("cpu", torch.long)
    for name, cu, total in (("cu_seq_lens_q", cu_q, seq_q), ("cu_seq_lens_k", cu_k, seq_k)):
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at {total}, got {cu.tolist()}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k list different numbers of sequences: "
                         f"{cu_q.numel() - 1} and {cu_k.numel() - 1}")
    return cu_q, cu_k


def _bottom_right_mask(seq_q: int, seq_k: int, window: int, device: torch.device) -> torch.Tensor:
    """[Sq, Sk] bool: query i (at key position i + Sk - Sq) sees keys up to itself, and with a
    window the ``window`` keys ending at itself (transformers' sliding-window definition)."""
    pos_q = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)
    k_idx = torch.arange(seq_k, device=device)[None, :]
    visible = k_idx <= pos_q
    if window:
        visible &= k_idx > pos_q - window
    return visible


def _sdpa(query, key, value, visible, scaling, is_causal, window) -> torch.Tensor:
    """The reference: PyTorch SDPA on the same visibility, [B, Hq, Sq, D], rows without keys 0."""
    return _sdpa_run(_sdpa_plan(query, key, visible, is_causal, window), query, key, value, scaling)


@dataclasses.dataclass(frozen=True)
class _SdpaPlan:
    """The reference's SDPA call as it follows from the shapes, the mask and the flags (the same
    for every layer of a forward): the mask SDPA gets, its ``is_causal``, whether it reads the
    shared K/V heads itself (``enable_gqa``) or they are repeated ``repeat`` times, and which
    query rows see a key (``seen``; None: all)."""

    visible: torch.Tensor | None
    causal: bool
    gqa: bool
    repeat: int
    seen: torch.Tensor | None


def _sdpa_plan(query, key, visible, is_causal, window) -> _SdpaPlan:
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    group = heads_q // heads_kv
    sdpa_causal = False
    if visible is None and is_causal:
        if seq_q == seq_k and not window:
            sdpa_causal = True  # top-left == bottom-right
        elif not (seq_q == 1 and (not window or seq_k <= window)):
            visible = _bottom_right_mask(seq_q, seq_k, window, query.device)  # a single query sees every key
    # GQA: query head h reads key/value head h // group, as in the kernel. As transformers' own
    # sdpa does without a mask, SDPA reads the shared K/V heads itself: repeating them would copy
    # the whole KV cache in every layer's call, a decode step's largest memory traffic after the
    # weights. A mask sends SDPA to a backend without GQA, which would repeat them anyway.
    gqa = group > 1 and visible is None and _SDPA_GQA
    repeat = group if group > 1 and not gqa else 1
    # The kernel's convention for a query that sees no key (left padding): 0. SDPA gives NaN or a
    # uniform average there depending on the backend; parity must compare like with like.
    seen = visible.any(dim=-1, keepdim=True) if visible is not None else None
    return _SdpaPlan(visible, sdpa_causal, gqa, repeat, seen)


def _sdpa_run(plan: _SdpaPlan, query, key, value, scaling) -> torch.Tensor:
    """``plan``'s SDPA call on q, k, v: [B, Hq, Sq, D], rows that see no key 0."""
    if plan.repeat > 1:
        key = key.repeat_interleave(plan.repeat, dim=1)
        value = value.repeat_interleave(plan.repeat, dim=1)
    if plan.gqa:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=plan.visible,
                                                               is_causal=plan.causal, scale=scaling, enable_gqa=True)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=plan.visible,
                                                               is_causal=plan.causal, scale=scaling)
    if plan.seen is not None:
        out = torch.where(plan.seen, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


# ---------------------------------------------------------------------------------------------
# Layouts for the kernel (kept here so a change of the builders' signatures is one place)


def kernel_layout(seq_q: int, seq_k: int, *, visible: torch.Tensor | None = None,
                  documents: tuple[torch.Tensor, torch.Tensor] | None = None, is_causal: bool = True,
                  window: int = 0, block_m: int = DEFAULT_BLOCK, block_n: int = DEFAULT_BLOCK,
                  key_padding: torch.Tensor | None = None, offset: int | None = None, device=None):
    """The kernel's layout for one attention call.

    ``visible`` (a mask from transformers, bool [B|1, H|1, Sq, Sk]): key padding under a causal
    mask when it is exactly that (``padding_layout``: 8 bytes per batch element), causal
    documents when it is exactly that (``document_layout``: packed batches, 4 bytes per token),
    with ``window`` (no ``key_padding``) a sliding window on the diagonal ``offset`` (default
    Sk - Sq) when it is exactly that (a predicate: no element-mask bits, the kernel's regular
    path), else the exact element mask (``layout_from_dense_mask``: Sq * Sk / 8 bytes per batch
    element). A recognised layout is used only if its own element visibility equals ``visible``.
    ``key_padding`` (bool [B, Sk]) with ``offset``: the caller built ``visible`` as exactly the
    causal mask with that diagonal (key j visible to query i when j <= i + offset) AND these
    keys (the mask function does), so the layout follows from them without reading ``visible``
    (padding that is not one contiguous run per row falls back to reading it); without
    ``visible`` they are ignored. ``documents`` (cumulative lengths, no mask): ``varlen_layout``,
    or with a window the dense document mask. Neither: bottom-right causal (``window``: sliding
    window), or every key (``is_causal=False``), made on ``device`` (default the CPU).
    """
    from parity.kernels import layout as layouts

    blocks = {"block_m": block_m, "block_n": block_n}
    if visible is not None:
        if key_padding is not None:
            layout = _described_padding_layout(seq_q, seq_k, key_padding, offset, **blocks)
            if layout is not None:
                return layout
        if _window_of(window) and key_padding is None:
            layout = layouts.sliding_window_layout(seq_q, seq_k, window, offset=offset, device=visible.device, **blocks)
            if _same_mask(layout, visible):
                return layout
        return (_padding_layout(visible, **blocks) or _document_layout(visible, **blocks)
                or layouts.layout_from_dense_mask(visible, **blocks))
    if documents is not None:
        if window:
            return layouts.layout_from_dense_mask(
                _document_mask(*documents, 1, seq_q, seq_k, is_causal, window, torch.device("cpu")), **blocks)
        return layouts.varlen_layout(*documents, causal=is_causal, **blocks)
    if not is_causal:
        full = torch.ones(math.ceil(seq_q / block_m), math.ceil(seq_k / block_n), dtype=torch.bool)
        return layouts.layout_from_block_mask(full, seq_q, seq_k, **blocks)
    if window:
        return layouts.sliding_window_layout(seq_q, seq_k, window, align="bottom_right", device=device, **blocks)
    return layouts.causal_layout(seq_q, seq_k, align="bottom_right", device=device, **blocks)


def _described_padding_layout(seq_q: int, seq_k: int, key_padding: torch.Tensor, offset: int, *, block_m: int,
                              block_n: int):
    """``padding_layout`` for keys ``key_padding`` [B, Sk] (bool, True: real) under the causal
    diagonal ``offset``, on the padding's device, when each row's real keys are one run that
    starts at 0 or ends at Sk; None otherwise. One host read (the side)."""
    from parity.kernels import layout as layouts

    keys = key_padding.bool()
    lengths = keys.sum(-1)
    k_idx = torch.arange(seq_k, device=keys.device)
    right = ((k_idx[None, :] < lengths[:, None]) == keys).all()
    left = ((k_idx[None, :] >= (seq_k - lengths)[:, None]) == keys).all()
    every = keys.all()
    is_right, is_left, is_every = torch.stack([right, left, every]).tolist()
    if is_every:
        return layouts.causal_layout(seq_q, seq_k, offset=offset, block_m=block_m, block_n=block_n,
                                     device=keys.device)
    if not (is_right or is_left):
        return None
    return layouts.padding_layout(seq_q, seq_k, lengths, side="right" if is_right else "left", causal=True,
                                  offset=offset, block_m=block_m, block_n=block_n)


class _Plans:
    """The kernel layout of each mask a forward hands its layers, derived once and shared.

    transformers builds a forward's mask once (per kind of layer) and passes that one tensor to
    every layer, so a layout remembered on the tensor (by identity, while it lives and its
    version counter is unchanged) is derived once per forward, not once per layer. The kernel's
    mask function derives it where the padding mask is known (no read of the 4-D mask at all);
    any other mask is classified on its first use. A mask-less (purely causal) call is
    remembered by its shape until the next forward's mask function runs. A replay of one recorded call (``compare --isolate``) hands the
    core a fresh tensor, whose layout is derived from the tensor itself.

    Across forwards, a mask-less decode step's layout is the previous step's with one key more
    (``for_next_keys``): while its tiles stay (``layout.with_keys``, all but one step in
    ``block_n``) the step gets a layout object over the same tensors, so the launcher finds the
    launch plan the previous step built instead of building the layout and the plan again."""

    def __init__(self, shapes: int = 64):
        self._arguments: tuple = (None, None)  # (the last layout a kernel call ran on, its plan arguments)
        self._by_mask: dict[int, tuple] = {}
        self._by_shape: dict[tuple, Any] = {}
        self._moving: dict[tuple, tuple] = {}  # (Sq, window, blocks, device) -> (layout, its version)
        self._shapes = shapes
        self.generation = 0  # forwards started (``new_forward``)

    def arguments(self, layout) -> tuple:
        """The launcher's plan arguments of ``layout`` (``attention.plan_arguments``), made once
        per layout object: the layers of a forward call with one (a layout is immutable but for
        in-place edits of its tensors, which the launcher's plan checks by their version)."""
        last, arguments = self._arguments
        if last is not layout:
            arguments = _launcher().plan_arguments(layout)
            self._arguments = (layout, arguments)
        return arguments

    @staticmethod
    def _version(mask: torch.Tensor):
        try:
            return mask._version
        except RuntimeError:  # an inference-mode tensor has no version counter
            return None

    def for_mask(self, mask: torch.Tensor, key: tuple):
        entry = self._by_mask.get(id(mask))
        if entry is None:
            return None
        ref, version, entry_key, layout = entry
        # an inference-mode mask has no version counter: an edit in place cannot be seen, so its
        # layout is never reused (built again per call: a mask made per forward pays nothing more)
        if ref() is not mask or entry_key != key or version is None or version != self._version(mask):
            return None
        return layout

    def remember_mask(self, mask: torch.Tensor, key: tuple, layout) -> None:
        ident = id(mask)
        by_mask = self._by_mask
        ref = weakref.ref(mask, lambda _ref: by_mask.pop(ident, None) if by_mask.get(ident, (None,))[0] is _ref
                          else None)
        by_mask[ident] = (ref, self._version(mask), key, layout)

    def new_forward(self) -> None:
        """A forward starts (its mask function runs): mask-less layouts are derived again, so
        what one forward remembered never outlives the next forward's mask, and the previous
        forward's step (``_Step``) is not taken again."""
        self._by_shape.clear()
        self.generation += 1

    def for_shape(self, key: tuple):
        return self._by_shape.get(key)

    def remember_shape(self, key: tuple, layout) -> None:
        if len(self._by_shape) >= self._shapes:
            self._by_shape.pop(next(iter(self._by_shape)))  # the oldest
        self._by_shape[key] = layout

    def for_next_keys(self, key: tuple, seq_k: int, offset: int):
        """The last bottom-right causal layout remembered under ``key`` at ``seq_k`` keys and
        diagonal ``offset``, over the same tensors where its tiles stay the same and they were
        not edited in place since; None otherwise."""
        from parity.kernels.layout import with_keys

        slot = self._moving.get(key)
        if slot is None or slot[1] is None or slot[0].version() != slot[1]:
            return None
        return with_keys(slot[0], seq_k, offset)

    def remember_moving(self, key: tuple, layout) -> None:
        if key not in self._moving and len(self._moving) >= self._shapes:
            self._moving.pop(next(iter(self._moving)))  # the oldest
        self._moving[key] = (layout, layout.version())


_PLANS = _Plans()


def _plan(mask: torch.Tensor | None, visible: torch.Tensor | None, documents, seq_q: int, seq_k: int,
          is_causal: bool, window: int, block_m: int, block_n: int, device: torch.device):
    """The layout of one kernel call: remembered for the mask (or the mask-less shape), else
    derived by :func:`kernel_layout` and remembered, on ``device``."""
    blocks = {"block_m": block_m, "block_n": block_n}
    if torch.compiler.is_compiling():
        return _traced_layout(visible, documents, seq_q, seq_k, is_causal, window, device, **blocks)
    if mask is not None:
        key = (block_m, block_n, device)
        layout = _PLANS.for_mask(mask, key)
        if layout is None:
            with _versioned():
                layout = kernel_layout(seq_q, seq_k, visible=visible, window=window, **blocks).to(device)
            _PLANS.remember_mask(mask, key, layout)
        return layout
    if documents is not None:  # cu_seq_lens: already read on the host by their checks
        key = (seq_q, seq_k, is_causal, window, tuple(documents[0].tolist()), tuple(documents[1].tolist()),
               block_m, block_n, device)
    else:
        key = (seq_q, seq_k, is_causal, window, block_m, block_n, device)
    layout = _PLANS.for_shape(key)
    if layout is None:
        # a decode step (one query block, bottom-right causal): the last step's layout, moved
        moving = (seq_q, window, block_m, block_n, device) if documents is None and is_causal and seq_q <= block_m \
            else None
        if moving is not None:
            layout = _PLANS.for_next_keys(moving, seq_k, seq_k - seq_q)
        if layout is None:
            with _versioned():
                layout = kernel_layout(seq_q, seq_k, documents=documents, is_causal=is_causal, window=window,
                                       device=device, **blocks).to(device)
        if moving is not None:
            _PLANS.remember_moving(moving, layout)
        _PLANS.remember_shape(key, layout)
    return layout


def _versioned():
    """Where the integration makes a forward's layout: its tensors as ordinary tensors, also when
    the model runs under ``torch.inference_mode`` (as ``generate`` callers and servers often do).
    Tensors made in inference mode have no version counter, and the launcher reuses a launch plan
    only for a layout whose in-place edits it can count (``BlockLayout.version``): without this,
    every layer of an inference-mode forward would take the launcher's full path."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _traced_layout(visible: torch.Tensor | None, documents, seq_q: int, seq_k: int, is_causal: bool, window: int,
                   device: torch.device, *, block_m: int, block_n: int) -> tuple:
    """The layout of one kernel call under torch.compile, as the kernel operator's layout
    arguments (``layout.dense_mask_arguments``): tensor ops on ``device`` only, shapes that follow
    from the call's shapes, no host read and no ``BlockLayout``/``MaskSpec`` object, so the graph
    holds it without a break (also for torch 2.11's Dynamo, which cannot build those dataclasses
    in a graph) and a CUDA graph can replay it. The mask is classified into tiles as an element
    mask, its bits always kept (recognising padding or documents would read it on the host); a
    mask-less call gets the bottom-right causal (or window, or full) mask made from the shapes.
    Each layer derives it again inside the graph (there is no per-forward memory a graph can
    hold), at the cost of a pass over the mask per layer; the eager path's remembered plans are
    untouched."""
    from parity.kernels import layout as layouts

    if documents is not None:
        raise NotImplementedError("cu_seq_lens without a mask are read on the host; under torch.compile pass "
                                  "the 4-D mask transformers builds from position_ids instead")
    if visible is None:
        if is_causal:
            visible = _bottom_right_mask(seq_q, seq_k, window, device)[None, None]
        else:
            visible = torch.ones(1, 1, seq_q, seq_k, dtype=torch.bool, device=device)
    return layouts.dense_mask_arguments(visible, block_m=block_m, block_n=block_n)


def _padding_layout(visible: torch.Tensor, *, block_m: int, block_n: int):
    """``padding_layout`` for a mask that is exactly bottom-right causal AND one contiguous key
    range per batch row starting at 0 (right padding) or ending at Sk (left padding), the same
    for every head; None for anything else. The candidate is checked against the whole mask."""
    from parity.kernels import layout as layouts

    if visible.shape[1] != 1:
        return None
    seq_q, seq_k = visible.shape[2], visible.shape[3]
    # The last query row is not limited by the causal diagonal: it shows the key padding.
    keys = visible[:, 0, -1].cpu()
    lengths = keys.sum(-1)
    k_idx = torch.arange(seq_k)
    right = (k_idx[None, :] < lengths[:, None]) == keys
    left = (k_idx[None, :] >= (seq_k - lengths)[:, None]) == keys
    if bool(right.all()):
        side = "right"
    elif bool(left.all()):
        side = "left"
    else:
        return None
    layout = layouts.padding_layout(seq_q, seq_k, lengths, side=side, causal=True, align="bottom_right",
                                    block_m=block_m, block_n=block_n)
    return layout if _same_mask(layout, visible) else None


def _document_layout(visible: torch.Tensor, *, block_m: int, block_n: int):
    """``document_layout`` for a mask that is exactly causal within documents laid end to end
    in each batch row (a packed batch), the same for every head; None for anything else."""
    from parity.kernels import layout as layouts

    if visible.shape[1] != 1 or visible.shape[2] != visible.shape[3] or visible.shape[2] < 2:
        return None
    rows = visible[:, 0].cpu()
    idx = torch.arange(rows.shape[1])
    if not bool(rows[:, idx, idx].all()):
        return None
    # A document starts at k where query k does not see key k - 1.
    starts = torch.cat([torch.ones(rows.shape[0], 1, dtype=torch.bool), ~rows[:, idx[1:], idx[:-1]]], dim=1)
    lengths = []
    for row in starts:
        bounds = torch.nonzero(row).flatten().tolist() + [rows.shape[1]]
        lengths.append([end - start for start, end in zip(bounds[:-1], bounds[1:])])
    width = max(len(row) for row in lengths)
    lengths = [row + [0] * (width - len(row)) for row in lengths]  # rows with fewer documents
    layout = layouts.document_layout(lengths, block_m=block_m, block_n=block_n, causal=True)
    return layout if _same_mask(layout, visible) else None


def _same_mask(layout, visible: torch.Tensor) -> bool:
    """Whether ``layout`` shows the kernel exactly the elements ``visible`` does. The builders
    make a tile full only where every element is visible, so the element masks alone (no block
    classes) are what the kernel shows."""
    expected = layout.to(visible.device).element_visible()
    return torch.equal(expected.expand(visible.shape[0], 1, *visible.shape[2:]), visible)


# ---------------------------------------------------------------------------------------------
# Registration with transformers


def attention_cores(model: nn.Module) -> dict[str, ParityAttention]:
    """The attached :class:`ParityAttention` modules of ``model``, by module path."""
    return {name: module for name, module in model.named_modules() if isinstance(module, ParityAttention)}


@functools.lru_cache(maxsize=None)
def _calls_attention_interface(cls: type) -> bool:
    """Whether a module class dispatches through transformers' attention interface (the
    heuristic transformers itself uses to decide whether an implementation can be set)."""
    forward = getattr(cls, "forward", None)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _core_of(module: nn.Module) -> ParityAttention:
    core = module._modules.get(CORE_NAME)
    if core is None:
        core = ParityAttention()
        module.add_module(CORE_NAME, core)
    elif not isinstance(core, ParityAttention):
        raise ValueError(f"{type(module).__name__}.{CORE_NAME} exists and is a {type(core).__name__}, not a "
                         "ParityAttention")
    return core


def attach(model: nn.Module) -> list[str]:
    """Give every attention layer of ``model`` that uses a parity implementation its
    ``attn_core`` child now, configured for that implementation; return the cores' paths.

    Parity records the modules that exist when its recorder is created, before the first
    forward; a core created lazily on first use would be missed. Call it right after building
    the model (a subject's ``build``), with the implementation chosen (``attn_implementation=``
    one of the names :func:`register` returned). Idempotent. Raises ValueError if no attention
    layer of ``model`` uses a registered parity implementation.
    """
    cores, others = [], set()
    for name, module in list(model.named_modules()):
        if isinstance(module, ParityAttention) or not _calls_attention_interface(type(module)):
            continue
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation not in _REGISTERED:
            others.add(str(implementation))
            continue
        impl, block_m, block_n = _REGISTERED[implementation]
        _core_of(module).configure(impl, block_m=block_m, block_n=block_n)
        cores.append(f"{name}.{CORE_NAME}" if name else CORE_NAME)
    if not cores:
        found = f"its attention layers use {', '.join(sorted(others))}" if others else "it has no attention layer"
        raise ValueError(f"nothing to attach to {type(model).__name__}: {found}; build it with "
                         f"attn_implementation= one of {sorted(_REGISTERED) or 'the names register() returns'}")
    return cores


# Keyword arguments of an attention call that the per-forward step does not take (it leaves a
# call that passes any of them to the full path, which refuses or reads them)
_STEP_REFUSES = frozenset(("s_aux", "sinks", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k"))


def _unhooked(core: nn.Module) -> bool:
    """Whether calling ``core`` is calling its class's ``forward`` and nothing else: no forward set
    on the instance, no hook of its own or a global one, not compiled by ``Module.compile``, no torch.jit trace running
    (``nn.Module.__call__``'s own test before it runs hooks). Parity's recorder, profiler and
    timers hook the core: their calls go through the module call."""
    return not ("forward" in core.__dict__  # replaced on the instance (accelerate's hooks, a wrapper)
                or core._forward_hooks or core._forward_pre_hooks or core._backward_hooks or core._backward_pre_hooks
                or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks
                or core._compiled_call_impl is not None or torch._C._get_tracing_state())


class _Step:
    """One forward's attention calls after its first, bound (the plan/run split of FlashInfer's
    decode wrappers): the decision the first call made (``ParityAttention._decide``: every check,
    the layout or the SDPA plan) and, for the kernel, its launch plan bound to the call's
    description of q, k, v (``attention.PlannedCall``).

    A later layer's call takes it where everything its decision follows from is the first call's:
    the same mask tensor (by identity) not edited in place since (its version), the same scaling,
    window, causality and model config, a core of this implementation and block sizes with no
    hook, the same q, k, v shapes (plain tensors) and q's device, for the kernel the forward's mask
    function not run since (``_Plans.generation``). Any difference sends the call through the full
    path (which makes the step again from it). The kernel's bound plan checks the rest of q's,
    k's and v's description (strides, dtypes, alignment), the dispatch state and the layout's
    version itself, and where it declines, the launcher's full path runs the step's layout (which
    follows from none of those). Never made or taken under torch.compile or a jit trace. It keeps
    its decision alive until the attention function's next full-path call: the layout (which
    ``_Plans`` keeps too), and for the reference the mask SDPA gets (the forward's mask, or one
    made from it)."""

    __slots__ = ("impl", "block_m", "block_n", "generation", "config", "mask", "mask_version", "scaling",
                 "window", "causal", "decision", "shapes", "device", "planned")

    def __init__(self, impl, block_m, block_n, config, mask, scaling, window, causal, decision, query, key, value,
                 planned):
        self.impl, self.block_m, self.block_n, self.config = impl, block_m, block_n, config
        self.generation = _PLANS.generation
        self.mask = None if mask is None else weakref.ref(mask)
        self.mask_version = None if mask is None else _Plans._version(mask)
        self.scaling, self.window, self.causal, self.decision = scaling, window, causal, decision
        self.shapes = (query.shape, key.shape, value.shape)
        self.device = query.device
        # the kernel's: (its bound plan, the ``_last_call`` a call through it records)
        self.planned = None if planned is None else (planned, (query.shape[-1], query.dtype, query.device,
                                                                decision[1]))

    def __call__(self, module: nn.Module, query, key, value, attention_mask, scaling, sliding_window, causal):
        """[B, Sq, Hq, D] of the call, or None where the call needs the full path."""
        core = module._modules.get(CORE_NAME)
        if (type(core) is not ParityAttention or core.impl != self.impl or core.block_m != self.block_m
                or core.block_n != self.block_n or not _unhooked(core)
                or scaling != self.scaling or sliding_window != self.window or causal != self.causal
                or getattr(module, "config", None) is not self.config):
            return None
        if attention_mask is None:
            if self.mask is not None:
                return None
        elif (self.mask is None or self.mask() is not attention_mask or self.mask_version is None
              or _Plans._version(attention_mask) != self.mask_version):
            return None  # an unversioned (inference-mode) mask: an edit in place cannot be seen
        # the decision follows from the shapes (the layout from Sq and Sk, the mask's fit from B
        # and H) and the device (the layout's, the reference's masks'; a model split over GPUs
        # makes a step per device); plain tensors only (anything else: the full path checks it and
        # names the problem)
        if (type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor
                or (query.shape, key.shape, value.shape) != self.shapes or query.device != self.device):
            return None
        if self.planned is not None:
            # the kernel: where the bound plan declines the call (another dtype, stride, alignment,
            # stream, an edited layout), the launcher's full path runs the decision's layout
            if self.generation != _PLANS.generation:
                return None
            return core._run_kernel(query, key, value, self.decision[1], self.decision[2], self.planned)
        return core._execute(self.decision, query, key, value)


def _bind_step(impl, block_m, block_n, module, core, decision, query, key, value, attention_mask, scaling,
               sliding_window, causal) -> _Step | None:
    """The step a call's ``decision`` makes for the forward's later layers (``_Step``), None where
    it cannot be bound (a kernel call whose plan ``attention.bind_planned`` does not bind)."""
    planned = None
    if decision[0] == "kernel":
        from parity.kernels.layout import BlockLayout

        layout = decision[1]
        if not isinstance(layout, BlockLayout):
            return None
        scale = query.shape[-1] ** -0.5 if decision[2] is None else decision[2]
        planned = _launcher().bind_planned(query, key, value, _PLANS.arguments(layout), scale)
        if planned is None:
            return None
    return _Step(impl, block_m, block_n, getattr(module, "config", None), attention_mask, scaling, sliding_window,
                 causal, decision, query, key, value, planned)


def _attention_function(impl: str, block_m: int, block_n: int):
    steps: list[_Step | None] = [None]  # this implementation's step of the current forward

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        step = steps[0]
        # is_compiling() first: under torch.compile nothing of the step is traced (torch 2.11's
        # Dynamo cannot evaluate ``frozenset & dict_keys``: the GPU test of reduce-overhead generate)
        if (not torch.compiler.is_compiling() and step is not None and not dropout and softcap is None
                and not (kwargs and _STEP_REFUSES & kwargs.keys())):
            out = step(module, query, key, value, attention_mask, scaling, sliding_window,
                       bool(getattr(module, "is_causal", True) if is_causal is None else is_causal))
            if out is not None:
                return out, None
        if dropout and module.training:
            raise NotImplementedError("parity attention implementations have no dropout; call model.eval()")
        if softcap is not None:
            raise NotImplementedError("parity attention implementations do not support softcap")
        for name in ("s_aux", "sinks", "position_bias"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"parity attention implementations do not support {name}")
        if attention_mask is None:
            _check_mask_function(module)
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        core = _core_of(module)
        if core.impl != impl or core.block_m != block_m or core.block_n != block_n:
            core.configure(impl, block_m=block_m, block_n=block_n)
        options = dict(scaling=scaling, sliding_window=sliding_window, is_causal=causal,
                       cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"))
        steps[0] = None
        if (type(core) is not ParityAttention or torch.compiler.is_compiling() or not _unhooked(core)
                or options["cu_seq_lens_q"] is not None or options["cu_seq_lens_k"] is not None):
            out = core(query, key, value, attention_mask, **options)  # hooks, a subclass, a graph: the module call
        else:  # the module call without hooks is its forward: the decision kept for the next layers
            decision = core._decide(query, key, value, attention_mask, **options)
            out = core._execute(decision, query, key, value)
            steps[0] = _bind_step(impl, block_m, block_n, module, core, decision, query, key, value, attention_mask,
                                  scaling, sliding_window, causal)
        return out, None

    attention.__name__ = f"parity_{impl}_attention"
    attention.__qualname__ = attention.__name__
    return attention


def _check_mask_function(module: nn.Module) -> None:
    """A None mask means "purely causal" only if transformers built masks for this implementation;
    without a registered mask function it passes None for padded batches too."""
    config = getattr(module, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if name is None or name in _REGISTERED:  # register() installed its mask function
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise ValueError(f"attention implementation {name!r} has no mask function, so transformers drops "
                         "padding masks; register it with parity.integrations.transformers.register()")


def _mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask=None, allow_is_causal_skip: bool = True, **kwargs):
    """transformers' ``sdpa_mask`` (4-D bool, or None for a purely causal mask), returning None
    only where it cannot be misread: ``Sq == Sk`` or ``Sq == 1`` (where top-left and bottom-right
    causal agree), and never for a bidirectional mask (None means causal to the kernel)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if isinstance(q_length, int) and q_length not in (1, kv_length):
        allow_is_causal_skip = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _kernel_mask_function(block_m: int, block_n: int):
    """The kernel's mask function: ``_mask_function``'s mask, and where transformers built it as
    causal AND key padding (``causal_mask_function`` and a 2-D padding mask, the common case of a
    padded batch and of decoding), the layout derived from the padding mask, once per forward,
    remembered on the mask tensor that every layer then receives."""
    def mask_function_with_plan(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                                kv_offset: int = 0, mask_function=None, attention_mask=None, **kwargs):
        from transformers.masking_utils import causal_mask_function

        if torch.compiler.is_compiling():  # no remembered plans in a graph: _traced_layout
            return _mask_function(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function,
                                  attention_mask=attention_mask, **kwargs)
        _PLANS.new_forward()
        # an ordinary tensor also under torch.inference_mode (generate's callers, servers): a
        # mask with a version counter is one whose layout every layer can take as unchanged
        # (``_Plans.for_mask``); an inference-mode mask has none, and every layer would classify
        # it and build a launch plan again
        with _versioned():
            mask = _mask_function(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function,
                                  attention_mask=attention_mask, **kwargs)
        plain = mask_function is None or mask_function is causal_mask_function
        if (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and not plain
                and isinstance(q_offset, int) and isinstance(kv_offset, int)):
            window = kwargs.get("local_size")
            if _window_of(window) and _all_keys_real(attention_mask, kv_offset, kv_length):
                # transformers' sliding-window causal mask (``local_size``): its predicate layout,
                # checked against the mask, else the mask's own classification. A decode step's
                # predicate is the last step's moved (``for_next_keys``: the same tensors while its
                # tiles stay, so the launcher finds the plan it built), still checked against
                # this step's mask.
                offset = q_offset - kv_offset
                moving = ("window-mask", q_length, window, block_m, block_n, mask.device) if q_length <= block_m \
                    else None
                layout = _PLANS.for_next_keys(moving, kv_length, offset) if moving is not None else None
                if layout is None or not _same_mask(layout, mask):
                    with _versioned():
                        layout = kernel_layout(q_length, kv_length, visible=mask, window=window, offset=offset,
                                               block_m=block_m, block_n=block_n).to(mask.device)
                    if moving is not None and layout.kind == f"window{window}" and not layout.element_masks:
                        _PLANS.remember_moving(moving, layout)
                _PLANS.remember_mask(mask, (block_m, block_n, mask.device), layout)
            return mask
        if (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and plain and isinstance(q_offset, int)
                and isinstance(kv_offset, int)):
            if attention_mask is None:
                padding = torch.ones(1, kv_length, dtype=torch.bool, device=mask.device)
            elif attention_mask.dim() == 2:
                # transformers' padding_mask_function: key j reads the 2-D mask at j + kv_offset,
                # past its end is padding
                padding = attention_mask.bool()[:, kv_offset:kv_offset + kv_length].to(mask.device)
                if padding.shape[1] < kv_length:
                    padding = torch.nn.functional.pad(padding, (0, kv_length - padding.shape[1]))
            else:
                return mask
            with _versioned():
                layout = kernel_layout(q_length, kv_length, visible=mask, key_padding=padding.expand(batch_size, -1),
                                       offset=q_offset - kv_offset, block_m=block_m, block_n=block_n).to(mask.device)
            _PLANS.remember_mask(mask, (block_m, block_n, mask.device), layout)
        return mask

    return mask_function_with_plan


def _window_of(window: Any) -> int:
    """A window transformers passed (``local_size``, ``sliding_window``) as a positive int, else 0."""
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0


def _all_keys_real(attention_mask: torch.Tensor | None, kv_offset: int, kv_length: int) -> bool:
    """Whether the 2-D padding mask (None: no padding) marks every key of [kv_offset, kv_offset +
    kv_length) as real: one host read."""
    if attention_mask is None:
        return True
    if attention_mask.dim() != 2:
        return False
    keys = attention_mask[:, kv_offset:kv_offset + kv_length]
    return keys.shape[1] == kv_length and bool(keys.bool().all())


def register(name: str = KERNEL_NAME, *, reference_name: str = REFERENCE_NAME, block_m: int = DEFAULT_BLOCK,
             block_n: int = DEFAULT_BLOCK) -> tuple[str, str]:
    """Register the kernel as ``attn_implementation=name`` and SDPA on the same mask and module
    as ``attn_implementation=reference_name``, each with its mask function; return both names.

    ``block_m``/``block_n``: the layout's block sizes (powers of two >= 16). Idempotent; calling
    it again with other block sizes replaces the registration. Refuses transformers' own names.
    """
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for label, value in (("name", name), ("reference_name", reference_name)):
        if not isinstance(value, str) or not value or value in _BUILTIN_NAMES or "/" in value:
            raise ValueError(f"{label} must be a new attention implementation name, got {value!r}")
    if name == reference_name:
        raise ValueError(f"name and reference_name must differ, got {name!r} twice")
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    for impl, key in (("kernel", name), ("reference", reference_name)):
        AttentionInterface.register(key, _attention_function(impl, block_m, block_n))
        AttentionMaskInterface.register(key, _kernel_mask_function(block_m, block_n) if impl == "kernel"
                                        else _mask_function)
        _REGISTERED[key] = (impl, block_m, block_n)
    return name, reference_name
