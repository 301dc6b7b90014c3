"""The kernel as a PyTorch operator (kernels/op.py): ``torch.library.opcheck``, torch.compile with
``fullgraph=True`` (bit for bit the eager call), CUDA-graph capture and ``mode="reduce-overhead"``
on a GPU."""
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from parity.kernels import causal_layout, document_layout, padding_layout, sliding_window_layout
from parity.kernels.op import op_arguments, sparse_attention
from parity.kernels.testing import random_qkv

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (name, Sq, Sk, layout builder): prefill with each kind of mask the operator carries, decode sizes
CASES = {
    "prefill-causal": (48, 48, lambda sq, sk: causal_layout(sq, sk, block_m=16, block_n=16)),
    "prefill-window": (40, 56, lambda sq, sk: sliding_window_layout(sq, sk, 20, block_m=16, block_n=16)),
    "prefill-documents": (48, 48, lambda sq, sk: document_layout([20, 28], block_m=16, block_n=16)),
    "decode-causal": (1, 70, lambda sq, sk: causal_layout(sq, sk, block_m=16, block_n=16)),
    "decode-padding": (2, 64, lambda sq, sk: padding_layout(sq, sk, [64, 30], side="left", block_m=16,
                                                            block_n=16)),
}


def _problem(case, dtype, device, seed=0, batch=2):
    seq_q, seq_k, build = CASES[case]
    q, k, v = random_qkv(batch, 4, 2, seq_q, seq_k, 32, DTYPES[dtype], seed, device)  # GQA 2:1
    return q, k, v, build(seq_q, seq_k).to(device)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_opcheck(case, dtype, device):
    """opcheck: the schema (no mutation, no aliasing), the fake implementation against the real
    one (shapes, strides, dtypes), and AOT dispatch with static and dynamic shapes; with and
    without the LSE."""
    q, k, v, layout = _problem(case, dtype, device)
    for return_lse in (False, True):
        result = torch.library.opcheck(torch.ops.parity.block_sparse_attention.default,
                                       op_arguments(q, k, v, layout, 32 ** -0.5, return_lse))
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("case", list(CASES))
def test_the_operator_computes_the_launchers_bits(case, device):
    """The operator, the wrapper's eager path (the launcher) and the launcher itself agree bit for
    bit, LSE included; an empty LSE stands for "not asked for"."""
    from parity.kernels import block_sparse_attention

    q, k, v, layout = _problem(case, "bf16", device)
    want, want_lse = block_sparse_attention(q, k, v, layout, return_lse=True, launch_cache=False)
    out, lse = torch.ops.parity.block_sparse_attention.default(*op_arguments(q, k, v, layout, 32 ** -0.5, True))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    out, none = torch.ops.parity.block_sparse_attention.default(*op_arguments(q, k, v, layout, 32 ** -0.5, False))
    assert torch.equal(out, want) and none.numel() == 0 and none.dtype == torch.float32
    got, got_lse = sparse_attention(q, k, v, layout, return_lse=True)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("case", ["prefill-window", "prefill-documents", "decode-padding"])
def test_compiled_fullgraph_equals_eager_bit_for_bit(case, device):
    """torch.compile(fullgraph=True) of a function around the operator (a projection before, a
    residual after, as a layer has): no graph break, and the bits of the eager function; the
    compiled function is called twice with new inputs (its second call reuses the graph)."""
    torch._dynamo.reset()

    def layer(q, k, v, layout):
        out, lse = sparse_attention(q * 0.5, k, v, layout, return_lse=True)
        return out + q, lse

    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    for seed in range(2):
        q, k, v, layout = _problem(case, "fp16", device, seed=seed)
        want, want_lse = layer(q, k, v, layout)
        got, got_lse = compiled(q, k, v, layout)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse), seed


def test_compiled_with_inductor_on_cpu_equals_eager(device):
    """Inductor's own CPU code around the opaque operator (the default backend): the same bits."""
    if device.type != "cpu":
        pytest.skip("the CPU case; the GPU one is test_compiled_fullgraph_equals_eager_bit_for_bit")
    torch._dynamo.reset()
    q, k, v, layout = _problem("prefill-causal", "fp32", device)

    def attend(q, k, v):
        return sparse_attention(q, k, v, layout)

    assert torch.equal(torch.compile(attend, fullgraph=True)(q, k, v), attend(q, k, v))


