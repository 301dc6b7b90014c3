"""The integration's per-layer fast path gives the bits of the slow path.

A model's layers call the kernel with one layout and q, k, v of equal shapes: the launcher
remembers each path's last hit with the call's exact description (``attention._planned``,
``_RECENT``) and the integration makes the plan's arguments once per layout object
(``_Plans.arguments``), so a layer's call skips building and looking up the plan's key. What that
skips must still be checked where it can change: a new key length, another alignment, a layout
edited in place. Each case runs several "layers" (fresh q, k, v per call) over several steps
through ``ParityAttention`` three ways, compared bit for bit: the fast path; the launcher's key
built and looked up on every call (the remembered hit never matches); Triton's dispatch of every
call (launch cache off; under the interpreter the cached paths run the kernel from a plan's bound
arguments, so a frozen argument would show as a difference).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from parity.integrations import transformers as parity_tf
from parity.kernels import attention
from parity.kernels import layout as layouts
from parity.kernels.launch_cache import LaunchCache
from parity.kernels.op import _implementation, op_arguments

HEADS_Q, HEADS_KV, DIM, BLOCK = 4, 2, 16, 16


def _core() -> parity_tf.ParityAttention:
    return parity_tf.ParityAttention("kernel", block_m=BLOCK, block_n=BLOCK)


def _qkv(seed: int, batch: int, seq_q: int, seq_k: int, misaligned: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, HEADS_Q, DIM, generator=gen).transpose(1, 2)  # as a Llama layer makes it
    if misaligned:  # k's base 4 bytes past a 16-byte boundary: another specialization of its pointer
        k = torch.randn(batch * HEADS_KV * seq_k * DIM + 1, generator=gen)[1:].view(batch, HEADS_KV, seq_k, DIM)
    else:
        k = torch.randn(batch, HEADS_KV, seq_k, DIM, generator=gen)
    return q, k, torch.randn(batch, HEADS_KV, seq_k, DIM, generator=gen)


def _run(calls, mode: str, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Every call's output in ``mode`` ("fast", "keyed": the remembered hit disabled, "jit": the
    launch cache off), from fresh per-forward memory, and how many calls took the remembered hit."""
    reused = []
    reuse = LaunchCache.reuse

    def counting(self, entry):
        found = reuse(self, entry)
        reused.append(found)
        return found

    with monkeypatch.context() as patch:
        patch.setattr(LaunchCache, "reuse", counting)
        patch.setattr(parity_tf, "_PLANS", parity_tf._Plans())
        if mode == "keyed":
            patch.setattr(attention, "_exact_signature", lambda *args: object())  # equal to nothing
        if mode == "jit":
            patch.setattr(attention, "LAUNCH_CACHE_DEFAULT", False)
        attention._RECENT.clear()
        outs = [call() for call in calls]
    return outs, sum(reused)


def _compare(calls, monkeypatch) -> int:
    """How many calls of the fast run took the remembered hit, the outputs equal in every mode."""
    fast, hits = _run(calls, "fast", monkeypatch)
    keyed, keyed_hits = _run(calls, "keyed", monkeypatch)
    jit, _ = _run(calls, "jit", monkeypatch)
    assert keyed_hits == 0
    for index, (mine, slow, dispatched) in enumerate(zip(fast, keyed, jit)):
        assert torch.equal(mine, slow), f"call {index}: the fast path differs from the keyed lookup"
        assert torch.equal(mine, dispatched), f"call {index}: the fast path differs from Triton's dispatch"
    return hits


def _decode_calls(core, steps: int, layers: int, first_keys: int, batch: int = 1, misaligned_layer: int = -1):
    calls = []
    for step in range(steps):
        seq_k = first_keys + step
        for layer in range(layers):
            q, k, v = _qkv(100 * step + layer, batch, 1, seq_k, misaligned=layer == misaligned_layer)

            def call(q=q, k=k, v=v, new_step=layer == 0):
                if new_step:
                    parity_tf._PLANS.new_forward()  # what the mask function does once per forward
                return core(q, k, v, None, scaling=DIM ** -0.5)
            calls.append(call)
    return calls


