"""A decode step of a compressed cache makes no more host synchronisations than plain transformers'.

On a GPU every op that reads device data back to the host (``.item()`` / ``int(t)`` / ``bool(t)`` /
``.tolist()``, ``nonzero``, boolean-mask indexing, ``repeat_interleave`` with tensor repeats and no
``output_size``, ``unique``, a device-to-host copy) drains the GPU's queue, so a decode step costs
host time plus device time instead of the larger of the two (issue 39).  The runtime keeps its
host-side bookkeeping (per-segment lengths, offsets, capacities) as a numpy mirror that never goes
through torch's dispatcher, so here on the CPU, where host tables and buffers are both CPU tensors,
every synchronising op counted is one that would read a GPU tensor back: the count is honest.

One decode step = one ``model(...)`` forward of one new token per row with the cache, after
prefill + compression and a few warm-up steps, taken at a step that does not regrow the storage
(a repack: every few dozen steps, building the page tables once per storage generation).  Counted:

* the synchronising aten ops, through a ``TorchDispatchMode``;
* Python-level host reads that never reach the dispatcher on a CPU tensor (``tolist``, ``numpy``,
  ``cpu``, ``.to(<device>)``), through a ``TorchFunctionMode``;
* every aten op dispatched (the issue's second bar: the flagship's at most 1.3x plain's on the embedded
  model, asserted there; printed for the others).

Cases: plain transformers (DynamicCache), ragged (nothing evicted), ``uniform/keydiff`` (equal
budgets), keydiff with the order-1 correction (the MomentKV merge), decode-time eviction (keydiff's
``evict_every``) on a step with nothing due and on an eviction round (at most one synchronisation
for the whole round), on a tiny random-weight Llama; and the flagship ``inf/leverage+correction`` with
the smoke artifact on the real embedded model.  A sliding-window layer (Mistral's) under the CPU's kernel
reads back once per step which rows left its window: at most one synchronisation per layer (under the
page kernel, a GPU's for such layers, it hides them and reads nothing: tests/test_window_hiding.py).
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from conftest import make_tiny_llama
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from runtime import CompressionPolicy
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.cache import RaggedCache
from runtime.kv_store.transformers_compat import cache_argument
from runtime.serve.generation import compress_prompt

# aten ops whose output is sized by, or is, device data read back to the host
_DATA_DEPENDENT = {
    "_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
# Tensor methods that read a tensor to the host without dispatching an aten op on a CPU tensor
# (``numpy()`` / ``__array__`` of a device tensor raise: a host table's numpy view is no read)
_HOST_READS = {"tolist", "cpu"}


class SyncCounter(TorchDispatchMode):
    """Counts every aten op dispatched (``ops``; ``names``: by op name) and the synchronising ones
    (``syncs``, by name)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.names: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops += 1
        self.names[name] += 1
        if name in _DATA_DEPENDENT:
            self.syncs[name] += 1
        elif name in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.syncs[f"{name} (boolean mask)"] += 1
        elif name == "repeat_interleave":
            repeats = args[0] if func._overloadname == "Tensor" else (args[1] if len(args) > 1 else None)
            output_size = kwargs.get("output_size", args[3] if len(args) > 3 else None)
            if isinstance(repeats, torch.Tensor) and output_size is None:
                self.syncs["repeat_interleave (tensor repeats)"] += 1
        elif name in ("_to_copy", "copy_"):
            source = args[1] if name == "copy_" else args[0]
            target = args[0].device if name == "copy_" else kwargs.get("device", source.device)
            if torch.device(target) != source.device:
                self.syncs[f"{name} (across devices)"] += 1
        return func(*args, **kwargs)


class HostReadCounter(TorchFunctionMode):
    """Counts host reads of tensors that a CPU tensor serves without an aten op (``tolist``, ``cpu``)
    and every ``.to()`` given a device (on a CPU both sides are CPU tensors, so every one counts: a
    host table reaches the device through :func:`runtime.math.arrays.to_device`, which is no op on a CPU
    and a non-blocking copy from pinned memory on CUDA)."""

    def __init__(self):
        super().__init__()
        self.reads: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.reads[name] += 1
        elif name in ("to", "cuda") and (
            "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])
        ):
            self.reads[f"{name}(device)"] += 1
        return func(*args, **kwargs)


def _generations(cache) -> tuple:
    if not isinstance(cache, RaggedCache):
        return ()
    return tuple(layer.store.generation for layer in cache.attention_layers)