def test_the_wrapper_traces_to_the_operator(device):
    """Under tracing the wrapper's call is the operator (what graphs hold), once, opaque."""
    q, k, v, layout = _problem("prefill-causal", "fp16", device)
    gm, _ = torch._dynamo.export(lambda q, k, v: sparse_attention(q, k, v, layout))(q, k, v)
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.parity.block_sparse_attention.default) == 1


class _Allocations(TorchDispatchMode):
    """Every tensor an op made in new memory while the mode was on (held, so that no address is
    reused while a test compares them)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.made += [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)
                      and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in inputs]
        return result


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_the_operator_keeps_nothing_it_allocated(case, return_lse, device):
    """What CUDA-graph trees (torch.compile mode="reduce-overhead") require of a recorded
    operator: once it returns, no tensor it allocated is alive but its outputs. The launch caches'
    entries are walked for any tensor in memory the call allocated (the LSE stand-in of a call
    without the LSE, a reordered tile list, a converted layout tensor); the first call builds the
    plan, the second is its hit."""
    from parity.kernels import attention, op

    attention._LAUNCH_CACHES.clear()
    q, k, v, layout = _problem(case, "fp32", device)
    for call in range(2):
        with _Allocations() as allocations:
            # the implementation itself: a mode sees the operator's call, not the ops inside it
            out, lse = op._implementation(*op_arguments(q, k, v, layout, 32 ** -0.5, return_lse))
        made = {t.untyped_storage().data_ptr() for t in allocations.made} - {
            out.untyped_storage().data_ptr(), lse.untyped_storage().data_ptr()}
        assert len(allocations.made) > 1, "the mode saw the call's allocations"
        held = [t for cache in attention._LAUNCH_CACHES.values() for _, entries in cache._by_layout.values()
                for entry in entries.values()
                for t in [value for bound in entry.steps for value in bound.values] + list(entry.keep)
                if isinstance(t, torch.Tensor)]
        leaked = [tuple(t.shape) for t in held if t.untyped_storage().data_ptr() in made]
        assert leaked == [], (call, leaked)
    path = attention._plan_path(q.shape[2], layout.block_m)
    # the operator's decode plans live apart from a plain call's (they make their workspace per hit)
    cache = attention._launch_cache("decode-borrowed" if path == "decode" else path)
    planned = cache.hits > 0  # a layout whose launch reorders or converts its tensors is not planned
    assert planned == (not (layout.has_doc or layout.has_bits)), (cache.hits, cache.misses)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill-causal", "prefill-documents", "decode-causal", "decode-padding"])
def test_gpu_cuda_graph_capture_replays_the_eager_bits(case):
    """The wrapper captured in a CUDA graph (nothing reads the device from the host), replayed on
    new inputs copied into the captured ones: the eager bits of those inputs."""
    device = torch.device("cuda")
    q, k, v, layout = _problem(case, "bf16", device)  # the padding layout is for batch 2
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sparse_attention(q, k, v, layout)  # warm-up: compiles and plans off the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = sparse_attention(q, k, v, layout)
    for seed in (1, 2):
        nq, nk, nv, _ = _problem(case, "bf16", device, seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, sparse_attention(nq, nk, nv, layout)), seed


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill-window", "decode-causal"])
def test_gpu_reduce_overhead_equals_eager(case):
    """torch.compile(mode="reduce-overhead", fullgraph=True): CUDA-graph trees around the operator,
    the eager bits on every call (the first calls record, later ones replay)."""
    torch._dynamo.reset()
    device = torch.device("cuda")

    def layer(q, k, v, layout):
        return sparse_attention(q, k, v, layout) + q

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):
        q, k, v, layout = _problem(case, "bf16", device, seed=seed, batch=4)
        got = compiled(q, k, v, layout).clone()
        assert torch.equal(got, layer(q, k, v, layout)), seed
