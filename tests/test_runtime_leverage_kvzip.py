"""The Compactor leverage scorer ("Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores", arXiv 2507.08143) and KVzip ("KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv 2505.23416) against direct float64 loop
references, through the engine, and on the real embedded model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from scorer_oracles import Head, head_from_cache, layer_inputs, oracle_score, score_one
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from artifacts.fingerprint import attention_layer_indices, attention_numbers
from runtime import CompressionPolicy, RaggedCache, ragged_attention
from runtime.compression.eviction import HeadEvictor
from runtime.compression.kvzip import (
    kvzip_budgets,
    kvzip_compress,
    kvzip_scores,
    reconstruction_chunks,
    with_kvzip_scores,
)
from runtime.compression.prefill import compress, prefill
from runtime.kv_store.transformers_compat import cache_argument
from runtime.math.chunk_attention import ChunkSpec
from runtime.math.rope import rope_cos_sin
from runtime.plan.serving_plan import bind
from runtime.scorers import (
    ALL_QUERIES,
    ChunkAttentionMass,
    KeyRope,
    KVzipScorer,
    KVzipScores,
    LayerInputs,
    LeverageScorer,
    chunked_attention_mass,
    leverage_scores,
    unrotate,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


# -- direct references (float64, loops) -------------------------------------------------------


def naive_leverage(keys: torch.Tensor, phi: torch.Tensor | None = None) -> torch.Tensor:
    """``x_i^T (X^T X)^{-1} x_i`` row by row, ``X`` the column-centred (optionally sketched) keys."""
    x = keys.double()
    mean = sum(x[i] for i in range(x.shape[0])) / x.shape[0]
    x = torch.stack([x[i] - mean for i in range(x.shape[0])])
    if phi is not None:
        x = x @ phi.double()
    inverse = torch.linalg.inv(x.T @ x)
    return torch.stack([x[i] @ inverse @ x[i] for i in range(x.shape[0])])


def naive_chunk_mass(queries, query_positions, keys, key_positions, chunk, scale, origin):
    """Each key's attention from the queries of its own chunk (non-causal softmax over the chunk's keys)."""
    groups = queries.shape[0]
    mass = torch.zeros(keys.shape[0], dtype=torch.float64)
    for g in range(groups):
        for w in range(queries.shape[1]):
            c = (int(query_positions[w]) - origin) // chunk
            members = [i for i in range(keys.shape[0]) if (int(key_positions[i]) - origin) // chunk == c]
            if not members:
                continue
            logits = torch.tensor([scale * float(queries[g, w].double() @ keys[i].double()) for i in members])
            weights = torch.softmax(logits, dim=0)
            for weight, i in zip(weights, members, strict=True):
                mass[i] += weight / groups
    return mass


def naive_compactor(head: Head, blend, chunk, scale, pool, first, last, value_norm=True):
    """LeverageScorer's definition written out (exact leverage of pre-RoPE keys)."""
    n = head.keys.shape[0]
    rows = list(range(first, n - last))
    half = head.keys.shape[1] // 2
    pre = []
    for i in rows:  # undo RoPE with the explicit inverse rotation of each key
        c, s = head.key_cos[i].double(), head.key_sin[i].double()
        k = head.keys[i].double()
        rotated = torch.cat([-k[half:], k[:half]])
        pre.append((k * c - rotated * s) / (c * c + s * s))
    lev = naive_leverage(torch.stack(pre))
    w = head.recent_queries.shape[1]
    qpos = [head.next_position - w + j for j in range(w)]
    kpos = [int(head.positions[i]) for i in rows]
    keep = [j for j in range(w) if kpos[0] <= qpos[j] <= kpos[-1]]
    mass = naive_chunk_mass(
        head.recent_queries[:, keep], [qpos[j] for j in keep], head.keys[rows], kpos, chunk, scale, kpos[0]
    )
    if value_norm:
        mass = mass * torch.stack([head.values[i].double().norm() for i in rows])
    r = pool // 2
    pooled = torch.stack(
        [sum(mass[j] for j in range(i - r, i + r + 1) if 0 <= j < len(rows)) / pool for i in range(len(rows))]
    )

    def z(x):
        return (x - x.mean()) / x.std(unbiased=False)

    return z(pooled) + blend * z(lev)


