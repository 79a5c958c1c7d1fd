"""Bad input or a fault is refused with one clear error, never a traceback or a wrong answer.

Each section lists, one test per case, what is refused; the test names read as that list.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import make_random_artifact, make_random_identity, make_tiny_llama, single_thread

from artifacts import ArtifactError, open_artifact, write_artifact
from artifacts.cli import main as inspect_main
from artifacts.metadata import ROOT_TEXT_ATTRS, extended_metadata_digest, metadata_digest
from artifacts.schema import MODEL_ATTR_TYPES, OPTIONAL_MODEL_ATTRS, SECTIONS
from artifacts.validation import coerce_attr

REPO = Path(__file__).resolve().parents[1]

# -- models and the runtime API ------------------------------------------------------------------


def _bad_config_dir(tmp_path: Path, **fields) -> Path:
    """A real model directory (tiny Llama + the embedded tokenizer's files) whose config.json has ``fields``."""
    from common.models import embedded_model_dir

    directory = tmp_path / "bad-model"
    make_tiny_llama().save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_model_directory_with_an_invalid_config_field_is_a_clear_model_error(tmp_path):
    from common.models import ModelError, load_model, load_tokenizer

    directory = _bad_config_dir(tmp_path, num_hidden_layers="x")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelError) as info:
            load(directory)
        message = str(info.value)
        assert str(directory) in message and "num_hidden_layers" in message and "\n" not in message


def test_a_per_layer_intermediate_size_is_a_valid_config_field(tmp_path):
    """Gemma 3n's config.json gives ``intermediate_size`` per layer (a list of integers), as its checkpoints do: the
    model loads, while a list of anything else is still named."""
    from test_architecture_matrix import tiny_model

    from common.models import ModelError, embedded_model_dir, load_model

    directory = tmp_path / "gemma3n"
    tiny_model("gemma3n_text").save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    assert isinstance(json.loads((directory / "config.json").read_text())["intermediate_size"], list)
    assert type(load_model(directory)).__name__ == "Gemma3nForCausalLM"
    with pytest.raises(ModelError, match=r"intermediate_size must be an integer.*got \[128, 'x'\]"):
        load_model(_bad_config_dir(tmp_path, intermediate_size=[128, "x"]))


@pytest.mark.parametrize("command", ["profile-model", "evaluate-artifact", "generate-probes"])
def test_commands_exit_2_on_a_model_directory_with_an_invalid_config(command, tmp_path, capsys, one_thread):
    directory = _bad_config_dir(tmp_path, num_hidden_layers="x")
    capsys.readouterr()  # save_pretrained's own output
    module, argv = {
        "profile-model": ("profiler.cli", [str(directory), "--out", str(tmp_path / "a.h5"), "--preset", "smoke"]),
        "evaluate-artifact": ("profiler.evaluate_cli", [str(directory), "--artifact", str(tmp_path / "a.h5")]),
        "generate-probes": (
            "needles.cli",
            ["--model", str(directory), "--preset", "smoke", "--out", str(tmp_path / "p")],
        ),
    }[command]
    assert importlib.import_module(module).main(argv) == 2  # an uncaught exception fails the test
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(directory) in lines[0] and "num_hidden_layers" in lines[0], lines


def test_evaluate_artifact_of_an_uncached_hub_id_offline_exits_2_without_a_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "profiler.evaluate_cli", "no-such-org/no-such-model", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "no such model directory: no-such-org/no-such-model, and no hub id" in done.stderr


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"keep_ratio": math.nan}, "keep_ratio"),
        ({"compression_ratio": math.nan}, "compression_ratio"),
        ({"compression_ratio": math.inf}, "compression_ratio"),
        ({"budget": 2.5}, "budget"),
        ({"min_budget": math.nan}, "min_budget"),
        ({"min_budget": 1.5}, "min_budget"),
        ({"n_sink": math.nan}, "n_sink"),
        ({"n_sink": True}, "n_sink"),
        ({"window": 2.5}, "window"),
        ({"beta": math.nan}, "beta"),
        ({"beta": math.inf}, "beta"),
        ({"tau": math.nan}, "tau"),
        ({"tau": math.inf}, "tau"),
        ({"moment_rounds": 2.0}, "moment_rounds"),
        ({"evict_every": 1.5}, "evict_every"),
        ({"moment_eviction": "yes", "scorer": "snapkv"}, "moment_eviction"),
    ],
    ids=lambda value: value if isinstance(value, str) else ",".join(f"{k}={v!r}" for k, v in value.items()),
)
def test_policy_refuses_a_nan_infinite_or_fractional_field_naming_it(fields, name):
    from runtime import CompressionPolicy

    if not {"keep_ratio", "compression_ratio", "budget"} & set(fields):
        fields = {"keep_ratio": 0.5, **fields}
    with pytest.raises(ValueError, match=rf"^{name} (\([^)]*\) )?must be "):
        CompressionPolicy(**fields)


SCORER_OPTIONS = [
    ("expected_attention", "horizon", math.nan),
    ("expected_attention", "horizon", 2.5),
    ("expected_attention", "epsilon", math.nan),
    ("expected_attention", "epsilon", math.inf),
    ("expected_attention", "pool", 3.0),
    ("snapkv", "window", math.nan),
    ("snapkv", "kernel", 2.5),
    ("leverage", "blend", math.nan),
    ("leverage", "blend", math.inf),
    ("leverage", "sketch", 2.5),
    ("leverage", "sketch", math.nan),
    ("leverage", "chunk", math.nan),
    ("leverage", "pool", 1.0),
    ("leverage", "exclude_first", 0.5),
    ("leverage", "exclude_last", math.nan),
    ("leverage", "seed", 0.5),
    ("leverage", "ridge", math.nan),
    ("leverage", "ridge", math.inf),
    ("leverage", "attention_scale", math.nan),
    ("leverage", "attention_scale", 0.0),
    ("leverage", "pre_rope", "no"),
    ("leverage", "value_norm", 0),
]


@pytest.mark.parametrize(("scorer", "option", "value"), SCORER_OPTIONS, ids=lambda v: str(v))
def test_scorer_options_refuse_a_nan_infinite_fractional_or_non_boolean_value_naming_the_option(scorer, option, value):
    from runtime import CompressionPolicy
    from runtime.scorers import make_scorer

    with pytest.raises(ValueError, match=rf"{option} must be "):
        make_scorer(scorer, **{option: value})
    with pytest.raises(ValueError, match=rf"{option} must be "):
        CompressionPolicy(keep_ratio=0.5, scorer=scorer, scorer_options={option: value})