@torch.no_grad()
def steady_step(model, cache, columns: torch.Tensor, modes, *, warmup: int = 3, tries: int = 40) -> tuple:
    """The dispatch / function modes (``modes()`` makes a fresh tuple for every step, entered in order)
    of one decode step of ``model`` over ``cache``: ``warmup`` steps, then the first step that does
    not repack the storage; ``columns [B, n]`` are the tokens fed, one column a step."""
    ragged = isinstance(cache, RaggedCache)
    context = ragged_attention(model) if ragged else contextlib.nullcontext()
    with context:
        for column in range(warmup + tries):
            before = _generations(cache)
            active = modes()
            with contextlib.ExitStack() as stack:
                for mode in active:
                    stack.enter_context(mode)
                model(columns[:, column : column + 1], **cache_argument(model, cache), use_cache=True)
            if column >= warmup and _generations(cache) == before:
                return active
    raise AssertionError(f"every one of {tries} decode steps repacked the storage")


def decode_step_counts(model, cache, columns: torch.Tensor, *, warmup: int = 3, tries: int = 40):
    """``(syncs, ops)`` of one decode step (:func:`steady_step`; see the module docstring).  ``syncs``
    counts by op name (aten and host reads)."""
    reads, counter = steady_step(
        model, cache, columns, lambda: (HostReadCounter(), SyncCounter()), warmup=warmup, tries=tries
    )
    return counter.syncs + reads.reads, counter.ops


def _plain_cache(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_argument(model, cache), use_cache=True)
    return cache


def _compressed(model, ids: torch.Tensor, policy, calibration=None) -> RaggedCache:
    with ragged_attention(model):
        cache, _ = compress_prompt(model, ids, policy, context_columns=ids.shape[1] - 1, calibration=calibration)
    return cache  # the prompt's last column is left to feed: the first decode step


def _total(syncs: collections.Counter) -> int:
    return sum(syncs.values())


TINY_POLICIES = {
    "ragged (nothing evicted)": None,
    "uniform/keydiff": CompressionPolicy(compression_ratio=0.75, scorer="keydiff"),
    "uniform/keydiff+correction1": CompressionPolicy(compression_ratio=0.75, scorer="keydiff", correction="order1"),
    "decode-time eviction, nothing due": CompressionPolicy(compression_ratio=0.75, scorer="keydiff", evict_every=64),
}


