"""Makes ``lm_eval --model kvcal`` resolve, without a change to lm-eval.

lm-eval (0.4.13, its newest release) finds a ``--model`` name only in its own registry, filled by
its own ``lm_eval/models/__init__.py``: it reads no entry points for models and imports no
user module before it resolves the name.  So ``kvcal-lm-eval.pth`` (installed into
site-packages with kvcal) imports this module at interpreter start-up; it imports nothing else
(about a millisecond) and only watches for lm-eval's registry module and, once lm-eval
has loaded it, registers ``kvcal`` with the registry's own public lazy form,
``model_registry.register("kvcal", target="runtime.lm_eval_model:KvcalLM")`` (kvcal's runtime
and torch load only when a run asks for ``--model kvcal``).  Nothing happens in a process that
never imports lm-eval.

When lm-eval reads entry points for models (merged upstream after 0.4.13, in no release yet), an
entry point should replace this file.

One more thing ``lm_eval --model kvcal`` needs: RULER's tasks build their prompts with the
tokenizer named by ``tokenizer``, ``pretrained`` or ``model`` in ``--model_args`` / ``--metadata``
and stop when none is named; kvcal's default model is the embedded one, named by no argument.
For ``--model kvcal`` without any of the three, the command line's task metadata gets
``tokenizer=<the embedded model's directory>``, the tokenizer of the model kvcal then loads
(lm-eval's ``EvaluatorConfig``, wrapped here, merges ``--model_args`` into ``--metadata``).
"""

from __future__ import annotations

import sys

MODEL = "kvcal"
TARGET = "runtime.lm_eval_model:KvcalLM"
_TOKENIZER_KEYS = ("tokenizer", "pretrained", "model")


def register(registry_module) -> None:
    """Register ``kvcal`` lazily in lm-eval's model registry (after lm-eval's own models)."""
    import lm_eval.models  # noqa: F401  (lm-eval fills its registry only while it is empty: fill it first)

    registry = registry_module.model_registry
    if MODEL not in registry:
        registry.register(MODEL, target=TARGET)


def add_tokenizer_default(config_module) -> None:
    """``--model kvcal`` with no tokenizer named: the task metadata names the embedded model's."""
    config = config_module.EvaluatorConfig
    process = config._process_arguments

    def process_arguments(self):
        if self.model == MODEL:
            named = {**(self.model_args or {}), **(self.metadata or {})}
            if not any(named.get(key) for key in _TOKENIZER_KEYS):
                from common.models import embedded_model_dir

                self.metadata = {**(self.metadata or {}), "tokenizer": str(embedded_model_dir())}
        return process(self)

    config._process_arguments = process_arguments


HOOKS = {"lm_eval.api.registry": register, "lm_eval.config.evaluate_config": add_tokenizer_default}


# Plain classes (the import system needs only these methods): importlib.abc would be one more
# module to load at every start-up.
class _Loader:
    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.hook(module)


class _Finder:
    """Finds nothing itself: wraps the loader of the modules in HOOKS to run their hook after them."""

    def find_spec(self, name, path, target=None):
        hook = HOOKS.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, hook)
                return spec
        return None


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