def _rope(model, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_cos_sin(model, positions)
    rotated, _ = apply_rotary_pos_emb(keys[None, None], keys[None, None], cos[None], sin[None])
    return rotated[0, 0]


# -- leverage -----------------------------------------------------------------------------------


def test_exact_leverage_equals_row_by_row_formula_and_sums_to_the_rank():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(200, 16, generator=generator) * torch.linspace(0.1, 5, 16) + 3.0
    scores = leverage_scores(keys, ridge=1e-12)
    torch.testing.assert_close(scores, naive_leverage(keys), rtol=1e-7, atol=1e-10)
    assert abs(float(scores.sum()) - 16) < 1e-6 and float(scores.min()) >= 0 and float(scores.max()) <= 1


def test_sketched_leverage_is_the_leverage_of_the_sketched_keys():
    keys = torch.randn(150, 32, generator=torch.Generator().manual_seed(1))
    sketch = 12
    phi = torch.randn(32, sketch, generator=torch.Generator().manual_seed(7), dtype=torch.float64) / math.sqrt(sketch)
    scores = leverage_scores(keys, sketch=phi, ridge=1e-12)
    torch.testing.assert_close(scores, naive_leverage(keys, phi), rtol=1e-7, atol=1e-10)
    assert abs(float(scores.sum()) - sketch) < 1e-6
    # a sketch as wide as the keys spans the same column space: exact scores
    wide = torch.randn(32, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64) / math.sqrt(40)
    torch.testing.assert_close(
        leverage_scores(keys, sketch=wide, ridge=1e-12), leverage_scores(keys, ridge=1e-12), rtol=1e-6, atol=1e-9
    )


def test_a_layers_sketch_is_drawn_once_per_device_and_equals_the_per_head_draws():
    """``LeverageScorer.layer_sketch``: every KV head's :meth:`sketch_matrix` stacked ``[1, Hkv, d, k]``,
    on the device asked for, the same tensor on every later call (on CUDA a fresh draw per scoring
    tile was a copy from pageable memory, which waits for the stream); other layers, head counts and
    devices get their own."""
    scorer = LeverageScorer(sketch=12, seed=3)
    sketch = scorer.layer_sketch(2, 4, 16, "cpu")
    assert sketch.shape == (1, 4, 16, 12) and sketch.dtype == torch.float64
    heads = torch.stack([scorer.sketch_matrix(2, h, 16) for h in range(4)])
    torch.testing.assert_close(sketch[0], heads, rtol=0, atol=0)
    assert scorer.layer_sketch(2, 4, 16, torch.device("cpu")) is sketch
    assert not torch.equal(scorer.layer_sketch(1, 4, 16, "cpu"), sketch)
    assert scorer.layer_sketch(2, 3, 16, "cpu").shape == (1, 3, 16, 12)
    on_meta = scorer.layer_sketch(2, 4, 16, "meta")
    assert on_meta.device.type == "meta" and scorer.layer_sketch(2, 4, 16, "meta") is on_meta


def test_key_rope_off_the_cpu_is_computed_without_reading_the_device_back():
    """The keys' RoPE provider memoises on a CPU (positions compared with ``torch.equal``); on any other
    device it computes ``cos, sin`` every time, since the comparison would be a host synchronisation
    per scoring tile on a GPU.  The meta device stands for the GPU (the model built there)."""
    from test_decode_sync import SyncCounter

    from runtime.math.geometry import ModelGeometry
    from runtime.scorers.providers import KeyRopeProvider

    for device in ("cpu", "meta"):
        with torch.device(device):
            model = make_tiny_llama(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
        try:  # transformers 5.2's rotary asks torch's autocast about its device, which knows no meta
            rope_cos_sin(ModelGeometry.of(model), torch.arange(2, device=device), 0)
        except RuntimeError as error:
            if "autocast" not in str(error):
                raise
            pytest.skip(f"this transformers' rotary cannot run on the meta device ({error})")
        provider = KeyRopeProvider(KeyRope(), LeverageScorer(), ModelGeometry.of(model))
        positions = torch.arange(12, device=device).expand(1, 2, 12)
        keys = torch.zeros(1, 2, 12, 16, device=device)
        inputs = LayerInputs(0, keys, keys, positions, positions >= 0, torch.full((1, 2), 12), 1.0, [12])
        ops = SyncCounter()  # every op dispatched, by name
        with ops:
            first = provider(inputs)
            second = provider(inputs)
        assert first.cos.shape == (1, 2, 12, 16) and first.cos.device.type == device
        if device == "cpu":
            assert ops.names["equal"] == 1  # the second call reuses the first's result
            torch.testing.assert_close((first.cos, first.sin), (second.cos, second.sin), rtol=0, atol=0)
        else:
            assert "equal" not in ops.names and "_local_scalar_dense" not in ops.names


def test_masked_leverage_is_the_leverage_of_the_masked_rows():
    """Per head, over a middle mask: the leverage of those rows alone (centred on their own mean)."""
    generator = torch.Generator().manual_seed(9)
    keys = torch.randn(2, 3, 30, 6, generator=generator) + 1.0
    lengths = torch.tensor([[30, 17, 12], [25, 9, 30]])
    first = torch.tensor([[2, 0, 3], [1, 1, 0]])
    row = torch.arange(30)
    mask = (row >= first.unsqueeze(-1)) & (row < lengths.unsqueeze(-1))
    got = leverage_scores(keys, mask, ridge=1e-12)
    for r in range(2):
        for h in range(3):
            rows = mask[r, h]
            torch.testing.assert_close(got[r, h, rows], naive_leverage(keys[r, h, rows]), rtol=1e-6, atol=1e-9)
            assert bool((got[r, h, ~rows] == 0).all())


def test_unrotate_inverts_the_models_rope():
    model = make_tiny_llama(head_dim=16)
    keys = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([0, 1, 5, 17, 100, 333, 1000, 2047, 4000])
    cos, sin = rope_cos_sin(model, positions)
    torch.testing.assert_close(unrotate(_rope(model, keys, positions), cos, sin), keys, rtol=1e-5, atol=1e-5)


def test_chunked_attention_mass_equals_loop_reference():
    generator = torch.Generator().manual_seed(4)
    n, d, groups = 53, 8, 3
    keys = torch.randn(n, d, generator=generator)
    key_positions = torch.arange(10, 10 + n)
    queries = torch.randn(groups, n, d, generator=generator)
    for chunk, scale, origin in [(16, 1.0, 10), (7, 0.35, 12), (100, 1.0, 10)]:
        chunks = torch.div(key_positions - origin, chunk, rounding_mode="floor")  # [n]; -1: before the origin
        got = chunked_attention_mass(
            queries[None, None], chunks[None, None], keys[None, None], chunks[None, None], scale
        )
        want = naive_chunk_mass(queries, key_positions, keys, key_positions, chunk, scale, origin)
        want[key_positions < origin] = 0  # keys before the origin take no part
        got = got[0, 0]
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blend,chunk,scale", [(0.75, 16, 1.0), (0.5, 64, None), (0.1, 5, 0.3)])
def test_leverage_scorer_equals_the_compactor_definition(blend, chunk, scale):
    model = make_tiny_llama(head_dim=16)
    generator = torch.Generator().manual_seed(5)
    n, d, groups = 70, 16, 2
    positions = torch.arange(n)
    keys = _rope(model, torch.randn(n, d, generator=generator) * 2, positions)
    values = torch.randn(n, d, generator=generator)
    queries = torch.randn(groups, n, d, generator=generator)
    cos, sin = rope_cos_sin(model, positions)
    head = Head(
        layer=3,
        kv_head=1,
        keys=keys,
        values=values,
        positions=positions,
        scaling=d**-0.5,
        next_position=n,
        recent_queries=queries,
        key_cos=cos,
        key_sin=sin,
    )
    scorer = LeverageScorer(blend=blend, sketch=None, chunk=chunk, attention_scale=scale, ridge=1e-12)
    got = score_one(scorer, head)
    want = naive_compactor(head, blend, chunk, d**-0.5 if scale is None else scale, 3, 8, 4)
    torch.testing.assert_close(got[8 : n - 4].double(), want, rtol=1e-4, atol=1e-4)
    assert torch.all(got[:8] == got[8 : n - 4].max()) and torch.all(got[n - 4 :] == got[8 : n - 4].max())


def test_leverage_scorer_modes_and_options():
    generator = torch.Generator().manual_seed(6)
    n, d = 40, 8
    keys, values = torch.randn(n, d, generator=generator), torch.randn(n, d, generator=generator)
    head = Head(
        0, 0, keys, values, torch.arange(n), d**-0.5, n, recent_queries=torch.randn(1, n, d, generator=generator)
    )
    alone = LeverageScorer(blend=None, sketch=None, pre_rope=False, exclude_first=0, exclude_last=0, ridge=1e-12)
    assert alone.needs == ()  # no queries, no RoPE to undo
    lev = naive_leverage(keys)
    torch.testing.assert_close(
        score_one(alone, head).double(), (lev - lev.mean()) / lev.std(unbiased=False), rtol=1e-4, atol=1e-5
    )
    attention = LeverageScorer(blend=0, exclude_first=0, exclude_last=0, pool=1)
    # the prompt's chunked attention, no leverage; both
    assert attention.needs == (ChunkAttentionMass(ChunkSpec(256, 0, 0, 1.0)),)
    assert LeverageScorer().needs == (KeyRope(), ChunkAttentionMass(ChunkSpec(256, 8, 4, 1.0)))
    mass = naive_chunk_mass(head.recent_queries, torch.arange(n), keys, torch.arange(n), 256, 1.0, 0)
    mass = mass * values.double().norm(dim=-1)
    torch.testing.assert_close(
        score_one(attention, head).double(), (mass - mass.mean()) / mass.std(unbiased=False), rtol=1e-4, atol=1e-4
    )
    with pytest.raises(ValueError, match="key_cos"):
        score_one(LeverageScorer(), head)  # pre-RoPE needs the keys' RoPE
    for bad in ({"blend": -1}, {"sketch": 0}, {"chunk": 0}, {"pool": 2}, {"exclude_first": -1}):
        with pytest.raises(ValueError):
            LeverageScorer(**bad)
    with pytest.raises(ValueError, match="bad options"):
        CompressionPolicy(keep_ratio=0.5, scorer="leverage", scorer_options={"unknown": 1})


def test_compress_with_leverage_keeps_sinks_window_and_top_reference_scores():
    """Through the engine: the chunked attention accumulated during the prefill, the keys' RoPE passed,
    kept rows as the reference computed from every prompt query (recorded here for it only)."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(8))
    budget, n_sink, window = 30, 2, 5
    policy = CompressionPolicy(
        budget=budget,
        scorer="leverage",
        n_sink=n_sink,
        window=window,
        scorer_options={"blend": 0.6, "sketch": None, "chunk": 32, "ridge": 1e-12},
    )
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids, policy=policy, observe_queries=ALL_QUERIES)
    assert cache.layers[0].recent_queries[0].shape[1] == 90  # every prompt query, for the reference
    attention = cache.layers[0].rows[0].chunk_attention[LeverageScorer(chunk=32).chunk_spec]
    assert attention.queries.shape[1] <= 32 + 4  # the open chunk only is held back
    before = [[layer.head(0, h) for h in range(2)] for layer in cache.layers]
    queries = [layer.recent_queries[0].clone() for layer in cache.layers]
    before = [[tuple(t.clone() for t in head) for head in layer] for layer in before]
    compress(model, cache, policy)
    cos, sin = rope_cos_sin(model, torch.arange(90))
    for layer_idx, layer in enumerate(cache.layers):
        for h in range(2):
            keys, values, positions = before[layer_idx][h]
            head = Head(
                layer_idx,
                h,
                keys,
                values,
                positions,
                16**-0.5,
                90,
                recent_queries=queries[layer_idx][2 * h : 2 * h + 2],
                key_cos=cos,
                key_sin=sin,
            )
            reference = torch.full((90,), float("inf"), dtype=torch.float64)
            reference[8:86] = naive_compactor(head, 0.6, 32, 1.0, 3, 8, 4)
            middle = reference[n_sink : 90 - window]
            top = (torch.topk(middle, budget - n_sink - window).indices + n_sink).tolist()
            wanted = sorted(list(range(n_sink)) + top + list(range(90 - window, 90)))
            assert layer.head(0, h)[2].tolist() == wanted
            assert layer.recent_queries[0] is None  # dropped after the prompt is compressed
            assert layer.rows[0].chunk_attention is None


# -- KVzip ----------------------------------------------------------------------------------------


class ToyTokenizer:
    """Characters as token ids (no chat template); enough for the reconstruction prompts."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        ids = [3 + ord(c) % 120 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def naive_kvzip(model, context: list[int], chunks, sink: int) -> torch.Tensor:
    """Scores from the model's own (eager) attention weights (of each layer kvcal holds: a hybrid model's recurrent
    layers return none, Gemma 4's sliding layers are not scored): for each chunk, one forward of
    context + chunk input; the chunk queries' weights restricted to prefix + span + own tokens
    and renormalised (a softmax over a subset), max over GQA group and queries, max over chunks."""
    config = model.config
    indices = attention_layer_indices(config)  # the layers scored, by decoder index
    numbers = attention_numbers(config)  # of those layers (Gemma 4: its full-attention layers' geometry)
    layers, heads, kv = len(indices), numbers["num_q_heads"], numbers["num_kv_heads"]
    group = heads // kv
    t = len(context)
    best = torch.zeros(layers, kv, t, dtype=torch.float64)
    model.set_attn_implementation("eager")
    for start, end, chunk_ids in chunks:
        ids = torch.tensor([context + chunk_ids])
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True).attentions
        q = len(chunk_ids)
        for layer in range(layers):
            # one per attention module: of a hybrid its attention layers', of Gemma 4 every decoder layer's
            at = indices[layer] if len(attentions) == config.num_hidden_layers else layer
            weights = attentions[at][0].double()  # [Hq, t + q, t + q]
            for head in range(heads):
                for i in range(q):
                    row = weights[head, t + i]
                    subset = [j for j in range(t) if j < sink or start <= j < end] + list(range(t, t + i + 1))
                    total = sum(float(row[j]) for j in subset)
                    for j in subset:
                        if j < t:
                            value = float(row[j]) / total
                            if value > best[layer, head // group, j]:
                                best[layer, head // group, j] = value
    return best


@pytest.mark.parametrize("chunk_size", [64, 23])
def test_kvzip_scores_equal_the_models_attention_over_the_reconstruction(chunk_size):
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    tokenizer = ToyTokenizer()
    context = [1] + torch.randint(3, 120, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([context]))
    lengths = cache.head_lengths().clone()
    scores = kvzip_scores(model, tokenizer, cache, context, chunk_size=chunk_size, overlap=4)
    assert scores.prefix_length == 1 and scores.scores.shape == (2, 2, 51)
    assert torch.equal(cache.head_lengths(), lengths) and cache.get_seq_length() == 51  # the cache is untouched
    chunks = reconstruction_chunks(
        tokenizer, context, 1, tokenizer("\n", add_special_tokens=False)["input_ids"], chunk_size, 4
    )
    assert len(chunks) == scores.chunks == math.ceil(50 / chunk_size)
    if len(chunks) > 1:  # later chunks restate the previous chunk's last tokens
        assert (
            chunks[1][2][-(chunks[1][1] - chunks[1][0]) - 1 - 4 : -(chunks[1][1] - chunks[1][0]) - 1]
            == context[chunks[1][0] - 4 : chunks[1][0]]
        )
    want = naive_kvzip(model, context, chunks, sink=1)
    torch.testing.assert_close(scores.scores.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2"])
def test_kvzip_scores_of_a_sliding_layer_are_its_windowed_attention(model_type):
    """A sliding layer's reconstruction queries see only the keys inside their window, as in the model's own forward
    pass: a context longer than the window (51 tokens, window 32) scores as the model's attention weights say."""
    from test_architecture_matrix import tiny_model

    types = ["sliding_attention", "full_attention"]
    model = tiny_model(model_type, layer_types=types * 2, use_sliding_window=True, vocab_size=128)
    from runtime.math.geometry import ModelGeometry

    assert ModelGeometry.of(model).sliding_windows == (32, None, 32, None)
    tokenizer = ToyTokenizer()
    context = [1] + torch.randint(3, 120, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([context]))
    scores = kvzip_scores(model, tokenizer, cache, context, chunk_size=23, overlap=4)
    chunks = reconstruction_chunks(tokenizer, context, 1, tokenizer("\n", add_special_tokens=False)["input_ids"], 23, 4)
    want = naive_kvzip(model, context, chunks, sink=1)
    torch.testing.assert_close(scores.scores.double(), want, rtol=1e-4, atol=1e-6)


def test_kvzip_scorer_reads_scores_by_position_and_refuses_another_prompt():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    tokenizer = ToyTokenizer()
    context = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(10))
    cache = RaggedCache.for_model(model)
    prefill(model, cache, context)
    scores = kvzip_scores(model, tokenizer, cache, context, prefix_length=0)
    policy = CompressionPolicy(budget=15, scorer="kvzip", n_sink=2, window=3)
    with pytest.raises(ValueError, match="reconstruction pass"):
        compress(model, cache.copy(), policy)
    compressed = cache.copy()
    compress(model, compressed, with_kvzip_scores(policy, scores))
    for layer_idx, layer in enumerate(compressed.layers):
        for h in range(2):
            table = scores.scores[layer_idx, h]
            top = (torch.topk(table[2:37], 10).indices + 2).tolist()
            assert layer.head(0, h)[2].tolist() == sorted([0, 1] + top + [37, 38, 39])
    # decoded tokens (past the scored context) are never evicted before a context token
    evictor = HeadEvictor(bind(with_kvzip_scores(policy, scores), None, model))
    assert torch.equal(evictor.layer_scores(cache.layers[0], 0, [0], [40])[0], scores.scores[0])
    later = []
    for h in range(2):
        keys, values, positions = cache.layers[0].head(0, h)
        extra = torch.tensor([40, 41], dtype=positions.dtype)
        later.append(
            Head(
                0,
                h,
                torch.cat([keys, keys[:2]]),
                torch.cat([values, values[:2]]),
                torch.cat([positions, extra]),
                0.25,
                42,
            )
        )
    scorer = KVzipScorer(scores)
    looked_up = scorer.score(layer_inputs(scorer, [later]))  # [1, 2, 42]
    assert torch.equal(looked_up[0, :, :40], scores.scores[0]) and torch.isinf(looked_up[0, :, 40:]).all()
    other = RaggedCache.for_model(model)
    prefill(model, other, torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(11)))
    with pytest.raises(ValueError, match="another prompt"):
        compress(model, other, with_kvzip_scores(policy, scores))


def test_kvzip_global_budgets_are_one_top_k_over_all_heads():
    generator = torch.Generator().manual_seed(12)
    table = torch.rand(3, 2, 50, generator=generator) ** 4
    scores = KVzipScores(
        scores=table, last_keys=torch.zeros(3, 2, 4), prefix_length=0, chunks=1, reconstruction_tokens=50, seconds=0.0
    )
    budgets = kvzip_budgets(scores, 0.3, n_sink=2, window=5)
    assert budgets.sum() == round(0.3 * 300) and budgets.shape == (3, 2) and budgets.min() >= 7
    protected = table.clone()
    protected[..., :2] = 2.0
    protected[..., 45:] = 2.0
    threshold = torch.sort(protected.reshape(-1), descending=True).values[89]
    assert np.array_equal(budgets, (protected >= threshold).sum(-1).numpy())


def test_the_engines_global_allocation_over_kvzip_scores_is_kvzips_own_top_k():
    """``global/kvzip`` needs no policy of its own: KVzip's scores are attention weights, comparable
    across heads, so the engine's global ranking is the paper's one top-k over every head."""
    model = make_tiny_llama(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    context = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(13))
    cache = RaggedCache.for_model(model)
    prefill(model, cache, context)
    scores = kvzip_scores(model, ToyTokenizer(), cache, context, prefix_length=0)
    assert KVzipScorer.comparable
    policy = with_kvzip_scores(CompressionPolicy(keep_ratio=0.3, allocation="global", scorer="kvzip", window=5), scores)
    report = compress(model, cache, policy)
    want = kvzip_budgets(scores, 0.3, n_sink=policy.n_sink, window=5)
    assert np.array_equal(report.budgets[0], want) and report.budgets.sum() == round(0.3 * 60 * 3 * 2)
    for index, layer in enumerate(cache.layers):
        for h in range(2):
            kept = layer.head(0, h)[2].long()
            rest = torch.ones(60, dtype=torch.bool)
            rest[kept] = False
            rest[: policy.n_sink] = rest[-5:] = False
            if rest.any():  # every evicted context token scored no higher than the lowest kept one
                kept_scores = scores.scores[index, h, kept[policy.n_sink : -5]]
                if kept_scores.numel():
                    assert scores.scores[index, h, rest].max() <= kept_scores.min()


def test_kvzip_layer_scores_equal_the_per_head_lookup_with_rows_of_different_lengths():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=6)
    context = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(14))
    cache = RaggedCache.for_model(model)
    prefill(model, cache, context)
    scores = kvzip_scores(model, ToyTokenizer(), cache, context, prefix_length=0)
    layer = cache.layers[1]
    layer.keep(0, 0, torch.arange(0, 40, 3))  # heads of different lengths
    scorer = KVzipScorer(scores)
    evictor = HeadEvictor(bind(CompressionPolicy(budget=10, scorer=scorer), None, model))
    batched = evictor.layer_scores(layer, 1, [0], [40])
    for h in range(2):
        single = oracle_score(scorer, head_from_cache(scorer, model, layer, 1, 0, h, 40))
        n = single.shape[0]
        torch.testing.assert_close(batched[0, h, :n], single)
        assert torch.isinf(batched[0, h, n:]).all() and (batched[0, h, n:] < 0).all()
    other = RaggedCache.for_model(model)
    prefill(model, other, torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(15)))
    with pytest.raises(ValueError, match="another prompt"):
        evictor.layer_scores(other.layers[1], 1, [0], [40])


