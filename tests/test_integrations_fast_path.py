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


# ---------------------------------------------------------------------------------------------
# The per-forward step: a forward's layers after its first, through the attention function


class _Layer(torch.nn.Module):
    """What the attention function reads from a transformers attention module."""

    def __init__(self, config):
        super().__init__()
        self.config, self.is_causal = config, True


def _layers(count: int) -> list[_Layer]:
    config = type("Config", (), {})()  # no _attn_implementation: a None mask is not refused
    return [_Layer(config) for _ in range(count)]


def _through_function(forwards, impl: str, mode: str, monkeypatch, bound: list | None = None):
    """(outputs, answered, declined): each forward's layers' outputs through a fresh attention
    function in ``mode`` ("step"; "full": no step is ever made; "jit": no step and the launch
    cache off), and how many calls the step answered and how many it declined (sent to the full
    path). ``forwards``: [(modules, [(q, k, v, mask, scaling, edit or None)] per layer)]; each
    forward starts as the mask function starts one. ``bound``: collects, per call of the
    kernel's bound plan, whether it issued the call (False: the launcher's full path took it)."""
    answered, declined = [], []
    original, original_bound = parity_tf._Step.__call__, attention.PlannedCall.__call__

    def counting(self, *args):
        out = original(self, *args)
        (answered if out is not None else declined).append(1)
        return out

    def counting_bound(self, *args, **kwargs):
        out = original_bound(self, *args, **kwargs)
        if bound is not None:
            bound.append(out is not None)
        return out

    outs = []
    with monkeypatch.context() as patch:
        patch.setattr(parity_tf._Step, "__call__", counting)
        patch.setattr(attention.PlannedCall, "__call__", counting_bound)
        patch.setattr(parity_tf, "_PLANS", parity_tf._Plans())
        if mode != "step":
            patch.setattr(parity_tf, "_bind_step", lambda *args: None)
        if mode == "jit":
            patch.setattr(attention, "LAUNCH_CACHE_DEFAULT", False)
        attention._RECENT.clear()
        function = parity_tf._attention_function(impl, BLOCK, BLOCK)
        for module in {id(module): module for modules, _ in forwards for module in modules}.values():
            parity_tf._core_of(module).configure(impl, block_m=BLOCK, block_n=BLOCK)  # as attach() does
        for modules, calls in forwards:
            parity_tf._PLANS.new_forward()
            for module, (q, k, v, mask, scaling, edit) in zip(modules, calls):
                if edit is not None:
                    edit()
                out, _ = function(module, q, k, v, mask, dropout=0.0, scaling=scaling, position_ids=None)
                outs.append(out)
    return outs, len(answered), len(declined)


def _compare_modes(forwards, impl: str, monkeypatch) -> tuple[int, int]:
    """(answered, declined) of the step run; its outputs bit for bit those of the full path and
    of Triton's dispatch (the kernel) or the full path (the reference)."""
    fast, answered, declined = _through_function(forwards, impl, "step", monkeypatch)
    full, full_answered, _ = _through_function(forwards, impl, "full", monkeypatch)
    assert full_answered == 0
    runs = [full] + ([_through_function(forwards, impl, "jit", monkeypatch)[0]] if impl == "kernel" else [])
    for other in runs:
        assert len(fast) == len(other)
        for index, (mine, theirs) in enumerate(zip(fast, other)):
            assert torch.equal(mine, theirs), f"call {index}: the step's output differs from the full path's"
    return answered, declined


def _decode_forwards(steps: int, layers: int, first_keys: int, batch: int = 1, change=None):
    modules = _layers(layers)
    forwards = []
    for step in range(steps):
        seq_k = first_keys + step
        calls = []
        for layer in range(layers):
            q, k, v = _qkv(1000 + 100 * step + layer, batch, 1, seq_k)
            call = [q, k, v, None, DIM ** -0.5, None]
            if change is not None:
                change(step, layer, call)
            calls.append(tuple(call))
        forwards.append((modules, calls))
    return forwards


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_the_step_gives_the_full_paths_bits_over_decode_steps_across_a_key_block(impl, monkeypatch):
    # 4 steps from 14 keys (a key block fills at 16, one starts at 17), 4 layers each: the first
    # layer of each step takes the full path and makes the step, the other three take it
    answered, declined = _compare_modes(_decode_forwards(4, 4, 14, batch=2), impl, monkeypatch)
    assert (answered, declined) == (4 * 3, 3)  # each later step's first call finds the last step's stale