@pytest.fixture(scope="module")
def tiny_setup():
    model = make_tiny_llama(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = torch.randint(3, 128, (2, 240), generator=torch.Generator().manual_seed(3))
    return model, ids[:, :192], ids[:, 191:]


@pytest.fixture(scope="module")
def tiny_plain_counts(tiny_setup):
    model, prompt, decode = tiny_setup
    return decode_step_counts(model, _plain_cache(model, prompt[:, :-1]), decode)


@pytest.mark.parametrize("name", list(TINY_POLICIES))
def test_a_decode_step_synchronises_no_more_than_plain_transformers(name, tiny_setup, tiny_plain_counts, one_thread):
    model, prompt, decode = tiny_setup
    plain_syncs, plain_ops = tiny_plain_counts
    syncs, ops = decode_step_counts(model, _compressed(model, prompt, TINY_POLICIES[name]), decode)
    print(f"{name}: {_total(syncs)} syncs {dict(syncs)}, {ops} aten ops ({ops / plain_ops:.2f}x plain's {plain_ops})")
    assert _total(syncs) <= _total(plain_syncs), f"{name}: {dict(syncs)} vs plain's {dict(plain_syncs)}"


@pytest.mark.parametrize("correction", ["none", "order1"])
@torch.no_grad()
def test_a_decode_time_eviction_round_synchronises_at_most_once(correction, tiny_setup, tiny_plain_counts, one_thread):
    """keydiff with ``evict_every=4`` (and with the order-1 correction, whose sums the round changes):
    the step in which every layer cuts its heads back to their budgets, together with the step
    after it (which rebuilds the correction from the new sums), synchronises at most once beyond
    plain's two steps (issue 39: once per eviction round; the NaN check of every layer's scores is
    read back once, when the step's last layer has attended)."""
    model, prompt, decode = tiny_setup
    plain_syncs, _ = tiny_plain_counts
    policy = CompressionPolicy(compression_ratio=0.75, scorer="keydiff", evict_every=4, correction=correction)
    cache = _compressed(model, prompt, policy)
    layers = len(cache.layers)
    counted: collections.Counter = collections.Counter()
    ops = 0
    rounds = 0
    with ragged_attention(model):
        for column in range(decode.shape[1]):
            before = [layer.length.clone() for layer in cache.layers]
            counter, reads = SyncCounter(), HostReadCounter()
            with reads, counter:
                model(decode[:, column : column + 1], **cache_argument(model, cache), use_cache=True)
            evicted = sum(bool((layer.length < b).any()) for layer, b in zip(cache.layers, before, strict=True))
            if rounds:  # the step after the round
                counted += counter.syncs + reads.reads
                ops += counter.ops
                break
            if evicted == layers:
                rounds, counted, ops = 1, counter.syncs + reads.reads, counter.ops
        else:
            raise AssertionError("no step evicted in every layer")
    print(f"eviction round ({correction}) and the next step: {_total(counted)} syncs {dict(counted)}, {ops} aten ops")
    assert _total(counted) <= 2 * _total(plain_syncs) + 1, f"{dict(counted)} over {layers} layers"


@pytest.mark.parametrize("kernel", ["", "pages"])
def test_a_sliding_window_layer_synchronises_once_per_decode_step_or_not_at_all(kernel, one_thread, monkeypatch):
    """A sliding-window layer drops, after every step, the rows its next query cannot see; which
    rows depends on the stored positions, read once per layer and step (the kept counts), and on
    nothing else: at most one synchronisation per layer beyond plain transformers' step.  Under the
    page kernel (a GPU's for such layers) it hides them on the device instead (tests/test_window_hiding.py):
    none beyond plain's."""
    from tiny_architectures import make_tiny

    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, kernel)
    model = make_tiny("mistral-sw")
    ids = torch.randint(3, 100, (1, 240), generator=torch.Generator().manual_seed(3))
    prompt, decode = ids[:, :192], ids[:, 191:]
    plain_syncs, _ = decode_step_counts(model, _plain_cache(model, prompt[:, :-1]), decode)
    policy = CompressionPolicy(compression_ratio=0.75, scorer="keydiff")
    syncs, ops = decode_step_counts(model, _compressed(model, prompt, policy), decode)
    layers = model.config.num_hidden_layers
    name = kernel or "default"
    print(f"sliding window [{name}]: {_total(syncs)} syncs {dict(syncs)}, {ops} aten ops; plain {dict(plain_syncs)}")
    assert _total(syncs) <= _total(plain_syncs) + (0 if kernel == "pages" else layers), dict(syncs)


@pytest.mark.parametrize("correction", ["none", "order1"])
def test_learned_attention_sinks_add_no_synchronisation(correction, one_thread):
    """gpt-oss's learned sinks (every layer full here) are one factor per query from each kernel's
    log-sum-exp: a decode step of keydiff at 75% evicted, with and without the order-1 correction,
    synchronises no more than the same model's plain step (its experts' routing reads back in both)."""
    from test_attention_sinks import gpt_oss

    _keydiff_step_against_plain(gpt_oss(layer_types=["full_attention"] * 4), 256, correction, "sinks")


def _keydiff_step_against_plain(model, vocabulary: int, correction: str, name: str) -> None:
    """A decode step of ``model`` (a 192-token prompt of two rows) under keydiff at 75% evicted with
    ``correction`` synchronises no more than the same model's plain step."""
    ids = torch.randint(3, vocabulary, (2, 240), generator=torch.Generator().manual_seed(3))
    prompt, decode = ids[:, :192], ids[:, 191:]
    plain_syncs, plain_ops = decode_step_counts(model, _plain_cache(model, prompt[:, :-1]), decode)
    policy = CompressionPolicy(compression_ratio=0.75, scorer="keydiff", correction=correction)
    syncs, ops = decode_step_counts(model, _compressed(model, prompt, policy), decode)
    print(f"{name} ({correction}): {_total(syncs)} syncs {dict(syncs)}, {ops} aten ops; plain {dict(plain_syncs)}")
    assert _total(syncs) <= _total(plain_syncs), f"{dict(syncs)} vs plain's {dict(plain_syncs)}"


@pytest.mark.parametrize("correction", ["none", "order1"])
def test_a_hybrid_models_recurrent_layers_add_no_synchronisation(correction, one_thread):
    """A tiny Qwen3.5 (tests/test_hybrid_models.py: Gated DeltaNet layers 0 and 2, attention layers 1 and 3): a
    decode step of keydiff at 75% evicted, with and without the order-1 correction, synchronises no more than the
    same model's plain step; the recurrent layers' own ops are transformers' in both."""
    from test_hybrid_models import hybrid, serves_hybrids

    serves_hybrids()
    _keydiff_step_against_plain(hybrid(), 500, correction, "hybrid")