# -- the real embedded model --------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_keeps_the_needle_under_leverage_and_kvzip(embedded_model, embedded_tokenizer):
    """Question-agnostic compression of a 1K-token retrieval probe to half its cache keeps the answer."""
    from needles import PRESETS, answer_is_correct, generate_probes

    model, tokenizer = embedded_model, embedded_tokenizer
    spec = PRESETS["quick"].replace(families=("retrieval",), seed=1000)
    probe = next(p for p in generate_probes(spec, tokenizer) if p.length <= 1024 and p.depth == 50.0)
    ids = torch.tensor([probe.input_ids])
    pad = tokenizer.eos_token_id
    with ragged_attention(model):
        for scorer in ("leverage", "kvzip"):
            policy = CompressionPolicy(keep_ratio=0.5, allocation="uniform", scorer=scorer)
            cache = RaggedCache.for_model(model)
            prefill(model, cache, ids[:, : probe.context_end], policy=policy)
            if scorer == "kvzip":
                report, scores = kvzip_compress(model, tokenizer, cache, probe.input_ids[: probe.context_end], policy)
                assert scores.chunks == 1 and scores.prefix_length > 0
            else:
                report = compress(model, cache, policy)
            assert report.kv_bytes_after <= 1.05 * 0.5 * report.kv_bytes_before  # + page rounding (~3%)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **cache_argument(model, cache),
                do_sample=False,
                max_new_tokens=20,
                pad_token_id=pad,
            )
            text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            assert answer_is_correct(text, probe), (scorer, probe.answer, text)


def test_missing_prompt_records_are_reported_in_words():
    """Leverage on a cache prefilled without its chunked attention names what is missing; so does a
    scorer that needs more recorded queries than were kept (it used to print 'needs the last
    4611686018427387904 queries')."""
    model = make_tiny_llama(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, seed=2)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids, observe_queries=4)
    with pytest.raises(ValueError, match="needs the prompt's chunked attention: prefill with policy"):
        compress(model, cache.copy(), CompressionPolicy(keep_ratio=0.5, scorer="leverage"))
    with pytest.raises(ValueError) as caught:
        compress(model, cache, CompressionPolicy(keep_ratio=0.5, scorer="snapkv", scorer_options={"window": 8}))
    assert "the last 8 prompt queries" in str(caught.value) and "only 4 were recorded" in str(caught.value)
    assert str(ALL_QUERIES) not in str(caught.value)
