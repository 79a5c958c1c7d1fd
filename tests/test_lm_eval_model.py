"""kvcal as lm-evaluation-harness's ``--model kvcal`` (runtime/lm_eval_model.py, issue 43) and the
``kvcal-lm-eval`` command (runtime/lm_eval_cli.py).

The bar: in an environment with the ``lm-eval`` extra installed, ``kvcal-lm-eval --model kvcal
--model_args compression_ratio=0.75 --tasks niah_single_1 --metadata '{"max_seq_lengths":[2048]}'
--limit 4`` runs offline on the embedded model and prints lm-eval's results table.  Then the
Python path, generation's stop strings, the log-likelihoods (compressed: at ratio 0 they are the
plain model's), and the model_args refused.  The command's argument rewriting and its message
without lm-eval: tests/test_lm_eval_cli.py (no lm-eval needed).

Skipped with a message where lm-eval is not installed (the main environment); ``make
test-lm-eval`` installs it (the ``lm-eval`` extra) and sets KVCAL_REQUIRE_LM_EVAL, which turns
the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("KVCAL_REQUIRE_LM_EVAL"):
    import lm_eval  # noqa: F401  (make test-lm-eval: a missing lm-eval fails, never skips)
pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed: pip install -e '.[lm-eval]' (make test-lm-eval runs these tests)"
)

from lm_eval.api.instance import Instance  # noqa: E402

from runtime.lm_eval_model import KvcalLM, question_split  # noqa: E402

BAR = [
    "kvcal-lm-eval",
    "--model",
    "kvcal",
    "--model_args",
    "compression_ratio=0.75",
    "--tasks",
    "niah_single_1",
    "--metadata",
    '{"max_seq_lengths":[2048]}',
    "--limit",
    "4",
]
FILLER = "The grass is green. The sky is blue. The sun is warm. Here we go. There and back again. "
CONTEXT = FILLER * 12 + "The passcode is 4821. Remember it. " + FILLER * 12


def offline_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.update(MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def request(kind: str, *arguments) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)


@pytest.fixture(scope="module")
def lm():
    return KvcalLM(compression_ratio=0.75)


def command(name: str) -> str:
    """An installed console script of this environment (kvcal's or lm-eval's)."""
    executable = Path(sys.executable).parent / name
    found = str(executable) if executable.exists() else shutil.which(name)
    assert found, f"no {name} command installed (pip install -e '.[lm-eval]')"
    return found


@pytest.mark.slow
def test_the_issues_command_runs_offline_and_prints_the_results_table(tmp_path):
    """The bar: the exact command, offline, in a fresh directory: exit 0 and lm-eval's table with a
    score; the embedded model's tokenizer was named for RULER, and the log says so."""
    result = subprocess.run(
        [command(BAR[0]), *BAR[1:]], cwd=tmp_path, env=offline_env(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert table and table[0].replace(" ", "").startswith("|Tasks|Version|Filter|n-shot|Metric|"), result.stdout
    row = next(line for line in table if "niah_single_1" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4] == "2048" and 0.0 <= float(cells[6]) <= 1.0, row
    assert "kvcal ({'compression_ratio': 0.75})" in result.stdout
    from common.models import embedded_model_dir

    assert f"the task metadata gets tokenizer={embedded_model_dir()}" in result.stderr


def test_the_commands_help_is_lm_evals_with_kvcal_registered():
    result = subprocess.run([command("kvcal-lm-eval"), "--help"], capture_output=True, text=True, env=offline_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kvcal-lm-eval: lm-evaluation-harness's command line")
    assert "model 'kvcal' registered" in result.stdout and "Language Model Evaluation Harness" in result.stdout


@pytest.mark.slow
def test_the_python_path_records_how_the_prompt_was_compressed(lm, one_thread):
    """``simple_evaluate`` with a KvcalLM; RULER's prompt splits at its question line, so the run is
    question-agnostic, and the results' config says so."""
    import lm_eval

    before = dict(lm.counts)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["niah_single_1"],
        limit=1,
        metadata={"tokenizer": lm.tokenizer_source, "max_seq_lengths": [2048]},
    )
    assert "niah_single_1" in results["results"]
    info = results["config"]["kvcal"]
    assert info["compression_ratio"] == 0.75 and info["policy"] == "uniform/leverage" and info["question"] == "auto"
    assert info["question_agnostic_prompts"] == before["question_agnostic_prompts"] + 1
    assert info["question_aware_prompts"] == before["question_aware_prompts"]


def test_ruler_prompts_split_at_their_question():
    niah = "Some special magic numbers are hidden.\nfoo bar\nWhat are all the special magic numbers for x mentioned?"
    assert niah[question_split(niah) :].startswith("\nWhat are all the special magic numbers")
    single = niah.replace("are all", "is")
    assert question_split(single) == niah.index("\nWhat")
    assert question_split("No question line here.") is None


def test_generation_stops_at_until_and_max_gen_toks(lm, one_thread):
    prompt = CONTEXT + "\nQuestion: What is the passcode? Answer in one sentence."
    stopped, long = lm.generate_until(
        [
            request("generate_until", prompt, {"until": ["."], "max_gen_toks": 24}),
            request("generate_until", prompt, {"until": [], "max_gen_toks": 4}),
        ]
    )
    assert "." not in stopped and stopped.strip(), stopped
    assert len(lm.tokenizer(long, add_special_tokens=False)["input_ids"]) <= 5, long
    assert lm.counts["question_agnostic_prompts"] >= 1  # "\nQuestion: " splits the prompt


def test_loglikelihood_is_scored_through_the_compressed_cache(one_thread):
    """At ratio 0 (nothing evicted) the score is the plain model's; at 0.75 the cache really was cut."""
    context, continuation = CONTEXT + "The passcode is", " 4821."
    whole = KvcalLM(compression_ratio=0.0)
    (score, greedy), *_ = whole.loglikelihood([request("loglikelihood", context, continuation)])
    ids = whole.tokenizer(context + continuation)["input_ids"]
    start = len(whole.tokenizer(context)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(whole.model(torch.tensor([ids])).logits[0].float(), -1)
    plain = sum(float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids)))
    assert score == pytest.approx(plain, abs=1e-3) and isinstance(greedy, bool)
    cut = KvcalLM(compression_ratio=0.75)
    (compressed, _), *_ = cut.loglikelihood([request("loglikelihood", context, continuation)])
    assert compressed != pytest.approx(plain, abs=1e-4) and cut.counts["loglikelihood_requests"] == 1


def test_loglikelihood_without_a_context_and_rolling_are_refused(lm):
    with pytest.raises(ValueError, match="nothing to compress.*--model hf"):
        lm.loglikelihood([request("loglikelihood", "", " hello")])
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling.*--model hf"):
        lm.loglikelihood_rolling([request("loglikelihood_rolling", "some text")])


@pytest.mark.parametrize(
    ("model_args", "error", "message"),
    [
        ({"compression_ratio": 0.5, "ratio": 0.5}, ValueError, r"unknown kvcal model_args \['ratio'\]"),
        ({"compression_ratio": 1.5}, ValueError, r"compression_ratio must be in \[0, 1\)"),
        ({"compression_ratio": "lots"}, ValueError, "compression_ratio must be a number"),
        ({}, ValueError, "kvcal needs compression_ratio"),
        ({"compression_ratio": 0.5, "artifact": "no/such.h5"}, FileNotFoundError, "no artifact file no/such.h5"),
        ({"compression_ratio": 0.5, "question": "sometimes"}, ValueError, "question must be one of auto, agnostic"),
        ({"compression_ratio": 0.5, "policy": "uniform/nosuchscorer"}, ValueError, "nosuchscorer"),
        ({"compression_ratio": 0.5, "policy": "baseline"}, ValueError, "compresses nothing.*--model hf"),
    ],
)
def test_bad_model_args_are_refused_with_a_clear_message(model_args, error, message):
    with pytest.raises(error, match=message):
        KvcalLM(**model_args)


def test_importing_the_module_registers_kvcal_beside_lm_evals_models():
    """``import runtime.lm_eval_model`` is enough for ``simple_evaluate(model="kvcal")``; lm-eval's
    own models stay registered; and a name registered first (as kvcal-lm-eval registers it, lazily
    by its target) is kept and resolves to the same class."""
    probe = (
        "import sys\n"
        "from lm_eval.api.registry import get_model, model_registry\n"
        "if sys.argv[1] == 'lazy':\n"
        "    import lm_eval.models\n"
        "    model_registry.register('kvcal', target='runtime.lm_eval_model:KvcalLM')\n"
        "    assert 'runtime.lm_eval_model' not in sys.modules\n"
        "import runtime.lm_eval_model as module\n"
        "assert get_model('kvcal') is module.KvcalLM and 'hf' in model_registry, list(model_registry)\n"
        "print(get_model('kvcal').__module__, get_model('kvcal').__name__)\n"
    )
    for mode in ("plain", "lazy"):
        result = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, env=offline_env())
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["runtime.lm_eval_model", "KvcalLM"], mode