@pytest.mark.parametrize("correction", ["none", "order1"])
def test_gemma4s_sliding_layers_held_apart_add_no_synchronisation(correction, one_thread, monkeypatch):
    """A tiny Gemma 4 (tests/test_gemma4.py: sliding layers 0 and 2 held apart in kvcal's own layers, full layers 1
    and 3 of another geometry evicted), prompts past the window, under the page kernel a GPU runs: a decode step
    synchronises no more than the same model's plain step."""
    from test_gemma4 import gemma4

    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    _keydiff_step_against_plain(gemma4(), 500, correction, "Gemma 4")


@pytest.mark.parametrize("correction", ["none", "order1"])
def test_values_narrower_than_the_keys_add_no_synchronisation(correction, one_thread):
    """A tiny MiMo-V2-Flash (tests/test_mimo_v2_flash.py: values of 24 to keys of 16, sliding layers of other KV heads
    with sinks held apart), its layers on the page kernel (the fused kernels take one head size): a decode step
    synchronises no more than the same model's plain step."""
    import transformers

    if not hasattr(transformers, "MiMoV2FlashForCausalLM"):
        pytest.skip("this transformers has no MiMo-V2-Flash")
    from test_mimo_v2_flash import mimo

    _keydiff_step_against_plain(mimo(vocab_size=512), 500, correction, "MiMo-V2-Flash")


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
@pytest.mark.parametrize("correction", ["none", "order1"])
def test_layers_reading_another_layers_cache_add_no_synchronisation(model_type, correction, one_thread, monkeypatch):
    """Gemma 3n and Gemma 4 whose last two layers read layers 2 and 3's caches (tests/test_kv_sharing.py), under the
    page kernel a GPU runs: a decode step, the readers attending over their sources' evicted caches, synchronises
    no more than the same model's plain step."""
    from test_kv_sharing import sharing

    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    _keydiff_step_against_plain(sharing(model_type), 500, correction, f"{model_type}, KV sharing")


@pytest.mark.parametrize("correction", ["none", "order1"])
def test_a_chunked_layer_adds_no_synchronisation(correction, one_thread):
    """Llama 4 with attention chunks of 64 positions (tests/test_chunked_attention.py; the prompt's 191 tokens
    cross two boundaries, the step measured none): its chunked layers drop their rows only after a step that opens
    a chunk, decided on the host, so a decode step synchronises no more than the model's plain step."""
    from test_rope_forms import _llama4_with_chunks

    _keydiff_step_against_plain(_llama4_with_chunks(64), 256, correction, "Llama 4, chunks of 64")


@pytest.mark.slow
def test_the_flagship_decode_step_on_the_embedded_model(embedded_model, embedded_tokenizer, smoke_artifact, one_thread):
    """The flagship ``inf/leverage+correction`` with the smoke artifact's budgets and correction
    orders, 75% evicted, on the real embedded model (30 layers): no more synchronisations per decode
    step than the unmodified model's; uniform/keydiff too.  The flagship dispatches at most 1.3x the
    unmodified model's aten ops (issue 39's bar; 2949 = 1.35x before the step's positions were
    converted once for all layers and the merge's NaN guard skipped on decode steps, 2832 = 1.30x
    before a one-token append left the page kernel's bias to its first read: 2802 = 1.28x with
    transformers 5.24, 2811 = 1.30x with 5.17, whose plain step dispatches 21 fewer)."""
    from runtime import load_calibration
    from runtime.plan.policy_spec import FLAGSHIP

    model = embedded_model
    ids = torch.randint(3, 1000, (1, 560), generator=torch.Generator().manual_seed(11))
    prompt, decode = ids[:, :512], ids[:, 511:]
    calibration = load_calibration(model, embedded_tokenizer, path=smoke_artifact)
    plain_syncs, plain_ops = decode_step_counts(model, _plain_cache(model, prompt[:, :-1]), decode)
    print(f"plain: {_total(plain_syncs)} syncs {dict(plain_syncs)}, {plain_ops} aten ops")
    for name, policy in {
        "flagship inf/leverage+correction": FLAGSHIP.policy(0.75),
        "uniform/keydiff": CompressionPolicy(compression_ratio=0.75, scorer="keydiff"),
    }.items():
        syncs, ops = decode_step_counts(model, _compressed(model, prompt, policy, calibration), decode)
        print(f"{name}: {_total(syncs)} syncs {dict(syncs)}, {ops} aten ops ({ops / plain_ops:.2f}x plain)")
        assert _total(syncs) <= _total(plain_syncs), f"{name}: {dict(syncs)} vs plain's {dict(plain_syncs)}"
        if name.startswith("flagship"):
            assert ops <= 1.3 * plain_ops, f"{name}: {ops} aten ops per step, plain {plain_ops}"