def test_the_step_gives_the_full_paths_bits_over_padded_prefills(monkeypatch):
    modules = _layers(3)
    forwards = []
    for seq, lengths in ((40, (40, 23)), (40, (40, 23)), (33, (33, 7))):
        keys = torch.arange(seq)[None, :] >= (seq - torch.tensor(lengths))[:, None]  # left padding
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & keys[:, None, None, :]
        forwards.append((modules, [(*_qkv(7 * seq + layer, 2, seq, seq), mask, DIM ** -0.5, None)
                                   for layer in range(3)]))
    for impl in ("kernel", "reference"):
        answered, declined = _compare_modes(forwards, impl, monkeypatch)
        # every forward's mask is a new tensor: its first layer declines (the reference's step
        # outlives the forward, the mask identity stops it; the kernel's stops at the generation)
        assert (answered, declined) == (3 * 2, 2), impl


def _misaligned(call):
    k = call[1]
    flat = torch.empty(k.numel() + 1)[1:]  # 4 bytes past a 16-byte boundary
    call[1] = flat.view(k.shape).copy_(k)


def _strided(call):
    k = call[1]
    call[1] = torch.cat([k, k], dim=-1)[..., :DIM]  # the same values, another row stride


CHANGES = {
    # what changes in the middle layer of the second step: the launcher's bound plan declines it
    # (the integration's step holds) or the integration's step declines it
    "alignment": (_misaligned, "plan"),
    "stride": (_strided, "plan"),
    "dtype": (lambda call: call.__setitem__(slice(0, 3), [t.half() for t in call[:3]]), "plan"),
    "scaling": (lambda call: call.__setitem__(4, 0.5), "step"),
    # a shorter cache in one layer (a hybrid cache's sliding layers), the same mask-less call
    "key length": (lambda call: call.__setitem__(slice(1, 3), [t[:, :, :-5].clone() for t in call[1:3]]), "step"),
    "mask": (lambda call: call.__setitem__(3, torch.ones(1, 1, 1, call[1].shape[2], dtype=torch.bool)), "step"),
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_a_layer_that_differs_from_the_steps_first_takes_the_full_path(what, monkeypatch):
    edit, declines = CHANGES[what]

    def change(step, layer, call):
        if step == 1 and layer == 1:
            edit(call)

    forwards = _decode_forwards(2, 3, 20, change=change)
    answered, declined = _compare_modes(forwards, "kernel", monkeypatch)
    bound: list[bool] = []
    _through_function(forwards, "kernel", "step", monkeypatch, bound)
    if declines == "plan":
        # the step answers every layer after a forward's first; its bound plan sends the changed
        # layer to the launcher's full path and issues the next one (as the first layer's)
        assert (answered, declined) == (4, 1)
        assert bound == [True, True, False, True]
    else:
        # step 1: layer 0 declined (a new forward), layer 1 differs (declined; the full path makes
        # a step from it), layer 2 differs from layer 1's step (declined)
        assert (answered, declined) == (2, 3)
        assert bound == [True, True]


def test_a_layout_edited_in_place_in_a_forward_is_launched_as_edited(monkeypatch):
    def edit():  # every key block of the forward's layout dropped: the row sees no key
        layout = parity_tf._PLANS._arguments[0]
        layout.kv_num_blocks.zero_()
        layout.full_kv_num_blocks.zero_()

    forwards = _decode_forwards(1, 3, 40)
    modules, calls = forwards[0]
    calls[2] = (*calls[2][:5], edit)
    outs = {}
    for mode in ("step", "jit"):
        outs[mode], answered, declined = _through_function(forwards, "kernel", mode, monkeypatch)
    for index, (mine, theirs) in enumerate(zip(outs["step"], outs["jit"])):
        assert torch.equal(mine, theirs), f"layer {index}"
    assert torch.count_nonzero(outs["step"][2]) == 0 and torch.count_nonzero(outs["step"][1]) > 0


def test_a_mask_edited_in_place_in_a_forward_gets_its_new_layout(monkeypatch):
    seq = 40
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None].clone()

    def edit():  # the first 20 keys hidden from every query: a new layout
        mask[..., :20] = False

    modules = _layers(3)
    calls = [(*_qkv(layer, 1, seq, seq), mask, DIM ** -0.5, edit if layer == 2 else None) for layer in range(3)]
    for impl in ("kernel", "reference"):
        mask[...] = torch.ones(seq, seq, dtype=torch.bool).tril()
        fast, answered, declined = _through_function([(modules, calls)], impl, "step", monkeypatch)
        mask[...] = torch.ones(seq, seq, dtype=torch.bool).tril()
        full, _, _ = _through_function([(modules, calls)], impl, "full", monkeypatch)
        assert (answered, declined) == (1, 1), impl
        for index, (mine, theirs) in enumerate(zip(fast, full)):
            assert torch.equal(mine, theirs), f"{impl} layer {index}"
    mask[...] = torch.ones(seq, seq, dtype=torch.bool).tril()
    unedited, _, _ = _through_function([(modules, [call[:5] + (None,) for call in calls])], "kernel", "full",
                                       monkeypatch)
    assert not torch.equal(fast[2], unedited[2])  # the edit changes the output: a stale layout would show