def test_the_declared_entry_point_resolves_to_kvcal_through_lm_evals_registry():
    """``lm_eval --model kvcal`` without kvcal-lm-eval: an lm-eval with entry-point discovery
    (EleutherAI/lm-evaluation-harness PR #4013) registers each ``lm_eval.models`` entry point as a
    lazy placeholder and resolves it on first use.  The same placeholder, the entry point kvcal's
    pyproject.toml declares, resolves here through lm-eval's own registry to :class:`KvcalLM` (an
    lm-eval ``LM``), importing kvcal's runtime only then.  Run with lm-eval at that PR's commit, the
    issue's command with ``pretrained`` named printed its table (docs/results.md R-lm-eval-plugin-2026-11-28)."""
    import tomllib

    value = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "entry-points"
    ]["lm_eval.models"]["kvcal"]
    probe = (
        "import sys, importlib.metadata as md\n"
        "from lm_eval.api.model import LM\n"
        "from lm_eval.api.registry import Registry\n"
        "registry = Registry('model', base_cls=LM)\n"
        "registry.register('kvcal', target=md.EntryPoint(name='kvcal', value=sys.argv[1], group='lm_eval.models'))\n"
        "assert 'runtime.lm_eval_model' not in sys.modules\n"
        "model = registry.get('kvcal')\n"
        "assert issubclass(model, LM)\n"
        "print(model.__module__, model.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, value], capture_output=True, text=True, env=offline_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["runtime.lm_eval_model", "KvcalLM"]


@pytest.mark.slow
def test_simple_evaluate_takes_the_model_by_name(one_thread):
    """The Python path by name: the module imported above registered ``kvcal``; RULER's tokenizer is
    named in the metadata (only kvcal-lm-eval names the embedded model's by itself)."""
    import lm_eval

    from common.models import embedded_model_dir

    results = lm_eval.simple_evaluate(
        model="kvcal",
        model_args={"compression_ratio": 0.75},
        tasks=["niah_single_1"],
        limit=1,
        metadata={"tokenizer": str(embedded_model_dir()), "max_seq_lengths": [2048]},
    )
    assert 0.0 <= results["results"]["niah_single_1"]["2048,none"] <= 1.0
    assert results["config"]["kvcal"]["question_agnostic_prompts"] == 1


def test_an_artifact_serves_its_policy_unless_one_is_named(smoke_artifact, one_thread):
    """``artifact=PATH``: what ``calibration.policy(r)`` serves; ``policy=NAME`` instead of it; both
    recorded, and a generation runs through the artifact's policy."""
    from runtime import load_calibration

    served = KvcalLM(compression_ratio=0.75, artifact=str(smoke_artifact))
    expected = load_calibration(served.model, served.tokenizer, path=smoke_artifact).policy(0.75)
    assert served.policy == expected and served.get_model_info()["kvcal"]["artifact"] == str(smoke_artifact)
    (answer,) = served.generate_until(
        [request("generate_until", CONTEXT + "\nQuestion: What is the passcode?", {"until": ["\n"], "max_gen_toks": 8})]
    )
    assert isinstance(answer, str)
    named = KvcalLM(compression_ratio=0.5, artifact=str(smoke_artifact), policy="inf/leverage")
    assert (named.policy.allocation, named.policy.scorer, named.policy.compression_ratio) == ("inf", "leverage", 0.5)
    assert named.get_model_info()["kvcal"]["policy"] == "inf/leverage"


def test_a_batch_answers_as_its_prompts_one_by_one(one_thread):
    """batch_size=2: prompts of different lengths, left-padded into one batch (each row compressed on
    its own real length), give the greedy answers they give one at a time, in the requests' order."""
    prompts = [
        CONTEXT + "\nQuestion: What is the passcode?",
        FILLER * 3 + "The passcode is 77. " + FILLER * 5 + "\nQuestion: What is the passcode?",
        CONTEXT + "\nQuestion: What colour is the grass?",
    ]
    requests = [request("generate_until", prompt, {"until": ["\n"], "max_gen_toks": 6}) for prompt in prompts]
    single = KvcalLM(compression_ratio=0.5)
    one_by_one = [single.generate_until([one])[0] for one in requests]
    batched = KvcalLM(compression_ratio=0.5, batch_size=2).generate_until(requests)
    assert batched == one_by_one


def test_ruler_table_instances_are_lm_evals_split_at_the_question_in_both_prompt_formats():
    """benchmarks/ruler_table.py builds its instances with lm-eval's task code: two builds (each seeded as
    simple_evaluate is) give the same document; ``plain`` is lm-eval's request text cut where the question
    starts, ``chat`` wraps the context in the chat template and ends the question with the answer prefix
    (kvpress's pipeline); the task's own process_results scores an answer."""
    import argparse
    import importlib.util

    from common.models import embedded_model_dir, load_tokenizer

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "ruler_table.py"
    spec = importlib.util.spec_from_file_location("ruler_table_lm_eval", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    tokenizer, source = load_tokenizer(), str(embedded_model_dir())
    built = {
        prompt: table.build_instances(
            argparse.Namespace(tasks=["niah_single_1"], length=1024, limit=1, prompt=prompt), tokenizer, source
        )["instances"]
        for prompt in ("plain", "chat")
    }
    (plain,), (chat,) = built["plain"], built["chat"]
    doc = plain["doc"]
    assert chat["doc"] == doc and chat["id"] == "niah_single_1/0"
    assert (chat["max_gen_toks"], chat["until"], chat["metric"]) == (128, [], "1024")
    cut = question_split(doc["input"])
    assert plain["context_ids"] == tokenizer(doc["input"][:cut])["input_ids"]
    assert tokenizer.decode(plain["question_ids"]) == doc["input"][cut:] + " " + doc["gen_prefix"]
    context = tokenizer.decode(chat["context_ids"])
    assert context.startswith("<|im_start|>") and doc["outputs"][0] in context and "special magic" not in context[-80:]
    question = tokenizer.decode(chat["question_ids"])
    assert "<|im_start|>assistant" in question and question.endswith(doc["gen_prefix"])
    assert table.score(chat, f" {doc['outputs'][0]}.") == 1.0 and table.score(chat, " 1000.") == 0.0


def test_a_hybrid_models_batches_hold_questions_of_one_length(one_thread):
    """On a model with recurrent layers (a tiny Qwen3.5) a question-agnostic batch cannot hold padding between a row's
    context and its question (runtime.serve.generation.refuse_padding_inside_rows): the requests are batched by
    their question's length, and each answer is the prompt's alone."""
    from test_hybrid_models import hybrid, serves_hybrids

    from common.models import load_tokenizer

    serves_hybrids()
    tokenizer = load_tokenizer()
    model = hybrid(vocab_size=len(tokenizer))
    prompts = [
        CONTEXT + "\nQuestion: What is the passcode?",
        FILLER * 3 + "The passcode is 77. " + FILLER * 2 + "\nQuestion: What is the passcode that was given above?",
        FILLER * 2 + "\nQuestion: What colour is the sky?",
        CONTEXT + "\nQuestion: What colour is the grass today, in the story?",
    ]
    requests = [request("generate_until", prompt, {"until": ["\n"], "max_gen_toks": 4}) for prompt in prompts]
    single = KvcalLM(pretrained=model, tokenizer=tokenizer, compression_ratio=0.5, question="agnostic")
    one_by_one = [single.generate_until([one])[0] for one in requests]
    lm = KvcalLM(pretrained=model, tokenizer=tokenizer, compression_ratio=0.5, question="agnostic", batch_size=4)
    assert lm.generate_until(requests) == one_by_one