def _prompt(batch=1, length=12, vocab=128):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(4, vocab, (batch, length), generator=generator)


@pytest.mark.parametrize("block_size", [2.5, math.nan, 0, True])
def test_compress_prompt_refuses_a_block_size_that_is_not_a_positive_integer(block_size, one_thread):
    from runtime import CompressionPolicy, compress_prompt

    with pytest.raises(ValueError, match="^block_size must be "):
        compress_prompt(make_tiny_llama(), _prompt(), CompressionPolicy(keep_ratio=0.5), block_size=block_size)


@pytest.mark.parametrize("columns", [2.5, True, 0, 12, -1])
def test_compress_prompt_refuses_context_columns_that_are_not_an_integer_inside_the_prompt(columns, one_thread):
    from runtime import CompressionPolicy, compress_prompt

    with pytest.raises(ValueError, match="context_columns"):
        compress_prompt(make_tiny_llama(), _prompt(), CompressionPolicy(keep_ratio=0.5), context_columns=columns)


def test_a_prompt_longer_than_the_model_context_is_refused_before_any_compute(one_thread):
    from runtime import CompressionPolicy, compress_prompt, generate

    model = make_tiny_llama()
    model.config.max_position_embeddings = 16
    ids = _prompt(length=20)
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    for run in (compress_prompt, generate):
        with pytest.raises(ValueError, match="20 tokens.*max_position_embeddings.*16"):
            run(model, ids, CompressionPolicy(keep_ratio=0.5))
    assert not calls  # refused before the model ran
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # 16 real tokens (left padding): fits
    compress_prompt(model, ids, CompressionPolicy(keep_ratio=0.5), attention_mask=mask)


def test_answer_refuses_a_context_longer_than_the_model_context(embedded_tokenizer, one_thread):
    from runtime import CompressionPolicy, answer

    model = make_tiny_llama(vocab_size=len(embedded_tokenizer))
    model.config.max_position_embeddings = 64
    with pytest.raises(ValueError, match="max_position_embeddings"):
        answer(
            model,
            embedded_tokenizer,
            "The sky is blue. " * 40,
            "What colour is the sky?",
            CompressionPolicy(keep_ratio=0.5),
        )


def test_a_batch_row_that_is_all_padding_is_refused_naming_the_row(one_thread):
    from runtime import CompressionPolicy, compress_prompt, generate

    ids = _prompt(batch=3)
    mask = torch.ones_like(ids)
    mask[1] = 0
    for run in (compress_prompt, generate):
        for policy in (CompressionPolicy(keep_ratio=0.5), None):
            with pytest.raises(ValueError, match="row 1 .*all padding"):
                run(make_tiny_llama(), ids, policy, attention_mask=mask)


@pytest.mark.parametrize(
    ("ids", "mask", "message"),
    [
        (torch.zeros(0, 8, dtype=torch.long), None, "empty"),
        (torch.zeros(2, 0, dtype=torch.long), None, "empty|at least one column"),
        (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 7, dtype=torch.long), "attention_mask.*shape"),
        (torch.ones(2, 8, dtype=torch.long), torch.full((2, 8), 2), "attention_mask must hold only 0"),
        (torch.ones(2, 8), None, "input_ids.*integer"),
    ],
    ids=["no-rows", "no-columns", "mask-shape", "mask-values", "float-ids"],
)
def test_generate_refuses_an_empty_or_malformed_input(ids, mask, message, one_thread):
    from runtime import CompressionPolicy, generate

    with pytest.raises(ValueError, match=message):
        generate(make_tiny_llama(), ids, CompressionPolicy(keep_ratio=0.5), attention_mask=mask, max_new_tokens=2)


def test_token_ids_outside_the_vocabulary_are_refused(one_thread):
    from runtime import CompressionPolicy, generate

    ids = _prompt()
    ids[0, 3] = 128  # the tiny model's vocabulary is 0..127
    with pytest.raises(ValueError, match="token id 128.*vocabulary of 128"):
        generate(make_tiny_llama(), ids, CompressionPolicy(keep_ratio=0.5), max_new_tokens=2)


def test_a_calibration_of_another_architecture_is_refused_by_compress_prompt(tmp_path, one_thread):
    from test_runtime_policy import write_tiny_artifact

    from runtime import CompressionPolicy, compress_prompt, load_calibration

    profiled = make_tiny_llama(num_layers=3)
    calibration = load_calibration(profiled, path=write_tiny_artifact(tmp_path / "a.h5", profiled))
    other = make_tiny_llama(num_layers=2)
    calls = []
    other.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="calibration.*another architecture.*num_layers"):
        compress_prompt(other, _prompt(), CompressionPolicy(keep_ratio=0.5, allocation="inf"), calibration=calibration)
    assert not calls