def test_another_dispatch_state_and_a_capture_decline_the_bound_plan(monkeypatch):
    # the dispatch state (device, stream, Triton's settings) of layer 2 is another stream's, of
    # layer 3 None (a CUDA graph capturing: Triton dispatches), of layer 4 the first again
    current = [("interpreter",)]

    def switch(state):
        return lambda: current.__setitem__(0, state)

    def change(step, layer, call):
        call[5] = {2: switch(("another stream",)), 3: switch(None), 4: switch(("interpreter",))}.get(layer)

    for path in ("decode", "prefill"):
        monkeypatch.setattr(attention._launch_cache(path), "_state", lambda kernels: current[0])
    forwards = _decode_forwards(1, 6, 20, change=change)
    bound: list[bool] = []
    fast, answered, declined = _through_function(forwards, "kernel", "step", monkeypatch, bound)
    current[0] = ("interpreter",)
    jit, _, _ = _through_function(forwards, "kernel", "jit", monkeypatch)
    for index, (mine, theirs) in enumerate(zip(fast, jit)):
        assert torch.equal(mine, theirs), f"layer {index}"
    # the step takes every layer after the first; its bound plan (layer 0's) issues layer 1, sends
    # layers 2 (another stream: its own plan built there) and 3 (Triton's dispatch) to the
    # launcher's full path, and issues layers 4 and 5 again
    assert bound == [True, False, False, True, True]
    assert (answered, declined) == (5, 0)


def test_a_hooked_core_is_called_as_a_module_in_every_layer(monkeypatch):
    forwards = _decode_forwards(2, 3, 20)
    seen = []
    for module in forwards[0][0]:
        parity_tf._core_of(module).configure("kernel", block_m=BLOCK, block_n=BLOCK)
        module.attn_core.register_forward_hook(lambda core, args, out: seen.append(out.shape))
    fast, answered, declined = _through_function(forwards, "kernel", "step", monkeypatch)
    assert (answered, declined) == (0, 0) and len(seen) == 6  # no step is made for a hooked core