class KernelAsOneOp(SyncCounter):
    """:class:`SyncCounter` that also keeps the ops' order (``sequence``) and counts a call of the
    forced varlen kernel (:func:`varlen_path_forced`) as one op (one launch on a GPU), not the ops of
    the plain-torch reference standing in for it.  ``KernelAsOneOp.active``: the one entered now."""

    active: KernelAsOneOp | None = None

    def __init__(self):
        super().__init__()
        self.muted = False
        self.sequence: list[str] = []

    def __enter__(self):
        KernelAsOneOp.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        KernelAsOneOp.active = None
        return super().__exit__(*exc)

    def note(self, name: str) -> None:
        self.ops += 1
        self.names[name] += 1
        self.sequence.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.muted:
            return func(*args, **(kwargs or {}))
        self.sequence.append(func.overloadpacket.__name__)
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def varlen_path_forced():
    """A GPU's decode and chunk path (one FlashAttention varlen call per layer) taken on this device,
    its kernel the plain-torch reference, counted by the active :class:`KernelAsOneOp` as one op."""
    from runtime.kv_store import layer_attention, varlen_attention

    reference = varlen_attention.reference_varlen

    def kernel(*arguments):
        counter = KernelAsOneOp.active
        if counter is None or counter.muted:
            return reference(*arguments)
        counter.note("flash_varlen")
        counter.muted = True
        try:
            return reference(*arguments)
        finally:
            counter.muted = False

    saved = layer_attention.varlen_serves, varlen_attention.flash_varlen
    layer_attention.varlen_serves = lambda query, store, softcap: True
    varlen_attention.flash_varlen = kernel
    try:
        yield
    finally:
        layer_attention.varlen_serves, varlen_attention.flash_varlen = saved


@pytest.mark.slow
@torch.no_grad()
def test_a_gpu_decode_step_dispatches_about_a_quarter_more_than_plain(embedded_tokenizer, smoke_artifact, one_thread):
    """A GPU's decode step without a CUDA graph is bound by the host (docs/results.md
    R-gpu-decode-2026-11-27), so what it dispatches is its cost: the bf16 embedded model's step on the
    GPU's path (the FlashAttention varlen kernel, forced here with its reference counted as one
    launch) dispatches at most 1.26x plain transformers' bf16 step for the flagship and 1.15x for
    uniform/keydiff, with no more synchronisations (measured: 1.235x and 1.118x with transformers
    5.24, the flagship 1.251x with 5.17; 1.261x and 1.157x before the step's bias and table trims,
    R-decode-host-ops-2026-11-28)."""
    from common.models import load_model
    from runtime import load_calibration
    from runtime.plan.policy_spec import FLAGSHIP

    model = load_model(dtype=torch.bfloat16)  # its own copy: the session's float32 model stays as it is
    calibration = load_calibration(model, embedded_tokenizer, path=smoke_artifact)
    ids = torch.randint(3, 1000, (1, 560), generator=torch.Generator().manual_seed(11))
    prompt, decode = ids[:, :512], ids[:, 511:]
    with varlen_path_forced():
        (plain,) = steady_step(model, _plain_cache(model, prompt[:, :-1]), decode, lambda: (KernelAsOneOp(),))
        for name, policy, bound in (
            ("flagship", FLAGSHIP.policy(0.75), 1.26),
            ("uniform/keydiff", CompressionPolicy(compression_ratio=0.75, scorer="keydiff"), 1.15),
        ):
            cache = _compressed(model, prompt, policy, calibration)
            (counter,) = steady_step(model, cache, decode, lambda: (KernelAsOneOp(),))
            print(f"{name}: {counter.ops} aten ops ({counter.ops / plain.ops:.3f}x plain's {plain.ops})")
            assert counter.names["flash_varlen"] == model.config.num_hidden_layers  # the GPU's path ran
            assert _total(counter.syncs) <= _total(plain.syncs), dict(counter.syncs)
            assert counter.ops <= bound * plain.ops, f"{name}: {counter.ops} aten ops per step, plain {plain.ops}"