def test_decode_layers_and_steps_across_a_key_block_give_the_slow_paths_bits(monkeypatch):
    # 4 steps from 14 keys: a key block fills at 16 and one starts at 17 (new layouts, new plans);
    # 3 layers per step: the second and third find the first's hit
    hits = _compare(_decode_calls(_core(), steps=4, layers=3, first_keys=14, batch=2), monkeypatch)
    # at 15 keys the second and third layer take the first's hit; at 14 (the first plan), 16 and 17
    # keys (a key block fills, one starts) the first layer builds the plan, the second finds it by
    # its key, the third takes the hit
    assert hits == 2 + 1 + 1 + 1


def test_a_layer_with_another_alignment_does_not_take_the_remembered_hit(monkeypatch):
    # the middle layer's k starts 4 bytes past a 16-byte boundary: Triton specializes its pointer
    # on that, so its call must build its own key (and the next layer's again)
    hits = _compare(_decode_calls(_core(), steps=2, layers=3, first_keys=20, misaligned_layer=1), monkeypatch)
    assert hits == 0


def test_padded_prefill_layers_and_a_key_length_change_give_the_slow_paths_bits(monkeypatch):
    core = _core()
    calls = []
    for seq, lengths in ((40, (40, 23)), (40, (40, 23)), (33, (33, 7))):  # the third forward: other key length
        keys = torch.arange(seq)[None, :] >= (seq - torch.tensor(lengths))[:, None]  # left padding
        mask = (torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & keys[:, None, None, :])
        for layer in range(3):
            q, k, v = _qkv(7 * seq + layer, 2, seq, seq)

            def call(q=q, k=k, v=v, mask=mask):
                return core(q, k, v, mask, scaling=DIM ** -0.5)
            calls.append(call)
    # each forward's mask is a new tensor, so a new layout and plan: the first layer builds it, the
    # second finds it by its key, the third takes the hit
    assert _compare(calls, monkeypatch) == 3


def test_a_layout_edited_in_place_between_layers_is_launched_as_edited(monkeypatch):
    core = _core()
    outs = []
    for mode in ("fast", "jit"):
        with monkeypatch.context() as patch:
            if mode == "jit":
                patch.setattr(attention, "LAUNCH_CACHE_DEFAULT", False)
            attention._RECENT.clear()
            edited = layouts.causal_layout(1, 40, block_m=BLOCK, block_n=BLOCK)
            row = []
            for layer in range(3):
                if layer == 2:  # every key block of the query block dropped: the row sees no key
                    edited.kv_num_blocks.zero_()
                    edited.full_kv_num_blocks.zero_()
                q, k, v = _qkv(layer, 1, 1, 40)
                row.append(core._run_kernel(q, k, v, edited, DIM ** -0.5))
            outs.append(row)
    fast, jit = outs
    for index, (mine, dispatched) in enumerate(zip(fast, jit)):
        assert torch.equal(mine, dispatched), f"layer {index}"
    assert torch.count_nonzero(fast[2]) == 0 and torch.count_nonzero(fast[1]) > 0


def _dead_layout_qkv(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("caller", ["plain", "operator"])
def test_a_dead_layouts_tensors_are_freed_after_a_remembered_hit(caller, device):
    """The remembered hit holds its entry weakly: a dead layout's entries, and the layout tensors
    they keep, go with it (CUDA-graph trees check that nothing allocated in their pool outlives
    the calls that own it)."""
    attention._LAUNCH_CACHES.clear()
    attention._RECENT.clear()
    layout = layouts.causal_layout(40, 40, block_m=16, block_n=16, device=device)
    probes = {name: weakref.ref(getattr(layout, name)) for name in ("kv_num_blocks", "kv_indices",
                                                                    "full_kv_num_blocks", "full_kv_indices")}
    for seed in range(2):  # the first call builds the plan, the second is its hit (remembered)
        q, k, v = (t.to(device) for t in _dead_layout_qkv(seed))
        if caller == "plain":
            attention.block_sparse_attention(q, k, v, layout)
        else:
            _implementation(*op_arguments(q, k, v, layout, 0.25, False))
    del layout
    gc.collect()
    alive = sorted(name for name, probe in probes.items() if probe() is not None)
    assert alive == [], f"still alive after the layout died: {alive}"