def test_compiling_never_takes_or_makes_a_step(monkeypatch):
    forwards = _decode_forwards(1, 3, 20)
    monkeypatch.setattr(parity_tf, "_bind_step", lambda *args: pytest.fail("a step made while compiling"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    function = parity_tf._attention_function("kernel", BLOCK, BLOCK)
    modules, calls = forwards[0]
    outs = [function(module, *call[:4], scaling=call[4])[0] for module, call in zip(modules, calls)]
    monkeypatch.undo()
    attention._RECENT.clear()
    slow, _, _ = _through_function(forwards, "kernel", "jit", pytest.MonkeyPatch())
    for index, (mine, theirs) in enumerate(zip(outs, slow)):  # the operator's path, run eagerly
        assert torch.equal(mine, theirs), f"layer {index}"


def test_binding_a_plan_counts_no_hit_and_needs_the_launch_cache():
    attention._LAUNCH_CACHES.clear()
    layout = layouts.causal_layout(1, 40, block_m=BLOCK, block_n=BLOCK)
    arguments = attention.plan_arguments(layout)
    q, k, v = _qkv(0, 1, 1, 40)
    assert attention.bind_planned(q, k, v, arguments, 0.25) is None  # no plan yet
    attention.planned_attention(q, k, v, layout, arguments, 0.25)
    cache = attention._launch_cache("decode")
    hits = cache.hits
    bound = attention.bind_planned(q, k, v, arguments, 0.25)
    assert bound is not None and cache.hits == hits
    q2, k2, v2 = _qkv(1, 1, 1, 40)
    assert torch.equal(bound(q2, k2, v2), attention.block_sparse_attention(q2, k2, v2, layout, sm_scale=0.25,
                                                                           launch_cache=False))
    assert bound(*_qkv(2, 1, 1, 41)) is None  # another key length: declined


@pytest.mark.parametrize("seq_q", [1, 40])  # the decode path, the prefill path
def test_a_heads_last_hit_hands_the_kernel_the_output_it_was_built_with(seq_q):
    """Where a plan's hit passes addresses (a compiled kernel; stand-ins here), the bound plan
    allocates the output in transformers' layout [B, Sq, Hq, D] and hands the kernel its address:
    its transpose must have the strides of the output the plan was built with."""
    from bench.launch_overhead import _stubbed_launches

    issued = []
    q, k, v = _qkv(0, 2, seq_q, 40)  # q a transposed view of [B, Sq, Hq, D], as a Llama layer makes it
    layout = layouts.causal_layout(seq_q, 40, block_m=BLOCK, block_n=BLOCK)
    arguments = attention.plan_arguments(layout)
    with _stubbed_launches():
        for path in ("prefill", "decode"):
            attention._launch_cache(path)._issue = lambda compiled, grid, values, state: issued.append(list(values))
        built = attention.planned_attention(q, k, v, layout, arguments, 0.25)  # builds: Triton's (stand-in) launch
        bound = attention.bind_planned(q, k, v, arguments, 0.25)
        assert bound is not None and bound._heads_last is not None
        q2, k2, v2 = _qkv(1, 2, seq_q, 40)
        out = bound(q2, k2, v2, heads_last=True)
        plain = bound(q2, k2, v2)
    assert out.shape == (2, seq_q, HEADS_Q, DIM) and out.is_contiguous()
    assert out.transpose(1, 2).stride() == built.stride() == plain.stride()
    assert len(issued) == 2 and out.data_ptr() in issued[0] and plain.data_ptr() in issued[1]
    position = issued[0].index(out.data_ptr())
    assert issued[1][position] == plain.data_ptr()  # the output's slot, in both calls


def _forwards_with_mask(mask, seq, layers, seeds):
    modules = _layers(layers)
    return modules, [[(*_qkv(seed * 10 + layer, 1, seq, seq), mask, DIM ** -0.5, None) for layer in range(layers)]
                     for seed in seeds]


def test_an_inference_mode_mask_edited_in_place_between_forwards_is_not_served_stale(monkeypatch):
    """An inference tensor has no version counter: a mask edited in place under
    torch.inference_mode cannot be told from the one remembered, so neither the step nor the
    layout kept for the mask is reused (the second forward must be what it gives alone)."""
    # A caller that passes its own 4-D mask (transformers returns it as is, the mask function does
    # not run, so no new generation) under torch.inference_mode and refills it in place between
    # forwards of equal shapes: an inference tensor has no version counter, _Plans._version gives
    # None for both, and the step (reference: across forwards; kernel: no generation bump) is taken.
    seq = 40
    with torch.inference_mode():
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
        # the kernel gets a bool mask; the reference an additive float one (its visibility is a
        # copy made by the step's first call; a bool mask SDPA reads live)
        for impl, start in (("reference", torch.where(causal, 0.0, float("-inf"))), ("kernel", causal)):
            mask = start.clone()
            blocked = float("-inf") if mask.is_floating_point() else False
            modules, (first, second) = _forwards_with_mask(mask, seq, 2, (1, 2))

            def edit():  # the second forward hides the first 20 keys from every query
                mask[..., :20] = blocked

            second = [second[0][:5] + (edit,)] + second[1:]
            for mode in ("step", "full"):
                mask.copy_(start)
                served, _, _ = _through_function([(modules, first), (modules, second)], impl, mode, monkeypatch)
                # the right answer: the second forward alone, on the edited mask, nothing remembered
                right, _, _ = _through_function([(modules, [call[:5] + (None,) for call in second])], impl,
                                                "full", monkeypatch)
                for layer in range(2):
                    assert torch.equal(served[2 + layer], right[layer]), f"{impl} {mode}: layer {layer} served stale"


def test_a_core_forward_replaced_on_the_instance_runs_in_every_layer(monkeypatch):
    """accelerate's add_hook_to_module (or a user's wrapper) sets forward on the instance: the
    step must not bypass it."""
    # _unhooked says "calling core is calling its forward", but an instance attribute forward
    # (accelerate's add_hook_to_module, a user's wrapper) is not looked at: neither the full path
    # (_decide/_execute) nor the step calls it. Before b10d14e the module call did.
    modules = _layers(3)
    seen = []
    for module in modules:
        core = parity_tf._core_of(module)
        core.configure("reference", block_m=BLOCK, block_n=BLOCK)
        original = core.forward

        def wrapped(*args, _original=original, **kwargs):
            seen.append(1)
            return _original(*args, **kwargs)

        core.forward = wrapped
    calls = [(*_qkv(layer, 1, 1, 20), None, DIM ** -0.5, None) for layer in range(3)]
    _through_function([(modules, calls)], "reference", "step", monkeypatch)
    assert len(seen) == 3


def test_the_kernel_path_refuses_inputs_that_need_a_gradient():
    """The kernel has no backward: with grad enabled and q, k or v needing a gradient the call
    refuses (its output would be a leaf, the projections silently without a gradient); under
    no_grad the same call runs."""
    core = parity_tf.ParityAttention("kernel", block_m=BLOCK, block_n=BLOCK)
    q, k, v = (t.clone().requires_grad_() for t in _qkv(0, 1, 32, 32))
    with pytest.raises(NotImplementedError, match="no gradients"):
        core(q, k, v, None, scaling=DIM ** -0.5)
    with torch.no_grad():
        out = core(q, k, v, None, scaling=DIM ** -0.5)
    assert out.shape == (1, 32, q.shape[1], DIM) and torch.isfinite(out).all()