def _cache_copy(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the real converted embedded model in a fresh cache; the env that points at it."""
    from common.models import embedded_model_dir

    source = embedded_model_dir()  # the real cache, converted already (or now)
    cache = tmp_path / "cache"
    target = cache / "kvcal" / "models" / source.name
    shutil.copytree(source, target)
    return target, {**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1"}


LOAD_EMBEDDED = (
    "import warnings; warnings.simplefilter('always')\n"
    "from common.models import embedded_model_dir, load_model, load_tokenizer\n"
    "d = embedded_model_dir(); m = load_model(); t = load_tokenizer()\n"
    "assert m.config.num_hidden_layers == 30 and len(t) > 1000\n"
    "print(d)\n"
)


def _load_embedded(env: dict, count: int = 1) -> list[subprocess.CompletedProcess]:
    """Start ``count`` loads at once and wait for all.  Their output goes to files, not pipes: a
    process blocked on a full pipe (transformers 5.2 prints ~150 KB of progress while loading)
    while it holds the conversion lock would stall the one the test reads first."""
    with tempfile.TemporaryDirectory() as directory:
        logs = [(Path(directory) / f"{i}.out", Path(directory) / f"{i}.err") for i in range(count)]
        procs = []
        for out, err in logs:
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", LOAD_EMBEDDED], env=env, cwd=REPO, stdout=stdout, stderr=stderr
                    )
                )
        results = []
        for proc, (out, err) in zip(procs, logs, strict=True):
            proc.wait(timeout=600)
            results.append(
                subprocess.CompletedProcess(
                    proc.args, proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
                )
            )
    return results


def _assert_healed(target: Path, reference: Path) -> None:
    from common.models import MANIFEST_NAME, cache_entry_problem

    assert cache_entry_problem(target, hashes=True) is None and (target / MANIFEST_NAME).is_file()
    assert (target / "model.safetensors").stat().st_size == (reference / "model.safetensors").stat().st_size
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # nothing left aside


def test_a_truncated_weights_file_in_the_embedded_model_cache_is_converted_again(tmp_path):
    from common.models import embedded_model_dir

    target, env = _cache_copy(tmp_path)
    weights = target / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    (done,) = _load_embedded(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    assert "is damaged (model.safetensors has" in done.stderr and "Traceback" not in done.stderr
    _assert_healed(target, embedded_model_dir())


def test_a_deleted_weights_file_in_the_embedded_model_cache_is_converted_once_by_two_processes_at_once(tmp_path):
    from common.models import _write_manifest, embedded_model_dir

    target, env = _cache_copy(tmp_path)
    _write_manifest(target)  # as a conversion leaves it
    (target / "model.safetensors").unlink()
    results = _load_embedded(env, count=2)
    for done in results:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(target)
    warned = [done for done in results if "model.safetensors is missing" in done.stderr]
    assert len(warned) == 1  # one converts; the other waits for it and uses its copy
    _assert_healed(target, embedded_model_dir())


def test_a_weights_file_damaged_without_changing_its_size_is_converted_again_when_the_load_fails(tmp_path):
    from common.models import _write_manifest, embedded_model_dir

    target, env = _cache_copy(tmp_path)
    _write_manifest(target)
    with open(target / "model.safetensors", "r+b") as fh:
        fh.write(b"\xff" * 8)  # the header length: safetensors cannot read it, the size is unchanged
    (done,) = _load_embedded(env)
    assert done.returncode == 0, done.stderr
    assert "differs from the file converted" in done.stderr
    _assert_healed(target, embedded_model_dir())


# -- artifact files (reader, validation, serving values) ----------------------------------------


def _resign(path) -> None:
    """Recompute the metadata digests of ``path`` from its attributes as they now are, so that a
    crafted edit is judged on its own merits, not refused as tampering."""
    with h5py.File(path, "r+") as h5:
        root = {name: coerce_attr("/", name, h5.attrs[name], str) for name in ROOT_TEXT_ATTRS}
        model = {
            name: coerce_attr("/model", name, h5["model"].attrs[name], kind)
            for name, kind in MODEL_ATTR_TYPES.items()
            if name in h5["model"].attrs or name not in OPTIONAL_MODEL_ATTRS
        }
        sections = {
            name: {key: coerce_attr(f"/{name}", key, h5[name].attrs[key], kind) for key, kind in spec.attrs.items()}
            for name, spec in SECTIONS.items()
            if name in h5
        }
        h5.attrs["metadata_sha256"] = metadata_digest(root, model, sections)
        extended = extended_metadata_digest(root, model, sections)
        if extended is not None:
            h5.attrs["extended_metadata_sha256"] = extended


def _edit(path, edit) -> None:
    """Apply ``edit(h5)`` to the file and re-sign its metadata."""
    with h5py.File(path, "r+") as h5:
        edit(h5)
    _resign(path)


def _refused(path, match, capsys=None) -> None:
    """The reader refuses the file for ``match``; inspect-artifact exits 2 with one line on stderr."""
    with pytest.raises(ArtifactError, match=match):
        with open_artifact(path) as reader:
            reader.validate()
    if capsys is not None:
        capsys.readouterr()
    assert inspect_main([str(path)]) == 2
    if capsys is not None:
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "invalid artifact" in err, err


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def artifact_path(tmp_path):
    return write_artifact(tmp_path / "kv_calibration.h5", make_random_artifact())


def test_resigned_edit_of_a_harmless_attribute_is_still_valid(artifact_path):
    """The helper itself: a re-signed file is judged on its content only."""
    _edit(artifact_path, lambda h5: h5.attrs.__setitem__("created", "2030-01-01T00:00:00+00:00"))
    with open_artifact(artifact_path) as reader:
        reader.validate()
        assert reader.created.startswith("2030")


@pytest.mark.parametrize("text", ["[1,2]", "null", '"x"', "5", "true"])
def test_config_json_that_is_not_an_object_is_refused(artifact_path, capsys, text):
    _edit(artifact_path, lambda h5: h5.attrs.__setitem__("config_json", text))
    _refused(artifact_path, "config_json must be a JSON object", capsys)
    assert inspect_main([str(artifact_path), "--json"]) == 2
    out = _strict_json(capsys.readouterr().out)
    assert out["valid"] is False and "config_json must be a JSON object" in out["error"]


def test_writer_refuses_a_config_that_is_not_an_object(tmp_path):
    artifact = make_random_artifact(sections=())
    artifact.config = [1, 2]
    with pytest.raises(ArtifactError, match="config must be a JSON object"):
        write_artifact(tmp_path / "a.h5", artifact)


HOSTILE_ENTRIES = {"behaviour": 5, "moments": "x", "recommendation": [1], "budgets": None}


def test_config_entries_that_are_not_objects_are_ignored_by_every_consumer(tmp_path, capsys):
    """The config's entries are descriptive and free-form: a consumer that looks inside one
    ignores an entry that is not the object it expects (docs/artifact-format.md section 2)."""
    artifact = make_random_artifact()
    artifact.config = dict(HOSTILE_ENTRIES)
    path = write_artifact(tmp_path / "a.h5", artifact)
    assert inspect_main([str(path)]) == 0
    capsys.readouterr()
    assert inspect_main([str(path), "--json"]) == 0
    assert _strict_json(capsys.readouterr().out)["config"] == HOSTILE_ENTRIES
    assert inspect_main([str(path), "--html", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").stat().st_size > 0

    from profiler.evaluate_cli import _task_spec
    from runtime.plan.calibration import _configured_selection

    args = argparse.Namespace(tasks=("retrieval",), haystacks=("simple",), preset="smoke", count=1, seed=None)
    spec, profiler_seed = _task_spec(args, artifact.config, 4096)
    assert profiler_seed is None and spec is not None
    assert _configured_selection(artifact.config) is None
    hostile_spec = {"behaviour": {"spec": 7}, "moments": {"selection": ["snapkv"]}}
    assert _task_spec(args, hostile_spec, 4096)[1] is None
    assert _task_spec(args, {"behaviour": {"spec": {"seed": "zero"}}}, 4096)[1] is None


def test_config_json_with_nan_is_refused_and_json_output_stays_strict(artifact_path, capsys):
    _edit(artifact_path, lambda h5: h5.attrs.__setitem__("config_json", '{"beta":NaN,"x":Infinity}'))
    _refused(artifact_path, "config_json.*NaN", capsys)
    assert inspect_main([str(artifact_path), "--json"]) == 2
    assert _strict_json(capsys.readouterr().out)["valid"] is False


def test_config_json_nested_absurdly_deep_is_refused(artifact_path, capsys):
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    _edit(artifact_path, lambda h5: h5.attrs.__setitem__("config_json", deep))
    _refused(artifact_path, "config_json is nested deeper than", capsys)


def test_valid_artifact_json_summary_is_strict_json(artifact_path, capsys):
    assert inspect_main([str(artifact_path), "--json"]) == 0
    assert _strict_json(capsys.readouterr().out)["valid"] is True


# memory: what a file may declare


def _add_zero_cov_bomb(h5, layers: int, heads: int, head_dim: int) -> None:
    """A query_stats section of zeros: compresses ~1000x, so a tiny file declares a huge array."""
    group = h5.create_group("query_stats")
    group.attrs["n_sink"] = 4
    filters = dict(compression="gzip", compression_opts=9, shuffle=True, fletcher32=True)
    group.create_dataset("n", data=np.ones((layers, heads), dtype="<i8"), chunks=True, **filters)
    group.create_dataset("mean", data=np.zeros((layers, heads, head_dim), dtype="<f4"), chunks=True, **filters)
    cov = group.create_dataset(
        "cov", shape=(layers, heads, head_dim, head_dim), dtype="<f4", chunks=(1, heads, head_dim, head_dim), **filters
    )
    zeros = np.zeros((1, heads, head_dim, head_dim), dtype="<f4")
    for layer in range(layers):
        cov[layer : layer + 1] = zeros


def test_file_declaring_far_more_data_than_it_holds_is_refused(tmp_path, capsys):
    """A decompression bomb: 128 MiB of covariance in a file of a few hundred KiB."""
    identity = make_random_identity(num_layers=32, num_q_heads=16, num_kv_heads=4, head_dim=256)
    path = write_artifact(tmp_path / "bomb.h5", make_random_artifact(identity, sections=()))
    _edit(path, lambda h5: _add_zero_cov_bomb(h5, 32, 16, 256))
    assert path.stat().st_size < 2 << 20
    _refused(path, r"declares 128\.\d MiB of data.*times the file's size", capsys)


def test_dataset_whose_chunk_is_far_larger_than_the_dataset_is_refused(artifact_path, capsys):
    """A 7-value dataset stored in one 1 GiB chunk (extendible): reading it inflated the whole
    chunk (2.1 GB peak RSS) although the dataset declares 56 bytes."""

    def huge_chunk(h5):
        data = h5["behaviour/probe_steps"][()]
        del h5["behaviour/probe_steps"]
        h5["behaviour"].create_dataset(
            "probe_steps",
            data=data,
            maxshape=(None,),
            chunks=(1 << 27,),
            compression="gzip",
            compression_opts=9,
            shuffle=True,
            fletcher32=True,
        )

    _edit(artifact_path, huge_chunk)
    _refused(artifact_path, r"/behaviour/probe_steps: chunks of 1\.0 GiB, larger than the dataset", capsys)


@pytest.mark.parametrize(
    "name, value, symbol", [("head_dim", 1024, "d"), ("num_layers", 1000, "L"), ("num_q_heads", 768, "Hq")]
)
def test_architecture_beyond_the_caps_is_refused(artifact_path, name, value, symbol):
    _edit(artifact_path, lambda h5: h5["model"].attrs.__setitem__(name, value))
    _refused(artifact_path, rf"/model: {symbol} = {value} is outside \[1, 512\]")


def test_total_declared_size_beyond_the_absolute_cap_is_refused():
    """Even a file big enough for the ratio rule may not make a reader hold more than the cap."""
    from artifacts.reader import MAX_ARTIFACT_BYTES, check_declared_size

    check_declared_size(MAX_ARTIFACT_BYTES, file_size=MAX_ARTIFACT_BYTES)  # at the cap: fine
    with pytest.raises(ArtifactError, match="more than the 8.0 GiB a reader holds"):
        check_declared_size(MAX_ARTIFACT_BYTES + 1, file_size=MAX_ARTIFACT_BYTES)
    with pytest.raises(ArtifactError, match="times the file's size"):
        check_declared_size(1 << 30, file_size=1 << 20)
    check_declared_size(60 << 20, file_size=1 << 10)  # below the floor: any file size


# values that pass a per-dataset range check but poison serving


@pytest.mark.parametrize("value", [3e38, -2e8])
def test_covariance_of_absurd_magnitude_is_refused(artifact_path, value):
    def poison(h5):
        cov = h5["query_stats/cov"][()]
        cov[:, :, 0, 0] = value
        h5["query_stats/cov"][...] = cov

    _edit(artifact_path, poison)
    _refused(artifact_path, r"query_stats/cov: .*magnitude")


def test_query_mean_of_absurd_magnitude_is_refused(artifact_path):
    _edit(artifact_path, lambda h5: h5["query_stats/mean"].__setitem__((0, 0, 0), 1e30))
    _refused(artifact_path, r"query_stats/mean: .*magnitude")


def test_covariance_that_is_not_symmetric_is_refused(artifact_path):
    def skew(h5):
        cov = h5["query_stats/cov"][()]
        cov[2, 1, 0, 1] += 1.0
        h5["query_stats/cov"][...] = cov

    _edit(artifact_path, skew)
    _refused(artifact_path, r"query_stats/cov: layer 2, query head 1 is not symmetric")


def test_covariance_with_a_negative_variance_is_refused(artifact_path):
    def negative(h5):
        cov = h5["query_stats/cov"][()]
        cov[3, 4, 5, 5] = -1.0
        h5["query_stats/cov"][...] = cov

    _edit(artifact_path, negative)
    _refused(artifact_path, r"query_stats/cov: layer 3, query head 4 is not positive semi-definite")


def test_covariance_breaking_cauchy_schwarz_is_refused(artifact_path):
    def too_correlated(h5):
        cov = h5["query_stats/cov"][()]
        bound = math.sqrt(cov[0, 0, 0, 0] * cov[0, 0, 1, 1])
        cov[0, 0, 0, 1] = cov[0, 0, 1, 0] = 3 * bound
        h5["query_stats/cov"][...] = cov

    _edit(artifact_path, too_correlated)
    _refused(artifact_path, r"query_stats/cov: layer 0, query head 0 is not positive semi-definite")


@pytest.mark.parametrize(
    "section, attr, value, match",
    [
        ("budgets", "beta", 0.5, "beta = 0.5 is below the allowed minimum 1"),
        ("budgets", "min_budget", -3, "min_budget = -3 is below the allowed minimum 0"),
        ("query_stats", "n_sink", -1, "n_sink = -1 is below the allowed minimum 0"),
        ("learned_scorer", "fit_tokens", -5, "fit_tokens = -5 is below the allowed minimum 0"),
        ("recommendation", "tasks", 0, "tasks = 0 is below the allowed minimum 1"),
        ("recommendation", "baseline_accuracy", 1.5, "baseline_accuracy = 1.5 is above the allowed maximum 1"),
    ],
)
def test_section_attribute_out_of_bounds_is_refused(artifact_path, section, attr, value, match):
    _edit(artifact_path, lambda h5: h5[section].attrs.__setitem__(attr, value))
    _refused(artifact_path, f"/{section}: attribute {match}")


def test_budget_rows_that_do_not_sum_to_their_total_are_refused(artifact_path):
    def shift(h5):
        tables = h5["budgets/token_tables"][()]
        tables[1, 0, 0] += 7
        h5["budgets/token_tables"][...] = tables

    _edit(artifact_path, shift)
    _refused(artifact_path, r"budgets/token_tables: row 1 sums to \d+, not token_budgets\[1\] x L x Hkv = 11520")


def test_budget_row_clipped_at_a_short_sequence_is_accepted(tmp_path):
    """ "When sequences are long enough": a budget above the profiled length clips every head to it."""
    from runtime.plan.budgets import allocate_budgets

    artifact = make_random_artifact(sections=("budgets",))
    arrays = artifact.sections["budgets"].arrays
    arrays["token_tables"] = np.stack([allocate_budgets(arrays["inf_kv"], t, 100) for t in arrays["token_budgets"]])
    path = write_artifact(tmp_path / "a.h5", artifact)
    with open_artifact(path) as reader:
        reader.validate()


def test_budget_table_below_min_budget_is_refused(artifact_path):
    _edit(artifact_path, lambda h5: h5["budgets"].attrs.__setitem__("min_budget", 40))
    _refused(artifact_path, r"budgets/token_tables: row 0 has a head below min_budget 40")


def test_ratio_rows_that_do_not_sum_to_their_total_are_refused(artifact_path):
    _edit(artifact_path, lambda h5: h5["budgets/ratio_tables"].__setitem__((0, 0, 0), 50.0))
    _refused(artifact_path, r"budgets/ratio_tables: row 0 sums to .*, not ratios\[0\] x L x Hkv")


def test_inf_weights_that_do_not_sum_to_one_are_refused(artifact_path):
    _edit(artifact_path, lambda h5: h5["budgets/inf_kv"].__setitem__(..., np.full((30, 3), 0.5)))
    _refused(artifact_path, r"budgets/inf_kv: sums to 45, not 1")


def test_learned_scorer_with_features_other_than_twice_head_dim_is_refused(tmp_path):
    artifact = make_random_artifact(sections=("learned_scorer",))
    artifact.sections["learned_scorer"].arrays["weights"] = np.zeros((30, 3, 100))
    with pytest.raises(ArtifactError, match=r"learned_scorer/weights: F = 100 features, the format says d \+ dv = 128"):
        write_artifact(tmp_path / "a.h5", artifact)


def test_learned_scorer_weights_beyond_float32_range_are_refused(artifact_path):
    _edit(artifact_path, lambda h5: h5["learned_scorer/weights"].__setitem__((0, 0, 0), 1e300))
    _refused(artifact_path, r"learned_scorer/weights: .*magnitude")


def test_recommendation_naming_a_policy_it_did_not_measure_is_refused(artifact_path):
    _edit(artifact_path, lambda h5: h5["recommendation/policy"].__setitem__(0, b"uniform/streaming"))
    _refused(artifact_path, r"recommendation/policy: 'uniform/streaming' .* not one of the candidates")


def test_serving_refuses_nan_scores_naming_the_layer_and_head(one_thread):
    """A calibration whose statistics overflow (as 3e38 covariances did) makes expected attention
    score NaN; compression must stop there, not keep arbitrary tokens."""
    from test_runtime_policy import identity_for

    from runtime import CompressionPolicy, generate
    from runtime.plan.calibration import Calibration

    model = make_tiny_llama()
    identity = identity_for(model)  # the tiny model's own architecture (compress_prompt checks it)
    mean = np.zeros((2, 4, 16), dtype=np.float32)
    cov = np.zeros((2, 4, 16, 16), dtype=np.float32)
    cov[1] = 3e38  # layer 1: every entry; its rotation overflows to inf - inf
    calibration = Calibration("hostile.h5", identity, {}, ("query_stats",), query_mean=mean, query_cov=cov)
    policy = CompressionPolicy(keep_ratio=0.5, scorer="expected_attention", statistics="calibrated", window=4)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"returned NaN scores for layer 1, KV head 0"):
        generate(model, ids, policy, calibration=calibration, max_new_tokens=1, pad_token_id=0)


def test_decode_time_eviction_refuses_nan_scores_once_the_round_ends(one_thread):
    """Decode-time eviction (``evict_every``) checks its scores once per round, after the step's last
    layer (issue 39: one host synchronisation per round): a scorer that turns NaN on layer 1, KV head
    1 only while decoding is still refused, naming the layer and head, before another token is served."""
    from runtime import CompressionPolicy, generate
    from runtime.scorers.keydiff import KeyDiffScorer

    class NaNWhileDecoding(KeyDiffScorer):
        def score(self, inputs):
            scores = super().score(inputs)
            if inputs.layer == 1 and min(inputs.next_positions) > 40:  # the prompt is 40 tokens
                scores = scores.clone()
                scores[:, 1] = float("nan")
            return scores

    model = make_tiny_llama()
    policy = CompressionPolicy(keep_ratio=0.5, scorer=NaNWhileDecoding(), evict_every=2, window=4)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"returned NaN scores for layer 1, KV head 1"):
        generate(model, ids, policy, max_new_tokens=8, pad_token_id=0)
    result = generate(
        model,
        ids,
        CompressionPolicy(keep_ratio=0.5, scorer="keydiff", evict_every=2, window=4),
        max_new_tokens=8,
        pad_token_id=0,
    )  # the same round with finite scores serves
    assert result.sequences.shape[1] == 48


# identity


def test_edited_head_dim_with_the_stored_fingerprint_is_refused(tmp_path, capsys):
    path = write_artifact(tmp_path / "a.h5", make_random_artifact(sections=("behaviour", "budgets")))
    _edit(path, lambda h5: h5["model"].attrs.__setitem__("head_dim", 32))
    _refused(path, "arch_fingerprint does not match the recorded architecture", capsys)


def test_writer_refuses_an_identity_whose_fingerprint_does_not_match(tmp_path):
    import dataclasses

    artifact = make_random_artifact(sections=())
    artifact.model = dataclasses.replace(artifact.model, arch_fingerprint="a" * 64)
    with pytest.raises(ArtifactError, match="arch_fingerprint does not match"):
        write_artifact(tmp_path / "a.h5", artifact)


@pytest.mark.parametrize("text", ["[1]", "not json", '{"rope_theta":NaN}'])
def test_rope_parameters_that_are_not_a_json_object_are_refused(artifact_path, text):
    _edit(artifact_path, lambda h5: h5["model"].attrs.__setitem__("rope_parameters", text))
    _refused(artifact_path, "rope_parameters")


@pytest.mark.parametrize(
    "version", ["1.-1", "-1.6", "1.+6", " 1.6", "1.6 ", "1_0.6", "1.6.0", "1", "1.", "\uff11.\uff16"]
)
def test_a_schema_version_that_is_not_two_non_negative_integers_is_refused(artifact_path, capsys, version):
    """Issue 41: "1.-1" validated (Python's int() reads "-1", "+6", " 1", "1_0" and other digits)."""
    _edit(artifact_path, lambda h5: h5.attrs.__setitem__("schema_version", version))
    _refused(artifact_path, "is not of the form MAJOR.MINOR", capsys)


@pytest.mark.parametrize("name", ["attention_variant", "weights_fingerprints"])
def test_an_optional_model_attribute_present_with_empty_text_is_refused(tmp_path, capsys, name):
    """Issue 41: an optional /model attribute set to '' read as absent: it changed no digest and the file
    validated (the writer leaves an absent one out; the spec has no empty value for either)."""
    import dataclasses

    from artifacts.fingerprint import architecture_fingerprint
    from artifacts.validation import ARCH_NUMBERS

    identity = make_random_artifact(sections=()).model
    numbers = {key: getattr(identity, key) for key in ARCH_NUMBERS}
    numbers["attention_variant"] = '{"sliding_window":64}'
    identity = dataclasses.replace(
        identity,
        attention_variant=numbers["attention_variant"],
        arch_fingerprint=architecture_fingerprint(numbers, identity.query_norm),
        weights_fingerprints=json.dumps({"float32": identity.weights_fingerprint}),
    )
    path = write_artifact(tmp_path / "kv_calibration.h5", make_random_artifact(identity))
    with open_artifact(path) as reader:  # the file as written is valid
        reader.validate()
    if name == "attention_variant":  # the fingerprint of the numbers without it, as a file without one has

        def edit(h5):
            h5["model"].attrs[name] = ""
            h5["model"].attrs["arch_fingerprint"] = architecture_fingerprint(
                {key: getattr(identity, key) for key in ARCH_NUMBERS}, identity.query_norm
            )

    else:

        def edit(h5):
            h5["model"].attrs[name] = ""

    _edit(path, edit)
    _refused(path, f"{name}.*empty", capsys)


# -- outputs and options (profile-model, evaluate-artifact, inspect-artifact) --
#
# Every file the tools write goes through one writer (common.atomic: atomic, a clear
# OutputError); every option and output path is checked before any model work.  "Disk full"
# is a real write failure: the child process runs under RLIMIT_FSIZE with SIGXFSZ ignored, so
# write() fails with EFBIG ("File too large") as it would with ENOSPC.

OUTPUTS_PROBES = 12


def _outputs_env() -> dict:
    from conftest import profile_env

    return profile_env()


def _limited(limit_bytes: int):
    """preexec_fn: files this child writes may not grow beyond ``limit_bytes`` (EFBIG, not SIGXFSZ)."""

    def apply():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    return apply


def _python(args: list[str], limit_bytes: int | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=_outputs_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if limit_bytes is None else _limited(limit_bytes),
        **kwargs,
    )


@pytest.fixture(scope="module")
def outputs_model_dir(tmp_path_factory, embedded_tokenizer):
    """A tiny random Llama with the embedded tokenizer, hand-built probes and calibration text."""
    from conftest import write_tiny_model_dir

    return write_tiny_model_dir(
        tmp_path_factory.mktemp("outputs-tiny-model"), embedded_tokenizer, probes=OUTPUTS_PROBES, seed=11
    )


def _profile_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    from conftest import tiny_profile_args

    return tiny_profile_args(model_dir, out, *extra, calib_samples=4)


def _profile(args: list[str]) -> int:
    from profiler.cli import main

    with single_thread():
        return main(args)


def _start_profile(args: list[str], wait_for: Path) -> subprocess.Popen:
    """Start profile-model in a child; return once ``wait_for`` exists (its first checkpoint)."""
    from conftest import start_profile

    return start_profile(args, wait_for)


def test_disk_full_during_the_final_artifact_write_exits_2_and_keeps_the_old_artifact(outputs_model_dir, tmp_path):
    from artifacts import open_artifact, write_artifact

    out = tmp_path / "kv_calibration.h5"
    write_artifact(out, make_random_artifact(sections=("moments",)))  # another model's, replaced with --force
    before = out.read_bytes()
    # 8 KiB: the behaviour work file (~3 KiB) fits, the final artifact (~15 KiB) does not
    args = _profile_args(outputs_model_dir, out, "--stages", "behaviour,budgets", "--force")
    done = _python(["-m", "profiler.cli", *args], limit_bytes=8 << 10)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cannot write the artifact {out}: File too large (the existing {out} is unchanged)" in done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert out.read_bytes() == before
    with open_artifact(out) as reader:
        reader.validate()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_every_output_writer_on_a_full_disk_raises_one_clear_error_and_keeps_the_old_file(tmp_path):
    """Artifact, work file, JSON and HTML report: one writer, one error, the old file intact."""
    script = """
import json, sys
sys.path.insert(0, "tests")
import numpy as np
from conftest import make_random_artifact
from artifacts import open_artifact, write_artifact
from common.atomic import OutputError, write_atomic
from artifacts.report import write_report
from profiler.checkpoint import save_work

directory = sys.argv[1]
writers = {
    "artifact": lambda p: write_artifact(p, make_random_artifact()),
    "work": lambda p: save_work(p, "job", {"behaviour": 1}, {"behaviour.W_R": np.zeros(1 << 17)}),
    "json": lambda p: write_atomic(p, json.dumps(list(range(1 << 16)))),
    "report": lambda p: write_report(p, open_artifact(directory + "/full.h5")),
}
for name, write in writers.items():
    try:
        write(f"{directory}/{name}.out")
    except OutputError as exc:
        print(name, exc)
    else:
        print(name, "written")
"""
    from artifacts import write_artifact

    write_artifact(tmp_path / "full.h5", make_random_artifact())
    for name in ("artifact", "work", "json", "report"):
        (tmp_path / f"{name}.out").write_bytes(b"previous " + name.encode())
    done = _python(["-c", script, str(tmp_path)], limit_bytes=64 << 10)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for name in ("artifact", "work", "json", "report"):
        target = tmp_path / f"{name}.out"
        assert lines[name].startswith("cannot write the ") and "File too large" in lines[name], lines[name]
        assert f"the existing {target} is unchanged" in lines[name]
        assert target.read_bytes() == b"previous " + name.encode()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_inspect_artifact_html_on_a_full_disk_keeps_the_previous_report(tmp_path):
    from artifacts import write_artifact

    artifact = write_artifact(tmp_path / "a.h5", make_random_artifact())
    report = tmp_path / "report.html"
    report.write_text("<p>the previous report</p>")
    done = _python(["-m", "artifacts.cli", str(artifact), "--html", str(report)], limit_bytes=16 << 10)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"inspect-artifact: cannot write the HTML report {report}: File too large" in done.stderr
    assert report.read_text() == "<p>the previous report</p>"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["directory", "device", "under-a-file"])
def test_inspect_artifact_html_to_a_directory_or_device_is_refused(tmp_path, capsys, kind):
    from artifacts import write_artifact
    from artifacts.cli import main

    artifact = write_artifact(tmp_path / "a.h5", make_random_artifact(sections=("moments",)))
    (tmp_path / "file").write_text("x")
    target = {"directory": str(tmp_path), "device": "/dev/full", "under-a-file": str(tmp_path / "file" / "r.html")}
    assert main([str(artifact), "--html", target[kind]]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the HTML report {target[kind]}" in err and "Traceback" not in err
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")  # the device is still a device


@pytest.mark.parametrize("option", ["--json", "--html"])
@pytest.mark.parametrize("kind", ["directory", "device", "under-a-file"])
def test_evaluate_artifact_output_paths_are_checked_before_any_model_work(tmp_path, capsys, option, kind):
    from profiler.evaluate_cli import main

    (tmp_path / "file").write_text("x")
    target = {"directory": str(tmp_path), "device": "/dev/full", "under-a-file": str(tmp_path / "file" / "out")}
    # a model that does not exist: the output error must come first, before anything is loaded
    assert main([str(tmp_path / "no-such-model"), option, target[kind]]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the {'JSON results' if option == '--json' else 'HTML report'} {target[kind]}" in err
    assert "no such model directory" not in err


def test_profile_model_refuses_to_overwrite_a_file_that_is_not_an_artifact(outputs_model_dir, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_bytes(os.urandom(4096))
    before = out.read_bytes()
    for extra in ((), ("--force",)):
        assert _profile(_profile_args(outputs_model_dir, out, "--stages", "query-stats", *extra)) == 2
        err = capsys.readouterr().err
        assert f"{out} exists and is not a kvcal artifact" in err
        assert out.read_bytes() == before
    assert not list(tmp_path.glob("*.work*"))


def test_profile_model_refuses_to_replace_another_models_artifact_unless_forced(outputs_model_dir, tmp_path, capsys):
    from artifacts import open_artifact, write_artifact

    out = tmp_path / "kv_calibration.h5"
    write_artifact(out, make_random_artifact(make_random_identity(name="another-model")))
    before = out.read_bytes()
    assert _profile(_profile_args(outputs_model_dir, out, "--stages", "query-stats")) == 2
    err = capsys.readouterr().err
    assert f"{out} is the artifact of another model (another-model)" in err and "--force" in err
    assert out.read_bytes() == before
    assert _profile(_profile_args(outputs_model_dir, out, "--stages", "query-stats", "--force")) == 0
    with open_artifact(out) as reader:
        assert set(reader.sections) == {"query_stats"}


@pytest.mark.parametrize(
    "option",
    [
        ("--keep-ratios", "1.5"),
        ("--keep-ratios", "0"),
        ("--beta", "nan"),
        ("--beta", "0.5"),
        ("--budgets", "0,64"),
        ("--min-budget", "-1"),
        ("--recommend-compression-ratios", "1"),
        ("--recommend-policies", ","),
        ("--keep-ratios", ","),
    ],
    ids=" ".join,
)
def test_profile_model_later_stage_options_are_refused_before_any_model_work(tmp_path, capsys, option):
    from profiler.cli import main

    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "no-such-model"), "--stages", "behaviour,budgets", *option])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}:" in err and "no such model directory" not in err


def test_profile_job_api_validates_every_setting_before_loading(tmp_path):
    from profiler.job import JobOptions, ProfileJob

    bad = {
        "keep_ratios": (1.5,),
        "beta": float("nan"),
        "token_budgets": (0,),
        "min_budget": -1,
        "calib_samples": 0,
        "max_new_tokens": 0,
        "batch_size": 0,
        "recommend_count": 0,
    }
    for name, value in bad.items():
        options = JobOptions(model=str(tmp_path / "no-such-model"), preset="quick", settings={name: value})
        with pytest.raises(ValueError):
            ProfileJob(options)


def test_resume_accepts_a_changed_option_of_a_later_unsharded_stage(outputs_model_dir, tmp_path, capsys):
    from artifacts import open_artifact

    out = tmp_path / "kv_calibration.h5"
    work = Path(str(out) + ".work.npz")
    args = _profile_args(outputs_model_dir, out, "--stages", "behaviour,budgets", "--checkpoint-every", "1")
    proc = _start_profile(args, work)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130 and work.exists() and not out.exists()
    # the budgets options were wrong: corrected, the behaviour work is kept
    assert _profile([*args, "--beta", "3", "--keep-ratios", "0.25,0.5", "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    with open_artifact(out) as reader:
        assert reader.config["budgets"]["beta"] == 3.0 and reader.config["budgets"]["ratios"] == [0.25, 0.5]
    # a changed option of the checkpointed (sharded) work is still refused
    proc = _start_profile(args, work)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert (
        _profile(
            [
                *_profile_args(outputs_model_dir, out, "--stages", "behaviour,budgets", "--max-new-tokens", "3"),
                "--resume",
            ]
        )
        == 2
    )
    assert "different job" in capsys.readouterr().err and work.exists()


def test_a_second_run_on_the_same_output_is_refused_and_a_dead_runs_lock_does_not_block(
    outputs_model_dir, tmp_path, capsys
):
    out = tmp_path / "kv_calibration.h5"
    work = Path(str(out) + ".work.npz")
    args = _profile_args(outputs_model_dir, out, "--stages", "behaviour", "--checkpoint-every", "1")
    first = _start_profile(args, work)
    try:
        first.send_signal(signal.SIGSTOP)  # still running (it holds its lock), just not progressing
        assert _profile(args) == 2
        err = capsys.readouterr().err
        assert f"another profile-model run (pid {first.pid}) is writing {out}" in err
        assert work.exists()  # its work file was left alone
    finally:
        first.kill()
        first.communicate(timeout=60)
    # killed: its lock died with it; --resume continues its work
    assert _profile([*args, "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out and out.is_file()
    assert Path(str(out) + ".lock").read_text() == ""  # free, naming no holder (filelock keeps the file)


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    from artifacts import write_artifact
    from common.atomic import STALE_TEMP_SECONDS

    out = tmp_path / "kv_calibration.h5"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom common.atomic import atomic_path\n"
            "with atomic_path(sys.argv[1]) as tmp:\n"
            "    tmp.write_bytes(b'x' * 100000); print(tmp.name, flush=True); time.sleep(600)\n",
            str(out),
        ],
        cwd=REPO,
        env=_outputs_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    name = writer.stdout.readline().strip()
    writer.kill()
    writer.wait(timeout=60)
    dead = tmp_path / name
    assert dead.exists() and f".{out.name}.{writer.pid}." in name
    live = tmp_path / f".{out.name}.{os.getpid()}.abc123.tmp"  # a live writer's (this process)
    fresh_dead = tmp_path / f".{out.name}.{writer.pid}.fresh1.tmp"  # dead, but modified just now
    other = tmp_path / f".other.h5.{writer.pid}.abc123.tmp"  # another destination's
    for path in (live, fresh_dead, other):
        path.write_bytes(b"x")
    old = time.time() - STALE_TEMP_SECONDS - 60
    for path in (dead, live, other):
        os.utime(path, (old, old))
    write_artifact(out, make_random_artifact(sections=("moments",)))
    assert not dead.exists()
    assert live.exists() and fresh_dead.exists() and other.exists()


@pytest.mark.parametrize(
    "option",
    [
        ("--calib-samples", "0"),
        ("--max-new-tokens", "0"),
        ("--batch-size", "0"),
        ("--calib-tokens", "0"),
        ("--batch-size", "-2"),
        ("--checkpoint-every", "0"),
        ("--recommend-count", "0"),
        ("--n-sink", "-1"),
        ("--scorer-probes", "-1"),
    ],
    ids=" ".join,
)
def test_profile_model_zero_or_negative_counts_are_refused_by_the_parser(capsys, option):
    from profiler.cli import main

    with pytest.raises(SystemExit) as exited:
        main([*option])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}: expected an integer in [" in err  # bounded: [minimum, maximum]


@pytest.mark.parametrize(
    "option",
    [("--policies", ","), ("--tasks", ","), ("--count", "0"), ("--max-new-tokens", "0"), ("--paired-tolerance", "nan")],
    ids=" ".join,
)
def test_evaluate_artifact_empty_lists_and_zero_counts_are_refused_by_the_parser(capsys, option):
    from profiler.evaluate_cli import main

    with pytest.raises(SystemExit) as exited:
        main([*option])
    assert exited.value.code == 2
    assert f"argument {option[0]}:" in capsys.readouterr().err


def test_evaluation_tasks_longer_than_the_models_context_are_refused_before_any_model_work():
    """A model whose context is shorter than every task length: a clear error while the tasks are
    chosen (inside evaluate-artifact's input checks), not a traceback from the runtime later."""
    from needles import PRESETS
    from profiler.held_out_tasks import held_out_tasks

    with pytest.raises(ValueError, match=r"context of 600 tokens.*shortest task length 1024"):
        held_out_tasks(PRESETS["quick"], families=("retrieval",), count=1, profiler_seed=0, model_context=600)
    tasks = held_out_tasks(PRESETS["quick"], families=("retrieval",), count=1, profiler_seed=0, model_context=2400)
    assert all(spec.lengths == (1024, 2048) for spec in tasks.specs)  # beyond 90% of the context: dropped
